"""The frozen backbone's last hidden states, computed once and kept on disk so later epochs cost only the heads."""

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from medusa_heads.backbone import backbone_forward, cache_home

from .data import Example

logger = logging.getLogger(__name__)


def pad_batch(examples: list[Example], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input_ids, loss_mask, attention_mask, each [B, T_max], right-padded."""
    T = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    loss = torch.zeros((len(examples), T), dtype=torch.long)
    attn = torch.zeros((len(examples), T), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        loss[i, :n] = torch.tensor(e.loss_mask)
        attn[i, :n] = 1
    return ids, loss, attn


@torch.no_grad()
def compute_hidden(backbone, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> last hidden states [B, T, H] (no KV cache: one full forward; logits at the last position only, the
    full-vocabulary projection of every position would add a fifth to the cost on a small backbone)."""
    device = backbone.device
    _, hidden = backbone_forward(backbone, input_ids.to(device), None, attention_mask=attention_mask.to(device),
                                 logits_to_keep=1)
    return hidden


def example_hash(example: Example) -> str:
    """What the hidden states depend on: the token ids (the loss mask does not change them)."""
    return hashlib.sha256(json.dumps(example.input_ids).encode()).hexdigest()


def cache_key(model: str, examples: list[Example], dtype: torch.dtype) -> str:
    """The same examples in any order (another split or shuffle) give the same key."""
    digest = hashlib.sha256(json.dumps([model, str(dtype)]).encode())
    for h in sorted({example_hash(e) for e in examples}):
        digest.update(h.encode())
    return digest.hexdigest()[:20]


class HiddenStateCache:
    """Per example, its hidden states [T_i, H] in the backbone's dtype; built in batches, stored as safetensors.
    The file holds each distinct example once, in the order of their hashes, so any order of them finds it."""

    def __init__(self, states: list[torch.Tensor]):
        self.states = states

    @classmethod
    def build(cls, backbone, model_name: str, examples: list[Example], batch_size: int = 8,
              folder: Path | None = None) -> "HiddenStateCache":
        hashes = [example_hash(e) for e in examples]
        distinct = dict(zip(hashes, examples))  # repeated conversations are computed and stored once
        keys = sorted(distinct)
        path = (folder or cache_home() / "hidden") / f"{cache_key(model_name, examples, backbone.dtype)}.safetensors"
        if path.exists():
            logger.info("reusing cached hidden states %s", path)
            flat = load_file(path)
            stored = list(torch.split(flat["hidden"], flat["lengths"].tolist()))
        else:
            stored = cls._compute(backbone, [distinct[h] for h in keys], batch_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes building the same cache do not collide
            lengths = torch.tensor([s.shape[0] for s in stored])
            save_file({"hidden": torch.cat(stored).contiguous(), "lengths": lengths}, tmp)
            tmp.replace(path)
            logger.info("cached hidden states of %d tokens in %s", int(lengths.sum()), path)
        by_hash = dict(zip(keys, stored))
        return cls([by_hash[h] for h in hashes])

    @staticmethod
    def _compute(backbone, examples: list[Example], batch_size: int) -> list[torch.Tensor]:
        order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))  # little padding
        states: list[torch.Tensor | None] = [None] * len(examples)
        for b in tqdm(range(0, len(order), batch_size), desc="hidden states", unit="batch"):
            idx = order[b : b + batch_size]
            ids, _, attn = pad_batch([examples[i] for i in idx])
            hidden = compute_hidden(backbone, ids, attn).cpu()
            for row, i in enumerate(idx):
                states[i] = hidden[row, : len(examples[i].input_ids)].clone()
        return states

    def batch(self, indices: list[int]) -> torch.Tensor:
        """-> [B, T_max, H], zero-padded on the right like `pad_batch`."""
        T = max(self.states[i].shape[0] for i in indices)
        H = self.states[indices[0]].shape[1]
        out = torch.zeros(len(indices), T, H, dtype=self.states[indices[0]].dtype)
        for row, i in enumerate(indices):
            out[row, : self.states[i].shape[0]] = self.states[i]
        return out
