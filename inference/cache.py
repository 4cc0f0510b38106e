r"""
The KV cache of tree decoding: preallocated once, written in place, compacted to the accepted paths.

Rows are the sequences of a batch. A row's committed entries sit in slots [0, length), with holes where its
prompt was left-padded or where it fell behind the longest row; `valid` marks the slots it may attend to. A step
writes every row's tree at the same slots [start, start + T), start being the longest row's length, then moves
each row's accepted nodes down to the end of its own entries. Attention reads only the first `window` slots,
rounded up to `BUCKET`, so a cache sized for the whole generation costs what is used, and a compiled step sees
few shapes.
"""

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import Cache, StaticLayer

from medusa_heads.errors import MedusaError
from medusa_heads.tree import TreeBuffers

BUCKET = 16


def round_up(n: int, multiple: int = BUCKET) -> int:
    return -(-n // multiple) * multiple


class WindowLayer(StaticLayer):
    """A `StaticLayer` (written in place at `cumulative_length`) whose attention reads its first `window` slots."""

    window = 0
    start = 0  # where the next update writes (`cumulative_length` as a Python int, for the fast forward)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return keys[:, :, : self.window], values[:, :, : self.window]


class TreeCache:
    """The static cache of `batch_size` sequences of up to `max_len` entries each (prompt, answer and a tree)."""

    def __init__(self, backbone: PreTrainedModel, batch_size: int, max_len: int):
        self.size = self.size_for(max_len)
        static = StaticCache(config=backbone.config, max_cache_len=self.size)
        kinds = {type(layer).__name__ for layer in static.layers if type(layer) is not StaticLayer}
        if kinds:
            raise MedusaError(f"Tree decoding needs full-attention cache layers; this model uses "
                              f"{', '.join(sorted(kinds))}.")
        self.cache = Cache(layers=[WindowLayer(max_cache_len=self.size) for _ in static.layers])
        device = backbone.device
        self.valid = torch.zeros(batch_size, self.size, dtype=torch.bool, device=device)
        self.lengths = [0] * batch_size  # slots in use per row, holes included
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=device)  # next RoPE position per row
        self._mask = torch.zeros(0, dtype=torch.bool, device=device)  # [B, 1, T, size], grown on demand

    @staticmethod
    def size_for(max_len: int) -> int:
        """The slots of a cache for `max_len` entries. One bucket more than asked for: attention windows stay shorter
        than the cache, so a compiled step's graph never meets a window equal to the cache's size (a case it would
        specialize for, and recompile)."""
        return round_up(max_len) + BUCKET

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def start(self) -> int:
        """Where the next forward writes: after the longest row."""
        return max(self.lengths)

    def reserve(self, n: int) -> int:
        """The attention window of a forward writing `n` entries after the longest row: a one-line error where the
        cache cannot hold them."""
        start = self.start
        if start + n > self.size:
            raise MedusaError(f"The KV cache of {self.size} entries is full ({start} used, {n} more asked).")
        return min(self.size, round_up(start + n))

    def _place(self, start: int, n: int) -> None:
        window = self.reserve(n)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(start)
            layer.window, layer.start = window, start

    def _mask_buffer(self, queries: int, window: int) -> torch.Tensor:
        if self._mask.shape[0] != self.batch_size or self._mask.shape[2] < queries:
            self._mask = torch.zeros(self.batch_size, 1, queries, self.size, dtype=torch.bool,
                                     device=self.valid.device)
        return self._mask[:, :, :queries, :window]

    def prefill_inputs(self, prompt_lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For prompts left-padded to `width`: (position ids [B, width], 4D mask [B, 1, width, window]).
        A padding position attends to itself only, so no attention row is empty."""
        if self.start:
            raise MedusaError("The cache already holds a prompt.")
        device = self.valid.device
        slot = torch.arange(width, device=device)
        pad = torch.tensor([width - n for n in prompt_lengths], device=device)
        self.valid[:, :width] = slot[None] >= pad[:, None]
        self._place(0, width)
        keys = torch.arange(self.cache.layers[0].window, device=device)
        mask = (keys[None, :] <= slot[:, None])[None, None] & self.valid[:, None, None, : keys.numel()]
        mask |= keys[None, None, None, :] == slot[None, None, :, None]
        self.lengths = [width] * self.batch_size
        self.positions = torch.tensor(prompt_lengths, device=device)
        return (slot[None] - pad[:, None]).clamp(min=0), mask

    def tree_inputs(self, tree: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """For one tree per row at the next slots: (position ids [B, T], 4D mask [B, 1, T, window]): each node
        sees its row's entries and its own ancestors."""
        start, size = self.start, tree.size
        self._place(start, size)
        window = self.cache.layers[0].window
        mask = self._mask_buffer(size, window)
        mask.copy_(self.valid[:, None, None, :window])
        mask[:, 0, :, start : start + size] = tree.mask
        return self.positions[:, None] + tree.depth[None], mask

    def commit(self, paths: list[list[int]]) -> None:
        """Keep, for each row, the tree nodes of its accepted path (node ids, root first, ascending) written by the
        last `tree_inputs`; the rest of the tree's slots become free."""
        start = self.start
        rows, src, dst = [], [], []
        for row, nodes in enumerate(paths):
            base = self.lengths[row]
            for i, node in enumerate(nodes):
                rows.append(row)
                src.append(start + node)
                dst.append(base + i)
            self.lengths[row] = base + len(nodes)
        device = self.valid.device
        rows_t, dst_t = torch.tensor(rows, device=device), torch.tensor(dst, device=device)
        if src != dst:
            src_t = torch.tensor(src, device=device)
            for layer in self.cache.layers:
                # keys, values: [B, H_kv, S, D]; the right-hand index copies before the write.
                layer.keys[rows_t, :, dst_t] = layer.keys[rows_t, :, src_t]
                layer.values[rows_t, :, dst_t] = layer.values[rows_t, :, src_t]
        self.valid[rows_t, dst_t] = True
        self.positions += torch.tensor([len(nodes) for nodes in paths], device=device)

    def keep_rows(self, rows: list[int]) -> None:
        """Drop the other rows (finished sequences) from the batch."""
        index = torch.tensor(rows, device=self.valid.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.valid, self.positions = self.valid[index], self.positions[index]
        self.lengths = [self.lengths[r] for r in rows]

    def rewind(self, length: int) -> None:
        """Batch of one: forget every entry from slot `length` on."""
        self.valid[:, length:] = False
        self.positions -= self.lengths[0] - length
        self.lengths = [length]
