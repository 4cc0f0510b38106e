"""The folder where medusa-heads keeps what it makes once: the converted model, built operators, compiled graphs,
measurements of this machine."""

import os
from pathlib import Path


def cache_home() -> Path:
    return Path(os.environ.get("MEDUSA_HEADS_HOME", Path.home() / ".cache" / "medusa-heads"))
