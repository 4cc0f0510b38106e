r"""
Linear layers whose weights are laid out once for oneDNN, the CPU matrix library, instead of on every call.

A decoding step reads every weight for a handful of rows, and `nn.Linear` on CPU hands oneDNN a plain row-major
weight it must re-block each call. Blocking each weight once, as vLLM's CPU backend and inductor's `freezing`
pass do, halves the matmul time of SmolLM2-135M on this project's 2-core CPU: a bf16 forward of 1 token goes from
about 25 to 20 ms, of a 17-node tree from 35 to 28 ms (docs/benchmarks.md). In bf16 the results are bit-identical
to `nn.Linear`'s; in fp32 they differ in rounding (another summation order), like any other kernel choice.

The packed copy sits beside the weight, which stays where it was: tied embeddings, the heads' shared projection,
peft wrappers and state dicts see the same parameters. It costs one more copy of each weight in memory.

Sibling layers that read the same input (an attention's q/k/v projections, an MLP's gate and up projections) can
share one packed weight, their rows stacked: the first of them called computes all their outputs in one product
and the others take their slices. That is what vLLM's merged `qkv_proj` and `gate_up_proj` do, found here from a
trial forward instead of from the model's source (`fuse_siblings`); one product instead of three saves about 20 us
a layer on this CPU, bit-identical.

On a CPU with AVX512-BF16 but no AMX (AMD's Zen 4 and Zen 5), a bf16 weight is laid out instead in panels of 64
output columns for this project's own product (`csrc/packed_linear.cpp`): at the few rows of a decoding step it
runs near the memory's bandwidth where oneDNN's reaches about half of it (a forward's products 1.3-1.7x faster at
1-15 rows on a Zen 4, docs/experiments.md). Its sums round differently from oneDNN's, like any other kernel's.
`MEDUSA_HEADS_BF16_PRODUCTS` chooses: `auto` (the default), `onednn` or `panels` (wherever the CPU has AVX512-BF16).
"""

import copy
import logging
import os
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from .errors import MedusaError

logger = logging.getLogger(__name__)


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this torch build packs linear weights for `device` and `dtype` (CPU with oneDNN, bf16 where the
    CPU computes in bf16, and fp32)."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


PANEL_COLUMNS = 64  # output columns of one panel (csrc/packed_linear.cpp)
PRODUCTS_VARIABLE = "MEDUSA_HEADS_BF16_PRODUCTS"


def uses_panels(weight: torch.Tensor) -> bool:
    """Whether `pack_weight` lays `weight` [out, in] out in panels for this project's bf16 product."""
    choice = os.environ.get(PRODUCTS_VARIABLE, "auto")
    if choice not in ("auto", "onednn", "panels"):
        raise MedusaError(f"{PRODUCTS_VARIABLE} is {choice!r}; use auto, onednn or panels.")
    if (choice == "onednn" or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2
            or weight.shape[0] % PANEL_COLUMNS or weight.shape[1] % 2):
        return False
    from .cpu_ops import panel_products, panels_by_default  # build the operator on first use

    return panel_products() if choice == "panels" else panels_by_default()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] laid out once for this CPU's product: in panels [out / 64, in / 2, 64, 2] (`uses_panels`),
    else packed for oneDNN."""
    weight = weight.detach()
    return panel_layout(weight) if uses_panels(weight) else torch.ops.mkldnn._reorder_linear_weight(weight)


def panel_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] as panels [out / 64, in / 2, 64, 2]: each panel 64 output columns, their weights for inputs
    2i and 2i + 1 side by side, as AVX512-BF16's dot product reads them."""
    out_features, in_features = weight.shape
    return (weight.reshape(out_features // PANEL_COLUMNS, PANEL_COLUMNS, in_features // 2, 2)
            .permute(0, 2, 1, 3).contiguous())


def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ weight.T + bias` [..., out] with the weight laid out by `pack_weight`."""
    if not packed.is_mkldnn:
        return torch.ops.medusa_heads.panel_linear(x, packed, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")  # 2D only
    return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Linear):
    """An `nn.Linear` computing with `packed`, its weight blocked for oneDNN (made by `pack_linears`)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_product(x, self.packed, self.bias)


def pack_linears(model: nn.Module) -> int:
    r"""
    Turn every frozen `nn.Linear` of `model` into a `PackedLinear`, in place; returns how many. Call it once the
    model is on its device in its dtype and will not train (the packed copy has no gradient and does not follow
    `.to()`).
    """
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and not module.weight.requires_grad and can_pack(module.weight.device,
                                                                                    module.weight.dtype):
            module.packed = pack_weight(module.weight)
            # The class swap keeps the module object, so everything holding it (a tied embedding, a peft
            # wrapper, the parent's attribute) now computes with the packed weight.
            module.__class__ = PackedLinear
            count += 1
    return count


def with_plain_linears(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree of modules (over the same parameters) whose packed linear layers compute as plain
    `nn.Linear`s: for a graph that lays the weights out itself."""
    twin = copy.copy(module)
    if isinstance(module, PackedLinear):
        twin.__class__ = nn.Linear
        return twin
    twin._modules = {name: None if child is None else with_plain_linears(child)
                     for name, child in module._modules.items()}
    return twin


class Siblings:
    r"""
    Packed linear layers that read the same input, with their weights stacked into one packed matrix. The first
    member called with an input computes every member's output; each other member called with that same tensor
    (same object, not modified since) takes its slice. A member called with another input, or twice with one,
    computes afresh, so the result is always the member's own product.
    """

    def __init__(self, members: list["SiblingLinear"]):
        self.members = members
        self.packed = pack_weight(torch.cat([m.weight.detach() for m in members]))
        biases = [m.bias for m in members]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        self.sizes = [m.out_features for m in members]
        self._clear()

    def _clear(self) -> None:
        self.input: torch.Tensor | None = None
        self.version = -1
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.taken: set[int] = set()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s output for `x`."""
        version = x._version if not x.is_inference() else 0
        if x is not self.input or version != self.version or index in self.taken:
            # Contiguous copies: a strided slice can send a later kernel down another path with another rounding.
            outputs = packed_product(x, self.packed, self.bias).split(self.sizes, dim=-1)
            self.outputs = tuple(o.contiguous() for o in outputs)
            self.input, self.version, self.taken = x, version, set()
        self.taken.add(index)
        result = self.outputs[index]
        if len(self.taken) == len(self.members):
            self._clear()  # every member has its output: hold no tensor between forwards
        return result


class SiblingLinear(PackedLinear):
    """A `PackedLinear` computing through its `Siblings` group (made by `fuse_siblings`)."""

    siblings: Siblings
    sibling_index: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.siblings.output(self.sibling_index, x)


def _calls_by_input(model: nn.Module, run: Callable[[], torch.Tensor]
                    ) -> tuple[dict[PackedLinear, list[torch.Tensor]], torch.Tensor]:
    """The inputs each `PackedLinear` of `model` is called with during `run()`, and what `run()` returned."""
    calls: dict[PackedLinear, list[torch.Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, args: calls.setdefault(m, []).append(args[0]))
             for m in model.modules() if type(m) is PackedLinear]
    try:
        output = run()
    finally:
        for hook in hooks:
            hook.remove()
    return calls, output


def _unfuse(members: list[SiblingLinear]) -> None:
    for module in members:
        module.packed = pack_weight(module.weight)
        module.__class__ = PackedLinear
        del module.siblings, module.sibling_index


def fuse_siblings(model: nn.Module, run: Callable[[], torch.Tensor]) -> int:
    r"""
    Group `model`'s `PackedLinear` layers that read the same input tensor in `run()` (a trial forward returning
    a tensor) into `Siblings`, in place; returns how many groups. A layer called more than once in the trial
    stays alone. If the trial's output then differs in any bit, every group is undone (and a warning says so).
    """
    calls, reference = _calls_by_input(model, run)
    groups: dict[int, list[PackedLinear]] = {}
    for module, inputs in calls.items():
        if len(inputs) == 1:
            groups.setdefault(id(inputs[0]), []).append(module)
    fused = []
    for members in groups.values():
        same = {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in members}
        if len(members) < 2 or len(same) > 1:
            continue
        for index, module in enumerate(members):
            module.__class__ = SiblingLinear
            module.sibling_index = index
        siblings = Siblings(members)
        for module in members:
            module.siblings = siblings
            del module.packed  # the group's stacked copy replaces each member's
        fused.append(members)
    if fused and not torch.equal(run(), reference):
        logger.warning("Fusing sibling linear layers changed this model's output; they stay separate.")
        for members in fused:
            _unfuse(members)
        return 0
    return len(fused)


@contextmanager
def stock_linears(model: nn.Module) -> Iterator[None]:
    """Run `model`'s packed linear layers as plain `nn.Linear` inside the block (a baseline as users run it)."""
    packed = [(m, type(m)) for m in model.modules() if type(m) in (PackedLinear, SiblingLinear)]
    for module, _ in packed:
        module.__class__ = nn.Linear
    try:
        yield
    finally:
        for module, cls in packed:
            module.__class__ = cls
