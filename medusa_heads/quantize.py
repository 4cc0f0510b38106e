r"""
A backbone with int8 weights: `quantize_backbone(backbone, "int8")` turns the decoder's linear layers into
`Int8Linear`s, in place (per output channel symmetric int8 weights, one bf16/fp32 scale per row; the activations
keep the backbone's dtype). The token embeddings and the LM head stay as they are: heads that share the LM head
score with the same projection on either backbone.

The kernel is torch's own `aten._weight_int8pack_mm`. torchao 0.18's `Int8WeightOnlyConfig` was measured slower
than the bf16 backbone on this project's CPU (a 1-token forward 31 ms against 22, docs/benchmarks.md) and its
weights break oneDNN packing; `_weight_int8pack_mm` reads a quarter fewer bytes per token than the packed bf16
layers (19 against 22 ms), but its cost grows with every row, so from `DEQUANTIZED_ROWS` rows on (prefill,
training, batched distillation) the weight is de-quantised for the call and oneDNN's matmul does the rest.

`Int8Linear` is not an `nn.Linear`, so `packing.pack_linears` leaves it alone and packs the layers still in float.

The kernel is fast only on CPUs with int8 dot-product instructions (AVX512-VNNI, AMX). On an AVX2-only CPU (an AMD
EPYC Milan, 2026-12-03) one row through a 576 x 1536 layer took 0.83 ms against 0.12 ms in float32, and a 1-token
forward of SmolLM2-135M 157 ms against 104: `quantize_backbone` times the kernel once and warns where it is slower.
"""

import logging
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from .errors import MedusaError

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "int8")
DEQUANTIZED_ROWS = 32  # measured crossover on this CPU: below it the int8 kernel is faster than de-quantising


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights [out, in] and a scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, [out, in] in the activations' dtype."""
        return self.qweight.to(self.scales.dtype) * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= DEQUANTIZED_ROWS:
            out = F.linear(rows, self.dequantized())
        else:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def check_quantize(name: str, device: torch.device | str = "cpu") -> str:
    """`name` if this build can run it on `device`, else a one-line MedusaError."""
    if name not in QUANTIZATIONS:
        raise MedusaError(f"Unknown quantization `{name}`; use one of {', '.join(QUANTIZATIONS)}.")
    if name != "none" and torch.device(device).type != "cpu":
        raise MedusaError(f"`{name}` quantization runs on the CPU only (torch's `_weight_int8pack_mm`), not on "
                          f"`{device}`.")
    return name


def int8_slowdown(layer: Int8Linear, repeats: int = 7) -> float:
    """How many times longer one row takes through `layer`'s int8 kernel than through its float weight (the median
    of `repeats` timings each, after a warm-up): above 1 this CPU has no fast int8 kernel."""
    x = torch.randn(1, layer.in_features, dtype=layer.scales.dtype)
    weight = layer.dequantized()
    runs = {"int8": lambda: torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.scales),
            "float": lambda: F.linear(x, weight)}
    seconds = {}
    with torch.no_grad():
        for label, run in runs.items():
            run()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            seconds[label] = statistics.median(times)
    return seconds["int8"] / seconds["float"]


def quantize_backbone(backbone: nn.Module, name: str) -> int:
    """Quantize the linear layers of `backbone`'s decoder as `name` says, in place; returns how many. Call it once
    the backbone is on its device in its dtype and frozen."""
    if check_quantize(name, backbone.device) == "none":
        return 0
    if backbone.dtype not in (torch.float32, torch.bfloat16):
        raise MedusaError(f"`{name}` quantization needs a float32 or bfloat16 backbone, not {backbone.dtype}.")
    decoder = backbone.get_decoder()
    targets = [(name_, m) for name_, m in decoder.named_modules() if type(m) is nn.Linear]
    layers = []
    for path, linear in targets:
        parent, _, child = path.rpartition(".")
        layers.append(Int8Linear(linear))
        setattr(decoder.get_submodule(parent), child, layers[-1])
    if layers:
        slowdown = int8_slowdown(max(layers, key=lambda m: m.qweight.numel()))
        if slowdown > 1.2:  # beyond timing noise
            logger.warning("int8 weights compute %.1fx slower than %s on this CPU (torch's int8 kernel is fast only "
                           "with AVX512-VNNI or AMX): decoding will be slower than with `--quantize none`.",
                           slowdown, str(backbone.dtype).removeprefix("torch."))
    return len(targets)


def quantization_of(model: nn.Module) -> str:
    """The quantization `quantize_backbone` applied to `model`, or `none`."""
    return "int8" if any(isinstance(m, Int8Linear) for m in model.modules()) else "none"
