r"""
`medusa-heads tune`: the shipped lossless configurations timed on this machine, the fastest recorded as what
`generate` and `serve` run at batch 1 when the user names none (`registry.default_configuration`).

The candidates are the table's batch-1 row and those of `configs/tune.json` (`registry.tune_candidates`). Each
answers the same few prompts greedily, in rotating order per prompt, after a warm-up; the fastest is the one of
least median time a token. The record is cached next to the latency profiles, named as they are by device (a CPU
by its name, family and model numbers), dtype and thread count, so a choice made on one CPU is never read on
another; the runtime reads it through `inference/tuned.py`.
"""

import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from medusa_heads.backbone import EMBEDDED_MODEL, load_tokenizer
from medusa_heads.inference import generate, make_drafter, warm_up
from medusa_heads.inference.registry import Configuration, tune_candidates
from medusa_heads.inference.tuned import RECORD_VERSION, machine, record_path
from medusa_heads.model import MedusaModel

Measure = Callable[[Configuration, str], tuple[float, int]]  # (seconds, new tokens) of one greedy answer


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
    record = {"version": RECORD_VERSION, **machine(dtype, device), "date": date.today().isoformat(),
              "choice": candidates[best].settings(), "prompts": len(runs[0]), "max_new_tokens": max_new_tokens,
              "measured": measured}
    path = record_path(dtype, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return record, path


def greedy_timer(candidates: Sequence[Configuration], dtype: torch.dtype, device: torch.device,
                 max_new_tokens: int, warmup: str, compile_step: bool | str = False) -> Measure:
    """A `Measure` that times a candidate's greedy answer on its own model (its heads on the embedded backbone),
    all loaded here (with `from_pretrained`'s `compile_step`, as `generate` would run them) and warmed up on
    `warmup`."""
    tokenizer = load_tokenizer(EMBEDDED_MODEL)
    loaded = []
    for candidate in candidates:
        model = MedusaModel.from_pretrained(candidate.heads_path, dtype=dtype, device=device,
                                            quantize_drafter=candidate.quantize_drafter, compile_step=compile_step)
        drafter = make_drafter(model, candidate.drafter, **candidate.options)
        warm_up(model, drafter, lambda line: print(line, file=sys.stderr))
        loaded.append((model, drafter))

    def answer(candidate: Configuration, prompt: str) -> tuple[float, int]:
        model, drafter = loaded[candidates.index(candidate)]
        start = time.perf_counter()
        result = generate(model, tokenizer, prompt, drafter, max_new_tokens=max_new_tokens)
        return time.perf_counter() - start, result.stats.new_tokens

    for candidate in candidates:
        answer(candidate, warmup)
    return answer
