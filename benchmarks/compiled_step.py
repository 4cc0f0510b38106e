r"""
A prototype of the compiled decoding forward (the compiled-step issue), against the eager `FastLlama`, side by
side in one process on the embedded model.

The layer loop is `FastLlama`'s, written for `torch.compile(fullgraph=True)`: the products are oneDNN calls with
the runtime's own packed weights through a C++ operator (`packed_linear_op.cpp`, built here with
torch.utils.cpp_extension: a compiler and the torch headers are needed), the new keys and values go into static
buffers with `index_copy_` at slots given as a tensor, and the attention window is a dynamic size, so one graph per
tree size serves every context length. Inductor fuses the rest (RMSNorm, rotation, SiLU * up) into C++ loops.
It is not wired into the runtime: it measures what compiling would give one forward.

    python benchmarks/compiled_step.py --sizes 1,14 --dtype bfloat16

For each tree size: the first call's time (compiling), whether a second context length compiled again, ms per
forward (median of interleaved rounds) compiled and eager, and how the logits compare (bf16: the fused glue
still rounds a little otherwise than eager, and logits drift through 30 layers; fp32: they agree to about 1e-3).
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from medusa_heads import MedusaModel
from medusa_heads.fast_llama import FAST_FORWARD, FastLlama, rms_norm
from medusa_heads.inference.cache import round_up

# Round bf16 glue where eager rounds it: bf16 logits then stay within a few units of eager's, at the same speed
torch._inductor.config.emulate_precision_casts = True
load(name="medusa_bench_ops", sources=[str(Path(__file__).with_name("packed_linear_op.cpp"))],
     is_python_module=False, extra_cflags=["-O2"])


@torch.library.register_fake("medusa_bench::packed_linear")
def _packed_linear_shape(x, index, out_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))


class Product:
    """One packed weight, called through the C++ operator."""

    def __init__(self, packed: torch.Tensor, out_features: int):
        self.index, self.out_features = torch.ops.medusa_bench.keep_packed(packed), out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.medusa_bench.packed_linear(x, self.index, self.out_features, None)


class CompiledLlama:
    """`FastLlama`'s forward over the same packed weights, in a form `torch.compile` takes whole."""

    def __init__(self, fast: FastLlama, config):
        self.fast = fast
        width = {"qkv": (config.num_attention_heads + 2 * config.num_key_value_heads) * fast.layers[0].head_dim,
                 "gate_up": 2 * config.intermediate_size}
        self.products = [(Product(layer.qkv.packed, width["qkv"]),
                          Product(layer.o_proj.keywords["packed"], config.hidden_size),
                          Product(layer.gate_up.packed, width["gate_up"]),
                          Product(layer.down_proj.keywords["packed"], config.hidden_size))
                         for layer in fast.layers]
        self.lm_head = Product(fast.lm_head.packed, config.vocab_size)
        self.compiled = torch.compile(self.forward, fullgraph=True, dynamic=False)

    def forward(self, input_ids, positions, mask, slots, kv):
        fast = self.fast
        B, T = input_ids.shape
        window = mask.shape[-1]
        x = fast.embed(input_ids)
        cos, sin = fast.rotary(positions)
        for layer, (qkv, o_proj, gate_up, down), (keys, values) in zip(fast.layers, self.products, kv):
            D, Hq, Hkv = layer.head_dim, layer.heads, layer.kv_heads
            weight, eps = layer.norms[0]
            q_k_v = qkv(rms_norm(x, weight, eps)).view(B, T, Hq + 2 * Hkv, D)
            qk, v = q_k_v[:, :, : Hq + Hkv], q_k_v[:, :, Hq + Hkv :]
            qk = qk * cos + qk.roll(D // 2, dims=-1) * sin
            keys.index_copy_(2, slots, qk[:, :, Hq:].transpose(1, 2))
            values.index_copy_(2, slots, v.transpose(1, 2))
            out = F.scaled_dot_product_attention(qk[:, :, :Hq].transpose(1, 2), keys[:, :, :window],
                                                 values[:, :, :window], attn_mask=mask, scale=layer.scaling,
                                                 enable_gqa=Hq != Hkv).transpose(1, 2)
            x = x + o_proj(out.reshape(B, T, Hq * D))
            weight, eps = layer.norms[1]
            gate, up = gate_up(rms_norm(x, weight, eps)).chunk(2, dim=-1)
            x = x + down(F.silu(gate) * up)
        weight, eps = fast.norm
        return self.lm_head(rms_norm(x[:, -1:], weight, eps))


def step_inputs(size: int, context: int, window: int, vocab: int):
    """A tree of `size` nodes after `context` entries: ids, positions, a causal mask over `window` slots, slots."""
    ids = torch.randint(0, vocab, (1, size))
    positions = torch.arange(context, context + size)[None]
    mask = torch.ones(1, 1, size, window, dtype=torch.bool).tril(context)
    return ids, positions, mask, torch.arange(context, context + size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,14", help="tree sizes (tokens per forward)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = MedusaModel.from_pretrained(dtype=dtype)
    config = model.backbone.config
    fast = getattr(model.backbone, FAST_FORWARD)
    compiled = CompiledLlama(fast, config)
    kv_shape = (1, config.num_key_value_heads, 1024, fast.layers[0].head_dim)
    kv = [(torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype)) for _ in fast.layers]
    print(f"{args.dtype}, {args.threads} threads, context {args.context}")
    print("| tree size | first call (s) | another window (s) | compiled ms | eager ms | eager / compiled "
          "| max logit diff | same argmax |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for size in map(int, args.sizes.split(",")):
            window = round_up(args.context + size)
            ids, positions, mask, slots = step_inputs(size, args.context, window, config.vocab_size)
            torch._dynamo.mark_dynamic(mask, 3)
            start = time.perf_counter()
            logits = compiled.compiled(ids, positions, mask, slots, kv)
            first = time.perf_counter() - start
            reference, _ = fast.forward(ids, positions, mask, kv, args.context, window, (), 1)
            other = step_inputs(size, args.context + 100, round_up(args.context + 100 + size), config.vocab_size)
            start = time.perf_counter()
            compiled.compiled(*other, kv)
            second = time.perf_counter() - start
            times = {"compiled": [], "eager": []}
            for _ in range(args.rounds):
                for name, run in (("compiled", lambda: compiled.compiled(ids, positions, mask, slots, kv)),
                                  ("eager", lambda: fast.forward(ids, positions, mask, kv, args.context, window,
                                                                 (), 1))):
                    start = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - start) * 1e3)
            ms = {name: statistics.median(t) for name, t in times.items()}
            diff = (logits.float() - reference.float()).abs().max().item()
            same = torch.equal(logits.argmax(-1), reference.argmax(-1))
            print(f"| {size} | {first:.1f} | {second:.1f} | {ms['compiled']:.2f} | {ms['eager']:.2f} "
                  f"| {ms['eager'] / ms['compiled']:.2f}x | {diff:.3g} | {same} |")


if __name__ == "__main__":
    main()
