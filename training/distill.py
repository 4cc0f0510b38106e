"""Self-distillation data: the backbone answers prompts itself, so heads learn its own distribution.

`medusa-heads distill --prompts FILE.jsonl --out ANSWERS.jsonl` writes one row per prompt in OpenAI
`messages` format plus the exact answer token ids. A prompt row holds a `prompt` (one user turn) or
`messages` (a conversation ending with a user turn, as `medusa-heads follow-ups` writes). It appends as it
goes and skips prompts already in `--out`, so a killed run resumes where it stopped.
"""

import json
import logging
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads.backbone import EMBEDDED_MODEL, load_backbone, load_tokenizer
from medusa_heads.errors import MedusaError, read_jsonl
from medusa_heads.quantize import quantize_backbone

logger = logging.getLogger(__name__)


def read_prompts(path: Path) -> list[dict]:
    """Rows {id, messages}: the conversation each answer continues."""
    try:
        rows = read_jsonl(path, "Prompt file", "prompt", str)
    except MedusaError:
        rows = read_jsonl(path, "Prompt file", "messages", list)
    out = []
    for n, row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if messages[-1].get("role") != "user":
            raise MedusaError(f"{path}:{n}: the conversation must end with a user turn.")
        out.append({"id": str(row.get("id", n)), "messages": messages})
    if not out:
        raise MedusaError(f"Prompt file `{path}` holds no prompts.")
    return out


def done_ids(out: Path) -> set[str]:
    """Ids already answered; a line cut short by a kill is removed so that appending stays valid."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with open(out, "r+b") as f:
            f.truncate(len(data))
    return {json.loads(line)["id"] for line in data.decode().splitlines() if line.strip()}


class Writer:
    """The backbone continuing batches of conversations (left-padded batched `generate`)."""

    def __init__(self, model: str = EMBEDDED_MODEL, dtype: str = "auto", device: str = "cpu",
                 quantize: str = "none"):
        self.tokenizer = load_tokenizer(model)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.backbone = load_backbone(model, dtype=dtype, device=device)
        quantize_backbone(self.backbone, quantize)
        eos = self.backbone.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def chat_text(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @torch.no_grad()
    def continue_texts(self, texts: list[str], max_new_tokens: int, temperature: float = 0.0,
                       top_p: float = 1.0) -> list[list[int]]:
        """The new token ids for each text, cut after the first end-of-turn token."""
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        enc = enc.to(self.backbone.device)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 \
            else {"do_sample": False}
        generated = self.backbone.generate(**enc, max_new_tokens=max_new_tokens,
                                           pad_token_id=self.tokenizer.pad_token_id,
                                           **sampling)[:, enc["input_ids"].shape[1] :]
        out = []
        for ids in generated.tolist():
            cut = next((k + 1 for k, t in enumerate(ids) if t in self.eos), len(ids))
            out.append(ids[:cut])
        return out


def append_rows(f, rows: list[dict]) -> None:
    """Append and sync, so that a killed run loses at most the batch in flight."""
    for row in rows:
        f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())


def distill(prompts: Path, out: Path, model: str = EMBEDDED_MODEL, batch_size: int = 32, max_new_tokens: int = 256,
            temperature: float = 0.0, dtype: str = "auto", device: str = "cpu", limit: int | None = None,
            seed: int = 0, quantize: str = "none", top_p: float = 1.0) -> int:
    """`temperature` > 0: sampled answers (with `top_p`); `quantize`: answers of the backbone with int8 weights."""
    rows = read_prompts(prompts)[:limit]
    skip = done_ids(out)
    todo = [r for r in rows if r["id"] not in skip]
    logger.info("%d prompts, %d already answered in %s, %d to go", len(rows), len(rows) - len(todo), out, len(todo))
    if not todo:
        return 0
    writer = Writer(model, dtype, device, quantize)
    texts = [writer.chat_text(r["messages"]) for r in todo]
    # Similar lengths in a batch waste less padding.
    order = sorted(range(len(todo)), key=lambda i: len(texts[i]))
    torch.manual_seed(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    made, start = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="distill", unit="prompt")
    with open(out, "a") as f:
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            answers = writer.continue_texts([texts[i] for i in idx], max_new_tokens, temperature, top_p)
            rows_out = []
            for i, ids in zip(idx, answers):
                answer = writer.tokenizer.decode(ids, skip_special_tokens=True)
                rows_out.append({"id": todo[i]["id"],
                                 "messages": todo[i]["messages"] + [{"role": "assistant", "content": answer}],
                                 "answer_ids": ids})
                made += len(ids)
            append_rows(f, rows_out)
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{made / (time.perf_counter() - start):.0f}")
    bar.close()
    logger.info("wrote %d answers (%d tokens) to %s", len(todo), made, out)
    return made
