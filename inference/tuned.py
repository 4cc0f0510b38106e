r"""
The record `medusa-heads tune` writes (`medusa_heads/apps/tune.py`), as the runtime reads it: where it sits for this
device, dtype and thread count, and the configuration it names if it is this machine's and still valid.
"""

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Sequence, TypeVar

import torch

from medusa_heads.backbone import EMBEDDED_MODEL
from medusa_heads.device import cache_file, device_name

logger = logging.getLogger(__name__)

# 2: the Hydra/Medusa steps became frozen packages on AMX CPUs (`frozen_step.py`), 1.4x faster; 3: EAGLE-3 steps
# too (1.6x): records made before chose among other speeds
RECORD_VERSION = 3
Candidate = TypeVar("Candidate")  # a registry.Configuration: a frozen dataclass with `settings()` and `tuned_on`


def machine(dtype: torch.dtype, device: torch.device) -> dict:
    """What a record is valid for: the device's name, the dtype and torch's thread count."""
    return {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads()}


def record_path(dtype: torch.dtype, device: torch.device) -> Path:
    """Where `tune` records its choice for this device, dtype and thread count."""
    here = machine(dtype, device)
    return cache_file(EMBEDDED_MODEL, "tuned", here["device"], here["dtype"], f"{here['threads']}threads")


def tuned_choice(dtype: torch.dtype, device: torch.device, candidates: Sequence[Candidate]) -> Candidate | None:
    """The one of `candidates` that `tune` recorded for this device, dtype and thread count, or None. A record that
    cannot be read, is of another version or names none of `candidates` is left as it is, with a one-line
    warning."""
    path = record_path(dtype, device)
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        recorded_on = {k: record[k] for k in ("device", "dtype", "threads")}
        version, chosen, tuned_on = record["version"], record["choice"], record["date"]
    except (OSError, ValueError, KeyError, TypeError) as err:  # ValueError: not JSON, or not text
        logger.warning("`%s` is not a record of `medusa-heads tune` (%s: %s): the project's table applies; run "
                       "`medusa-heads tune` to replace it.", path, type(err).__name__, err)
        return None
    if recorded_on != machine(dtype, device):
        return None  # another machine's record under a name that this one's shares
    match = next((c for c in candidates if c.settings() == chosen), None)
    if match is None or version != RECORD_VERSION:
        logger.warning("`%s` was written by another version of medusa-heads, or names a configuration this one does "
                       "not ship: the project's table applies; run `medusa-heads tune` again.", path)
        return None
    return replace(match, tuned_on=tuned_on)
