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

`quantize_backbone(backbone, "int4")` makes `Int4Linear`s instead: 4-bit weights in groups of `GROUP_SIZE` along
the input (asymmetric: a bf16 scale and zero point per group, as the embedded model's own Q4_1 GGUF blocks are),
computed by torch's `aten._weight_int4pack_mm_for_cpu`, which takes bf16 activations (so greedy decoding is the
int4 model's own up to bf16 rounding, as with a bf16 backbone). On the AVX2-only CPU a whole decoding step of
SmolLM2-135M on an fp32 backbone (300-token context) took 38-40 ms against 51 ms packed float32 at one node, 47-49
against 64 at four and the same at sixteen; from `DEQUANTIZED_ROWS` rows on (the kernel's cost grows with every
row) the weight is de-quantised for the call, from a plain copy of the codes: 1.1 bytes a weight in all.

`Int8Linear` and `Int4Linear` are not `nn.Linear`s, so `packing.pack_linears` leaves them alone and packs the layers
still in float.

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

QUANTIZATIONS = ("none", "int8", "int4")
DEQUANTIZED_ROWS = 32  # measured crossover on this CPU: below it the int8 kernel is faster than de-quantising. It
# also bounds greedy exactness: a step of this many rows or more computes by another path than HF's one-row steps.
GROUP_SIZE = 32  # int4: inputs per scale and zero point
INNER_K_TILES = 2  # int4: the packing torch's CPU kernel is given


class QuantizedLinear(nn.Module):
    """A frozen linear layer whose weight is quantized: below `DEQUANTIZED_ROWS` rows a subclass's `kernel`
    computes, from there the weight is de-quantised for the call (`dequantized`)."""

    bias: torch.Tensor | None
    in_features: int
    out_features: int

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= DEQUANTIZED_ROWS:
            out = F.linear(rows, self.dequantized(x.dtype))
        else:
            out = self.kernel(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(QuantizedLinear):
    """A frozen linear layer with int8 weights [out, in] and a scale per output row."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("qweight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight this layer computes with, [out, in] in `dtype`."""
        return (self.qweight.to(self.scales.dtype) * self.scales[:, None]).to(dtype)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(QuantizedLinear):
    """A frozen linear layer with 4-bit weights [out, in], in groups of `GROUP_SIZE` inputs that each have a scale
    and a zero point: weight = (code - 8) * scale + zero."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        out_features, in_features = linear.weight.shape
        groups = linear.weight.detach().float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        codes = codes.reshape(out_features, in_features)
        # the kernel's layout, and the same codes two to a byte for de-quantising (the kernel's is opaque)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), INNER_K_TILES))
        self.register_buffer("codes", codes[:, 0::2] | (codes[:, 1::2] << 4))
        self.register_buffer("scales_and_zeros", torch.stack([scale, low + 8 * scale], -1).transpose(0, 1)
                             .to(torch.bfloat16).contiguous())  # [in / GROUP_SIZE, out, 2]
        self.bias = linear.bias
        self.in_features, self.out_features = in_features, out_features

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight this layer computes with, [out, in] in `dtype`."""
        codes = torch.stack([self.codes & 15, self.codes >> 4], -1).reshape(self.out_features, -1, GROUP_SIZE)
        scale, zero = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [out, in / GROUP_SIZE] each
        weight = (codes.float() - 8) * scale[..., None] + zero[..., None]
        return weight.reshape(self.out_features, self.in_features).to(dtype)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows.to(torch.bfloat16), self.packed, GROUP_SIZE,
                                                          self.scales_and_zeros).to(rows.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 (groups of {GROUP_SIZE})"


QUANTIZED_LAYERS = {"int8": Int8Linear, "int4": Int4Linear}


def check_quantize(name: str, device: torch.device | str = "cpu") -> str:
    """`name` if this build can run it on `device`, else a one-line MedusaError."""
    if name not in QUANTIZATIONS:
        raise MedusaError(f"Unknown quantization `{name}`; use one of {', '.join(QUANTIZATIONS)}.")
    if name != "none" and torch.device(device).type != "cpu":
        raise MedusaError(f"`{name}` quantization runs on the CPU only (torch's CPU kernels), not on `{device}`.")
    if name == "int4" and not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        raise MedusaError(f"`int4` quantization needs torch 2.6 or later (its CPU int4 kernel); this is "
                          f"{torch.__version__}.")
    return name


def kernel_slowdown(layer: QuantizedLinear, dtype: torch.dtype, repeats: int = 7) -> float:
    """How many times longer one row in `dtype` takes through `layer`'s quantized kernel than through its float
    weight (the median of `repeats` timings each, after a warm-up): above 1 this CPU has no fast kernel for it."""
    x = torch.randn(1, layer.in_features, dtype=dtype)
    weight = layer.dequantized(dtype)
    runs = {"quantized": lambda: layer(x), "float": lambda: F.linear(x, weight)}
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
    return seconds["quantized"] / seconds["float"]


def _wanted(name: str, backbone: nn.Module) -> bool:
    """Whether `name` quantizes anything (not `none`); a one-line MedusaError where it cannot run on `backbone`."""
    if check_quantize(name, backbone.device) == "none":
        return False
    if backbone.dtype not in (torch.float32, torch.bfloat16):
        raise MedusaError(f"`{name}` quantization needs a float32 or bfloat16 backbone, not {backbone.dtype}.")
    return True


def _quantize_linears(root: nn.Module, name: str, what: str, skip: str = "") -> list[QuantizedLinear]:
    """Replace every `nn.Linear` under `root` but those under its submodule `skip` by its `name` quantized layer, in
    place; `what` names them in errors."""
    targets = [(path, m) for path, m in root.named_modules()
               if type(m) is nn.Linear and not (skip and (path + ".").startswith(skip + "."))]
    if name == "int4" and any(m.in_features % GROUP_SIZE for _, m in targets):
        raise MedusaError(f"`int4` quantization needs layers whose inputs divide into groups of {GROUP_SIZE}; {what} "
                          f"has {sorted({m.in_features for _, m in targets})}.")
    layers = []
    for path, linear in targets:
        parent, _, child = path.rpartition(".")
        layers.append(QUANTIZED_LAYERS[name](linear))
        setattr(root.get_submodule(parent), child, layers[-1])
    return layers


def quantize_backbone(backbone: nn.Module, name: str) -> int:
    """Quantize the linear layers of `backbone`'s decoder as `name` says, in place; returns how many. Call it once
    the backbone is on its device in its dtype and frozen."""
    if not _wanted(name, backbone):
        return 0
    layers = _quantize_linears(backbone.get_decoder(), name, "this backbone")
    # int8 only: one layer timed alone has its weight in cache, which flatters the float product; int4 measured
    # 1.2x slower so, and a whole step 0.75x the float time (docs/benchmarks.md). int8 was 4-5x slower both ways.
    if layers and name == "int8":
        slowdown = kernel_slowdown(max(layers, key=lambda m: m.in_features * m.out_features), backbone.dtype)
        if slowdown > 1.2:  # beyond timing noise
            logger.warning("int8 weights compute %.1fx slower than %s on this CPU (torch's int8 kernel is fast only "
                           "with AVX512-VNNI or AMX): decoding will be slower than with `--quantize none`.",
                           slowdown, str(backbone.dtype).removeprefix("torch."))
    return len(layers)


def quantize_draft_weights(model: nn.Module, name: str) -> int:
    """Quantize a `MedusaModel`'s drafting weights as `name` says, in place: the linear layers its heads own and its
    copy of the backbone's draft-vocabulary rows, never the backbone's own LM head, which verifies. Lossless: the
    drafts may change a little, every committed token is still the backbone's. Returns how many layers."""
    if not _wanted(name, model.backbone):
        return 0
    # a projection that is the backbone's LM head is listed once, under the backbone
    return len(_quantize_linears(model, name, "this drafter", skip="backbone"))


def quantization_of(model: nn.Module) -> str:
    """The quantization `quantize_backbone` applied to `model`, or `none`."""
    kinds = {name for name, kind in QUANTIZED_LAYERS.items() for m in model.modules() if isinstance(m, kind)}
    return kinds.pop() if kinds else "none"


def draft_weights_quantization(model: nn.Module) -> str:
    """The quantization `quantize_draft_weights` applied to a `MedusaModel`, or `none`."""
    return quantization_of(nn.ModuleList(m for name, m in model.named_children() if name != "backbone"))
