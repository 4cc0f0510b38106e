"""Self-distillation data: the backbone answers prompts itself, so heads learn its own distribution.

`medusa-heads distill --prompts FILE.jsonl --out ANSWERS.jsonl` writes one row per prompt in OpenAI
`messages` format plus the exact answer token ids. It appends as it goes and skips prompts already in
`--out`, so a killed run resumes where it stopped.
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
    rows = [{"id": str(row.get("id", n)), "prompt": row["prompt"]}
            for n, row in read_jsonl(path, "Prompt file", "prompt", str)]
    if not rows:
        raise MedusaError(f"Prompt file `{path}` holds no prompts.")
    return rows


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


@torch.no_grad()
def distill(prompts: Path, out: Path, model: str = EMBEDDED_MODEL, batch_size: int = 32, max_new_tokens: int = 256,
            temperature: float = 0.0, dtype: str = "bfloat16", device: str = "cpu", limit: int | None = None,
            seed: int = 0, quantize: str = "none") -> int:
    """`quantize`: answers of the backbone with int8 weights (`medusa_heads.quantize`)."""
    rows = read_prompts(prompts)[:limit]
    skip = done_ids(out)
    todo = [r for r in rows if r["id"] not in skip]
    logger.info("%d prompts, %d already answered in %s, %d to go", len(rows), len(rows) - len(todo), out, len(todo))
    if not todo:
        return 0
    tokenizer = load_tokenizer(model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    backbone = load_backbone(model, dtype=dtype, device=device)
    quantize_backbone(backbone, quantize)
    eos = backbone.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                           tokenize=False) for r in todo]
    # Similar lengths in a batch waste less padding.
    order = sorted(range(len(todo)), key=lambda i: len(texts[i]))
    torch.manual_seed(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    made, start = 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="distill", unit="prompt")
    with open(out, "a") as f:
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(backbone.device)
            sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            generated = backbone.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                          **sampling)[:, enc["input_ids"].shape[1] :]
            for i, ids in zip(idx, generated.tolist()):
                cut = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
                ids = ids[:cut]
                answer = tokenizer.decode(ids, skip_special_tokens=True)
                row = {"id": todo[i]["id"], "messages": [{"role": "user", "content": todo[i]["prompt"]},
                                                         {"role": "assistant", "content": answer}],
                       "answer_ids": ids}
                f.write(json.dumps(row) + "\n")
                made += len(ids)
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(idx))
            bar.set_postfix(tok_s=f"{made / (time.perf_counter() - start):.0f}")
    bar.close()
    logger.info("wrote %d answers (%d tokens) to %s", len(todo), made, out)
    return made
