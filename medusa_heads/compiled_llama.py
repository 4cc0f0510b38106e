r"""
The fast forward compiled for decoding steps: `FastLlama`'s own layer function under `torch.compile`, one graph
per step size, the way vLLM's CPU backend compiles.

Inductor turns the glue between the products (RMSNorm, the rotation, SiLU * up, the residual adds) into a few
fused C++ loops; the products stay oneDNN's, over the weights `packing.py` already laid out, called through a
small C++ operator (`csrc/packed_linear.cpp`) because a graph cannot take oneDNN's opaque packed tensors as inputs:
the operator keeps them in a table and the graph holds an index. Keys and values are written at slots given as a
tensor and the attention window is a dynamic size, so one graph serves every context length; `fullgraph=True`
and static sizes otherwise, so nothing recompiles while decoding. On this project's 2-core Xeon with AMX that
takes a bf16 forward of 1 token from 26.0 to 21.3 ms and of 14 from 31.8 to 25.3 ms (docs/experiments.md).

Compiling costs about 40 s a step size on 2 cores; inductor caches what it made on disk (under the medusa-heads cache
folder), so a later process takes about 5 s a size. The operator is built once into the same folder, which needs
a C++ compiler; without one the eager `FastLlama` runs, which computes the same function, as it does for
prompts.
"""

import copy
import logging
import os
import weakref
from typing import Iterable

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch import nn
from transformers import PreTrainedModel

from .backbone import cache_home, first_line
from .cpu_ops import load_packed_linear
from .fast_llama import FAST_FORWARD, FastLlama, FastLlamaLayer, Product, product
from .packing import PackedLinear

logger = logging.getLogger(__name__)

MAX_STEP_TOKENS = 64  # larger steps run eagerly
MAX_GRAPHS = 8  # step sizes compiled at most (dynamo's own limit); trees that keep changing size run the rest eagerly


def _use_our_inductor_cache() -> None:
    """Inductor's disk cache in the medusa-heads cache folder (where it survives a reboot), unless the user chose
    one. Inductor sets the variable itself when it first looks it up, to its default folder."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_home() / "inductor")


class OpaqueProduct:
    """A packed `Product` called through the C++ operator, which a compiled graph keeps as one call."""

    def __init__(self, product: Product):
        self.index = torch.ops.medusa_heads.keep_packed(product.packed)
        self.out_features, self.bias = product.out_features, product.bias
        weakref.finalize(self, torch.ops.medusa_heads.release_packed, self.index)  # the table holds it till then

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.medusa_heads.packed_linear(x, self.index, self.out_features, self.bias)


def compilable(product):
    """A product a compiled graph can call: a packed `Product` as an `OpaqueProduct`, anything else as it is."""
    return OpaqueProduct(product) if isinstance(product, Product) and product.packed is not None else product


class OpaqueLinear(nn.Module):
    """A packed linear layer of a module tree, called as an `OpaqueProduct`."""

    def __init__(self, linear: PackedLinear):
        super().__init__()
        self.product = OpaqueProduct(product(linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


def with_compilable_linears(module: nn.Module) -> nn.Module:
    """`module` as a graph can call it: a copy of its tree of modules (over the same parameters) whose packed
    linear layers are `OpaqueLinear`s."""
    if type(module) is PackedLinear:
        return OpaqueLinear(module)
    twin = copy.copy(module)
    twin._modules = {name: None if child is None else with_compilable_linears(child)
                     for name, child in module._modules.items()}
    return twin


def mark_cache_dynamic(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Per layer (keys, values) [B, H_kv, S, D] with a dynamic size S: one graph for every cache size."""
    for keys, values in kv:
        torch._dynamo.mark_dynamic(keys, 2)
        torch._dynamo.mark_dynamic(values, 2)


def call_graph(graph, ready: bool, *args):
    """`graph(*args)`; once it has run for inputs like these (`ready`: no new graph can be needed), checking only the
    guards that tell its graphs apart instead of every guard on every input (about a millisecond a call of the
    30-layer step on this project's CPU)."""
    if not ready:
        return graph(*args)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        return graph(*args)


def compile_step(function, cpp_wrapper: bool = True):
    """`function` compiled as the decoding steps are: one graph, no Python in it, static shapes but those marked
    dynamic, glue rounded where eager rounds it."""
    _use_our_inductor_cache()
    # Dynamo keeps the graphs of one function's code together and gives up past `recompile_limit` of them (8): the
    # graphs of every `StaticStep`, every tree's drafting, every model's step share a few functions' code
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # emulate_precision_casts: bf16 glue rounded where eager rounds it, so bf16 logits stay within a few units
    # of eager's. cpp_wrapper: the graph's calls made from C++, not from a Python function of a thousand lines
    # (a bf16 forward of SmolLM2-135M 7-9% faster on this project's CPU; benchmarks/compiled_step.py)
    return torch.compile(function, fullgraph=True, dynamic=False,
                         options={"emulate_precision_casts": True, "cpp_wrapper": cpp_wrapper})


def why_not_compiled(products: Iterable) -> str | None:
    """None where a graph can call each of `products`, else why not, in words."""
    if any(isinstance(p, Product) and p.packed is not None for p in products):
        return load_packed_linear()
    return None


class CompiledLlama:
    r"""
    `fast`'s forward, compiled for decoding steps: the same function over the same weights (`FastLlama.decode` of
    a copy whose packed products go through the C++ operator, then `fast`'s LM head over the rows kept), one graph
    per step size, compiled on first use. Batches of several sequences, steps of more than `MAX_STEP_TOKENS` tokens
    and sizes past `MAX_GRAPHS` run `fast` itself (`eager`), as prompts do (`backbone_forward`).
    """

    def __init__(self, fast: FastLlama, cpp_wrapper: bool = True):
        self.eager = fast
        # `fast` with every product callable from a graph (whole-step graphs call its `decode` and `lm_head` too)
        self.compilable = copy.copy(fast)
        self.compilable.layers = [layer.with_products(compilable) for layer in fast.layers]
        self.compilable.lm_head = compilable(fast.lm_head)
        self.graph = compile_step(self.compilable.decode, cpp_wrapper)
        self.sizes: set[tuple[int, tuple[int, ...]]] = set()  # (tokens, layers tapped) compiled and run
        self.failed = False

    def pending(self, sizes: Iterable[int], taps: tuple[int, ...] = ()) -> list[int]:
        """Which of the step sizes `sizes` a forward would compile now."""
        room = MAX_GRAPHS - len(self.sizes)
        new = sorted({t for t in sizes if (t, taps) not in self.sizes and t <= MAX_STEP_TOKENS})
        return [] if self.failed else new[:room]

    def warm_up(self, sizes: Iterable[int], taps: tuple[int, ...] = ()) -> None:
        """Compile the graphs of step sizes `sizes` now, with a step over scratch buffers, so that decoding starts
        with them ready."""
        weight = self.eager.embed.weight
        for tokens in self.pending(sizes, taps):
            context = 16  # any context: the window and the cache's size are dynamic in the graph
            window = context + tokens
            kv = self.scratch_cache(window)
            slots = torch.arange(context, window, device=weight.device)
            mask = torch.ones(1, 1, tokens, window, dtype=torch.bool, device=weight.device)
            with torch.no_grad():
                self.forward(torch.zeros(1, tokens, dtype=torch.long, device=weight.device), slots[None],
                             mask.tril(context), kv, slots, taps)

    def scratch_cache(self, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zero keys and values per layer [1, H_kv, 2 window, D], longer than `window` as a cache is: what a warm-up
        step writes to."""
        first = self.eager.layers[0]
        shape = (1, first.kv_heads, 2 * window, first.head_dim)
        weight = self.eager.embed.weight
        return [(weight.new_zeros(shape), weight.new_zeros(shape)) for _ in self.eager.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, kv: list,
                slots: torch.Tensor, taps: tuple[int, ...] = (), logits_to_keep: int | torch.Tensor = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`FastLlama.forward`."""
        batch, tokens = input_ids.shape
        size = (tokens, taps)
        if (self.failed or batch > 1 or tokens > MAX_STEP_TOKENS
                or (size not in self.sizes and len(self.sizes) == MAX_GRAPHS)):
            return self.eager.forward(input_ids, positions, mask, kv, slots, taps, logits_to_keep)
        ready = size in self.sizes
        if not ready:
            logger.info("Compiling the decoding step for %d-token forwards: under a minute once, then cached on "
                        "disk under %s", tokens, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        # A view of the cache's mask buffer has the strides of the largest tree seen (`contiguous` keeps those of
        # its dimensions of size 1): a copy of standard strides, or a new graph each time they change
        mask = mask.clone(memory_format=torch.contiguous_format)
        torch._dynamo.mark_dynamic(mask, 3)  # the window: one graph for every context length
        mark_cache_dynamic(kv)
        try:
            hidden, features = call_graph(self.graph, ready, input_ids, positions, mask, kv, slots, taps)
        except Exception as err:  # torch.compile's own errors have no common base; eager runs the same function
            logger.warning("Compiling the decoding step failed, decoding eagerly from now on: %s", first_line(err))
            self.failed = True
            return self.eager.forward(input_ids, positions, mask, kv, slots, taps, logits_to_keep)
        self.sizes.add(size)
        return self.eager.logits(hidden, logits_to_keep), features


def compile_fast_forward(backbone: PreTrainedModel) -> bool:
    """Decode `backbone`, which `fast_llama.enable_fast_forward` set up, through a `CompiledLlama`; returns whether
    it does (where it cannot, it says why in one logged line and keeps the eager `FastLlama`)."""
    fast = getattr(backbone, FAST_FORWARD)
    why_not = why_not_compiled(getattr(layer, name) for layer in fast.layers for name in FastLlamaLayer.PRODUCTS)
    if why_not is not None:
        logger.warning("Decoding without compiling: %s.", why_not)
        return False
    setattr(backbone, FAST_FORWARD, CompiledLlama(fast))
    return True
