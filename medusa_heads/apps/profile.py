r"""
Latency profile: what one decoding step costs, by tree size, on this device and dtype.

A step of n >= 2 nodes is what `tree_decode_step` does: the drafter runs the heads, one backbone forward
verifies the tree, the acceptance rule picks a path and the KV cache is compacted to it. The 1-node step,
which every cost is relative to, is plain greedy decoding: one token's forward and its argmax, no heads,
so that E(n) / cost(n) predicts the speed-up over plain decoding. Trees of each size are grown
on made-up acceptance probabilities (the shape barely matters: every node costs one token of the forward)
over a made-up context of each length; the accepted path is forced to the deepest one so that the step
pays for a real cache gather. Medians over repeats, sizes interleaved, after a warm-up.

Profiles are cached under `~/.cache/medusa-heads/profiles/`, one file per model, heads, device, dtype and
thread count: the device's speed is what they measure, so they are reused, never shipped.
"""

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from medusa_heads.device import cache_file, device_name
from medusa_heads.errors import MedusaError, read_json
from medusa_heads.model import MedusaModel
from medusa_heads.tree import TreeBuffers, build_tree, canonical_tree
from medusa_heads.tree.optimize import grow_tree

from medusa_heads.inference import Accepted, DecodeState, Draft, GreedyAcceptance, MedusaDrafter
from medusa_heads.inference.cache import TreeCache
from medusa_heads.inference.generate import prefill, tree_decode_step, verify

DEFAULT_SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_CONTEXTS = (128, 512)


@dataclass
class LatencyProfile:
    model: str
    heads: str
    device: str
    dtype: str
    threads: int
    sizes: list[int]  # tree nodes, the root included
    contexts: list[int]  # tokens already in the KV cache
    step_ms: dict[str, list[float]]  # per context (as a string: a JSON key), the median step per size
    repeats: int

    def relative_cost(self, max_nodes: int) -> list[float]:
        """cost(n) for n = 1..max_nodes: the step time of n nodes over that of 1 node, interpolated linearly
        between the profiled sizes, averaged over the profiled contexts."""
        if self.sizes[0] != 1:
            raise MedusaError("The profile has no 1-node step to compare with.")
        if max_nodes > self.sizes[-1]:
            raise MedusaError(f"The profile covers trees of up to {self.sizes[-1]} nodes, not {max_nodes}: "
                              "profile again with a larger --max-nodes.")
        curves = [[_interpolate(self.sizes, ms, n) / ms[0] for n in range(1, max_nodes + 1)]
                  for ms in self.step_ms.values()]
        return [sum(c) / len(c) for c in zip(*curves)]

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "profile") -> "LatencyProfile":
        try:
            profile = cls(**{k: data[k] for k in cls.__dataclass_fields__})
            sizes = [int(n) for n in profile.sizes]
            curves = [[float(x) for x in ms] for ms in profile.step_ms.values()]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise MedusaError(f"`{source}` is not a latency profile (see `medusa-heads profile`).") from None
        if not sizes or sizes != sorted(set(sizes)) or not curves or any(
                len(ms) != len(sizes) or min(ms) <= 0 for ms in curves):
            raise MedusaError(f"`{source}` has inconsistent sizes and step times.")
        return profile


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]  # xs has a single size


def heads_signature(model: MedusaModel) -> str:
    config = model.config
    return f"{getattr(config, 'head_type', 'medusa')}-{config.num_heads}x{config.num_layers}"


def profile_path(model: MedusaModel, threads: int | None = None) -> Path:
    """The cache file of `model`'s profile on its device, dtype and thread count."""
    return cache_file(model.config.base_model_name_or_path or model.backbone.name_or_path, heads_signature(model),
                      device_name(model.device), str(model.backbone.dtype).removeprefix("torch."),
                      f"{threads or torch.get_num_threads()}threads")


def load_profile(path: str | Path) -> LatencyProfile:
    """A profile from a JSON file: one `medusa-heads profile` cached, or a fitted tree (its `profile`)."""
    data = read_json(path, "Profile file")
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]  # a fitted tree carries the profile it was fitted to
    if not isinstance(data, dict):
        raise MedusaError(f"`{path}` is not a latency profile (see `medusa-heads profile`).")
    return LatencyProfile.from_dict(data, str(path))


class _DeepestPath(GreedyAcceptance):
    """Greedy acceptance whose verdict is replaced by the tree's deepest path, so that every timed step
    gathers a full path in the cache (random tokens would mostly accept nothing)."""

    def accept(self, draft: Draft, logits: torch.Tensor) -> Accepted:
        super().accept(draft, logits)  # its cost is part of the step
        tree = draft.tree
        row = int(tree.retrieve_valid.sum(dim=1).argmax())
        nodes = tree.retrieve[row][tree.retrieve_valid[row]]
        return Accepted(nodes, int(logits[nodes[-1]].argmax()))


def synthetic_tree(model: MedusaModel, nodes: int) -> TreeBuffers:
    """A tree of `nodes` >= 2 nodes (the root included) shaped like a fitted one."""
    p = [[0.6 * 0.5 ** (d + r) for r in range(10)] for d in range(model.config.num_heads)]
    return build_tree(grow_tree(p, nodes), model.device)


def _plain_step(model: MedusaModel, cache: TreeCache, state: DecodeState) -> None:
    """The 1-node step every cost is relative to: plain greedy decoding of one token, no heads."""
    root = canonical_tree((), model.device)
    logits, _ = verify(model, root, torch.tensor([[state.root]], device=model.device), cache)
    logits[0, -1].argmax().item()  # the token, read as decoding reads it


@torch.no_grad()
def measure_profile(model: MedusaModel, sizes: Sequence[int] = DEFAULT_SIZES,
                    contexts: Sequence[int] = DEFAULT_CONTEXTS, repeats: int = 10, warmup: int = 2,
                    seed: int = 0) -> LatencyProfile:
    """Median step time per tree size and context length (see the module's docstring)."""
    model.require_heads("Profiling")  # an EAGLE drafter's step cost depends on its cache: not modelled here
    sizes, contexts = sorted(set(sizes)), sorted(set(contexts))
    if repeats < 1 or not sizes or sizes[0] != 1 or not contexts or contexts[0] < 1:
        raise MedusaError("A profile needs sizes starting at 1 node, positive context lengths and repeats >= 1.")
    limit = getattr(model.backbone.config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and contexts[-1] + sizes[-1] > limit:
        raise MedusaError(f"A context of {contexts[-1]} tokens plus a {sizes[-1]}-node tree exceeds the "
                          f"model's context of {limit} tokens.")
    drafters = {n: MedusaDrafter(model, synthetic_tree(model, n)) for n in sizes if n > 1}
    acceptance = _DeepestPath()
    vocab = model.backbone.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seed)
    step_ms = {}
    for context in contexts:
        ids = torch.randint(0, vocab, (1, context + 1), generator=generator).to(model.device)
        cache = TreeCache(model.backbone, 1, context + 2 * sizes[-1])
        _, hidden = prefill(model, [ids[0, :context].tolist()], cache)
        state = DecodeState(ids[0].tolist(), int(ids[0, -1]), hidden[0, -1])
        times = {n: [] for n in sizes}
        for rep in range(warmup + repeats):
            order = sizes[rep % len(sizes):] + sizes[: rep % len(sizes)]  # rotate: drift spreads over sizes
            for n in order:
                _sync(model.device)
                start = time.perf_counter()
                if n == 1:
                    _plain_step(model, cache, state)
                else:
                    tree_decode_step(model, drafters[n], acceptance, cache, state)
                _sync(model.device)
                if rep >= warmup:
                    times[n].append(time.perf_counter() - start)
                cache.rewind(context)  # back to the same context for the next step
        step_ms[str(context)] = [round(1000 * statistics.median(times[n]), 4) for n in sizes]
    return LatencyProfile(model=model.config.base_model_name_or_path or model.backbone.name_or_path,
                          heads=heads_signature(model), device=device_name(model.device),
                          dtype=str(model.backbone.dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                          sizes=sizes, contexts=contexts, step_ms=step_ms, repeats=repeats)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_profile(model: MedusaModel, max_nodes: int, refresh: bool = False, **measure) -> tuple[LatencyProfile, Path]:
    """The cached profile of `model` on this device if it covers `max_nodes`, else a new one, saved."""
    path = profile_path(model)
    if path.exists() and not refresh:
        profile = load_profile(path)
        if profile.sizes[-1] >= max_nodes:
            return profile, path
    sizes = [n for n in DEFAULT_SIZES if n < max_nodes] + [max_nodes]
    profile = measure_profile(model, sizes=sizes, **measure)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.as_dict(), indent=1) + "\n")
    tmp.replace(path)
    return profile, path
