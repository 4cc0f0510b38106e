r"""
Linear layers whose weights are laid out once for oneDNN, the CPU matrix library, instead of on every call.

A decoding step reads every weight for a handful of rows, and `nn.Linear` on CPU hands oneDNN a plain row-major
weight it must re-block each call. Blocking each weight once, as vLLM's CPU backend and inductor's `freezing`
pass do, halves the matmul time of SmolLM2-135M on this project's 2-core CPU: a bf16 forward of 1 token goes from
about 25 to 20 ms, of a 17-node tree from 35 to 28 ms (docs/benchmarks.md). In bf16 the results are bit-identical
to `nn.Linear`'s; in fp32 they differ in rounding (another summation order), like any other kernel choice.

The packed copy sits beside the weight, which stays where it was: tied embeddings, the heads' shared projection,
peft wrappers and state dicts see the same parameters. It costs one more copy of each weight in memory.
"""

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


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


class PackedLinear(nn.Linear):
    """An `nn.Linear` computing with `packed`, its weight blocked for oneDNN (made by `pack_linears`)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # oneDNN's linear takes 2D input
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


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
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
            # The class swap keeps the module object, so everything holding it (a tied embedding, a peft
            # wrapper, the parent's attribute) now computes with the packed weight.
            module.__class__ = PackedLinear
            count += 1
    return count


@contextmanager
def stock_linears(model: nn.Module) -> Iterator[None]:
    """Run `model`'s packed linear layers as plain `nn.Linear` inside the block (a baseline as users run it)."""
    packed = [m for m in model.modules() if type(m) is PackedLinear]
    for module in packed:
        module.__class__ = nn.Linear
    try:
        yield
    finally:
        for module in packed:
            module.__class__ = PackedLinear
