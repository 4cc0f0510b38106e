r"""
`medusa-heads tune`: the shipped lossless configurations timed on this machine, the fastest recorded as what
`generate` and `serve` run at batch 1 when the user names none (`registry.default_configuration`).

The candidates are the table's batch-1 row and those of `configs/tune.json` (`registry.tune_candidates`). Each
answers the same few prompts greedily, in rotating order per prompt, after a warm-up; the fastest is the one of
least median time a token. The record is cached next to the latency profiles, named as they are by device (a CPU
by its name, family and model numbers), dtype and thread count, so a choice made on one CPU is never read on
another.
"""

import json
import logging
import statistics
import time
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from medusa_heads.backbone import EMBEDDED_MODEL, load_tokenizer
from medusa_heads.inference import generate, make_drafter
from medusa_heads.inference.registry import Configuration, tune_candidates
from medusa_heads.model import MedusaModel

from .profile import cache_file, device_name

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
Measure = Callable[[Configuration, str], tuple[float, int]]  # (seconds, new tokens) of one greedy answer


def _machine(dtype: torch.dtype, device: torch.device) -> dict:
    return {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads()}


def record_path(dtype: torch.dtype, device: torch.device) -> Path:
    """Where `tune` records its choice for this device, dtype and thread count."""
    machine = _machine(dtype, device)
    return cache_file(EMBEDDED_MODEL, "tuned", machine["device"], machine["dtype"], f"{machine['threads']}threads")


def tuned_choice(dtype: torch.dtype, device: torch.device) -> Configuration | None:
    """The configuration `tune` recorded for this device, dtype and thread count, or None. A record that cannot be
    read, is of another version or names a configuration no longer shipped is left as it is, with a one-line
    warning."""
    path = record_path(dtype, device)
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        machine = {k: record[k] for k in ("device", "dtype", "threads")}
        version, chosen, tuned_on = record["version"], record["choice"], record["date"]
    except (OSError, ValueError, KeyError, TypeError) as err:  # ValueError: not JSON, or not text
        logger.warning("`%s` is not a record of `medusa-heads tune` (%s: %s): the project's table applies; run "
                       "`medusa-heads tune` to replace it.", path, type(err).__name__, err)
        return None
    if machine != _machine(dtype, device):
        return None  # another machine's record under a name that this one's shares
    match = next((c for c in tune_candidates(dtype) if c.settings() == chosen), None)
    if match is None or version != RECORD_VERSION:
        logger.warning("`%s` was written by another version of medusa-heads, or names a configuration this one does "
                       "not ship: the project's table applies; run `medusa-heads tune` again.", path)
        return None
    return replace(match, tuned_on=tuned_on)


def time_candidates(candidates: Sequence[Configuration], prompts: Sequence[str], measure: Measure,
                    seconds: float) -> list[list[tuple[float, int]]]:
    """(seconds, tokens) of each candidate's answer to each prompt, the candidates in rotating order per prompt so
    that drift spreads over them; the prompts after the one that ends past `seconds` are left out."""
    runs: list[list[tuple[float, int]]] = [[] for _ in candidates]
    end = time.perf_counter() + seconds
    with tqdm(total=len(prompts) * len(candidates), desc="tune", unit="answer") as bar:
        for p, prompt in enumerate(prompts):
            for i in [(p + k) % len(candidates) for k in range(len(candidates))]:
                runs[i].append(measure(candidates[i], prompt))
                bar.update()
            if time.perf_counter() > end:
                break
    return runs


def tune(dtype: torch.dtype, device: torch.device, prompts: Sequence[str], measure: Measure, max_new_tokens: int,
         seconds: float = 120) -> tuple[dict, Path]:
    r"""
    Time every candidate for `dtype` on `prompts` with `measure` (the prompts that start after `seconds` are left
    out) and record the fastest by median time a token. Returns the record (the machine, the choice, each
    candidate's timings) and where it was written.
    """
    candidates = tune_candidates(dtype)
    runs = time_candidates(candidates, prompts, measure, seconds)
    measured = [{**c.settings(), "ms_per_token": round(statistics.median(1000 * s / max(n, 1) for s, n in r), 3),
                 "tokens_per_second": round(sum(n for _, n in r) / sum(s for s, _ in r), 2)}
                for c, r in zip(candidates, runs)]
    best = min(range(len(candidates)), key=lambda i: measured[i]["ms_per_token"])
    record = {"version": RECORD_VERSION, **_machine(dtype, device), "date": date.today().isoformat(),
              "choice": candidates[best].settings(), "prompts": len(runs[0]), "max_new_tokens": max_new_tokens,
              "measured": measured}
    path = record_path(dtype, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return record, path


def greedy_timer(candidates: Sequence[Configuration], dtype: torch.dtype, device: torch.device,
                 max_new_tokens: int, warmup: str) -> Measure:
    """A `Measure` that times a candidate's greedy answer on its own model (its heads on the embedded backbone),
    all loaded here and warmed up on `warmup`."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    loaded = []
    for candidate in candidates:
        model = MedusaModel.from_pretrained(candidate.heads_path, dtype=dtype, device=device,
                                            quantize_drafter=candidate.quantize_drafter)
        loaded.append((model, make_drafter(model, candidate.drafter, **candidate.options)))

    def answer(candidate: Configuration, prompt: str) -> tuple[float, int]:
        model, drafter = loaded[candidates.index(candidate)]
        start = time.perf_counter()
        result = generate(model, tokenizer, prompt, drafter, max_new_tokens=max_new_tokens)
        return time.perf_counter() - start, result.stats.new_tokens

    for candidate in candidates:
        answer(candidate, warmup)
    return answer
