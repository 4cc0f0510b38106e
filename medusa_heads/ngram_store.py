"""`NgramStore`: the backbone's most frequent next token after each short context of its own answers.

A drafter's memory of the training corpus (the idea of REST's datastore, as count tables instead of a
suffix array): from the longest context with an entry, the store drafts a chain by repeatedly taking the
most frequent next token. It catches the formulaic phrases a model repeats across answers, where prompt
lookup only sees the current conversation. Saved next to the heads as `ngram_store.safetensors`.
"""

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import HfHubHTTPError
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from medusa_heads.errors import MedusaError

STORE_FILE = "ngram_store.safetensors"


def max_order(vocab_size: int, requested: int) -> int:
    """Contexts are packed into one int64 (base `vocab_size`): at most the n with vocab_size ** n < 2 ** 63."""
    return max(1, min(requested, int(63 / math.log2(max(vocab_size, 2)))))


def pack(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., n] token ids -> [...] int64 keys, one per context."""
    key = torch.zeros(tokens.shape[:-1], dtype=torch.long, device=tokens.device)
    for i in range(tokens.shape[-1]):
        key = key * vocab_size + tokens[..., i]
    return key


class NgramStore:
    """Per context length n: sorted packed contexts [M_n] and the most frequent next token after each [M_n]."""

    def __init__(self, tables: dict[int, tuple[torch.Tensor, torch.Tensor]], vocab_size: int):
        self.tables = dict(sorted(tables.items(), reverse=True))  # longest context first
        self.vocab_size = vocab_size

    @classmethod
    def build(cls, sequences: Iterable[Sequence[int]], vocab_size: int, max_n: int = 4,
              min_count: int = 2) -> "NgramStore":
        """Count every (context, next token) pair of `sequences` for context lengths 1..max_n and keep, per
        context, its most frequent next token (the smallest id among ties) if it was seen at least `min_count`
        times."""
        max_n = max_order(vocab_size, max_n)
        seqs = [torch.as_tensor(list(s), dtype=torch.long) for s in sequences]
        if any(int(s.max()) >= vocab_size or int(s.min()) < 0 for s in seqs if s.numel()):
            raise MedusaError(f"The corpus has token ids outside the vocabulary of {vocab_size}.")
        tables = {}
        for n in range(1, max_n + 1):
            windows = [s.unfold(0, n + 1, 1) for s in seqs if s.numel() > n]  # [L - n, n + 1] each
            if not windows:
                continue
            w = torch.cat(windows)
            pairs, counts = torch.unique(torch.stack([pack(w[:, :n], vocab_size), w[:, n]], 1), dim=0,
                                         return_counts=True)
            pairs, counts = pairs.flip(0), counts.flip(0)  # next tokens descending: ties go to the smallest id
            by_count = torch.sort(counts, stable=True).indices
            order = by_count[torch.sort(pairs[by_count, 0], stable=True).indices]  # each context's top count last
            keys, nexts, counts = pairs[order, 0], pairs[order, 1], counts[order]
            last = torch.ones_like(keys, dtype=torch.bool)
            last[:-1] = keys[1:] != keys[:-1]
            keep = last & (counts >= min_count)
            if keep.any():
                tables[n] = (keys[keep].contiguous(), nexts[keep].contiguous())
        return cls(tables, vocab_size)

    def __len__(self) -> int:
        return sum(keys.numel() for keys, _ in self.tables.values())

    def next_token(self, context: Sequence[int]) -> int | None:
        """The most frequent follower of the longest suffix of `context` the store knows; None if none."""
        for n, (keys, nexts) in self.tables.items():
            if len(context) < n:
                continue
            key = pack(torch.tensor(context[-n:]), self.vocab_size)
            i = int(torch.searchsorted(keys, key))
            if i < keys.numel() and int(keys[i]) == int(key):
                return int(nexts[i])
        return None

    def continuation(self, token_ids: Sequence[int], length: int) -> list[int]:
        """Up to `length` tokens drafted greedily after `token_ids`; stops where no context matches."""
        context, out = list(token_ids[-max(self.tables, default=1):]), []
        while len(out) < length:
            token = self.next_token(context)
            if token is None:
                break
            out.append(token)
            context = context[1:] + [token]
        return out

    def save(self, folder: str | Path) -> Path:
        """Write `folder/ngram_store.safetensors` (atomically: an existing store stays until the new one is whole)."""
        path = Path(folder) / STORE_FILE
        tensors = {f"{kind}_{n}": t for n, (keys, nexts) in self.tables.items()
                   for kind, t in (("contexts", keys), ("next", nexts))}
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial), metadata={"vocab_size": str(self.vocab_size)})
        partial.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "NgramStore":
        try:
            with safe_open(str(path), "pt") as f:
                vocab_size = int((f.metadata() or {})["vocab_size"])
                tensors = {name: f.get_tensor(name) for name in f.keys()}
            tables = {int(name.split("_")[1]): (t, tensors["next_" + name.split("_")[1]])
                      for name, t in tensors.items() if name.startswith("contexts_")}
        except (OSError, SafetensorError, KeyError, ValueError) as err:
            raise MedusaError(f"Cannot read the n-gram store `{path}`: {err}") from err
        return cls(tables, vocab_size)


def find_store(heads_path: str) -> NgramStore | None:
    """The store saved with the heads at `heads_path` (a folder or hub id), or None if they have none."""
    if not heads_path:  # heads made in memory
        return None
    local = Path(heads_path)
    if local.is_dir():
        return NgramStore.load(local / STORE_FILE) if (local / STORE_FILE).is_file() else None
    try:
        return NgramStore.load(hf_hub_download(heads_path, STORE_FILE))
    except (HfHubHTTPError, OSError, ValueError):  # no such repository or file, or no network
        return None
