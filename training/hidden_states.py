"""The frozen backbone's last hidden states, computed once and kept on disk so later epochs cost only the heads."""

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
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


def set_key(hashes: list[str]) -> str:
    """One name for a set of example hashes, whatever their order."""
    digest = hashlib.sha256()
    for h in sorted(set(hashes)):
        digest.update(h.encode())
    return digest.hexdigest()[:20]


def backbone_key(model: str, dtype: torch.dtype) -> str:
    """Which backbone made the states: its name (with its taps and quantisation) and dtype."""
    return hashlib.sha256(json.dumps([model, str(dtype)]).encode()).hexdigest()[:12]


def read_shards(folder: Path, backbone: str, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The states of the `wanted` examples that some shard of this backbone in `folder` holds, by example hash.
    A shard that cannot be read is skipped with a warning: its examples are computed again."""
    found: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob(f"{backbone}-*.safetensors")):
        try:
            with safe_open(path, framework="pt") as f:
                hashes = json.loads(f.metadata()["examples"])
                take = [(i, h) for i, h in enumerate(hashes) if h in wanted and h not in found]
                if not take:
                    continue
                ends = f.get_tensor("lengths").cumsum(0).tolist()
                rows = f.get_slice("hidden")
                for i, h in take:
                    found[h] = rows[ends[i - 1] if i else 0 : ends[i]]
        except (OSError, ValueError, KeyError, TypeError, IndexError, SafetensorError) as err:  # TypeError: no metadata
            logger.warning("skipping unreadable hidden-state shard %s (%s)", path, err)
    return found


def write_shard(path: Path, hashes: list[str], states: list[torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes building the same shard do not collide
    lengths = torch.tensor([s.shape[0] for s in states])
    save_file({"hidden": torch.cat(states).contiguous(), "lengths": lengths}, tmp,
              metadata={"examples": json.dumps(hashes)})
    tmp.replace(path)
    logger.info("cached hidden states of %d conversations (%d tokens) in %s", len(hashes), int(lengths.sum()), path)


class HiddenStateCache:
    """Per example, its hidden states [T_i, H] in the backbone's dtype, kept on disk in shards (safetensors, each
    listing its examples' hashes). Any order of the same examples finds them; a grown data set computes only the
    conversations no shard holds, and stores them as one more shard."""

    def __init__(self, states: list[torch.Tensor]):
        self.states = states

    @classmethod
    def build(cls, backbone, model_name: str, examples: list[Example], batch_size: int = 8,
              folder: Path | None = None) -> "HiddenStateCache":
        hashes = [example_hash(e) for e in examples]
        distinct = dict(zip(hashes, examples))  # repeated conversations are computed and stored once
        folder = folder or cache_home() / "hidden"
        prefix = backbone_key(model_name, backbone.dtype)
        found = read_shards(folder, prefix, set(distinct))
        missing = sorted(h for h in distinct if h not in found)
        logger.info("%d conversations' states found in %s, %d to compute", len(found), folder, len(missing))
        if missing:
            states = cls._compute(backbone, [distinct[h] for h in missing], batch_size)
            write_shard(folder / f"{prefix}-{set_key(missing)}.safetensors", missing, states)
            found.update(zip(missing, states))
        return cls([found[h] for h in hashes])

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
