r"""
One forward of the compiled decoding step (`medusa_heads/compiled_llama.py`) against the eager `FastLlama`, side
by side in one process on the embedded model.

    python benchmarks/compiled_step.py --sizes 1,14 --dtype bfloat16

For each step size: the first call's time (compiling, or loading from inductor's disk cache), whether another
context length compiled again, ms per forward (median of interleaved rounds) compiled and eager, and how the logits
compare. `--python-wrapper` adds the same graph called from inductor's Python wrapper instead of its C++ one.
"""

import argparse
import statistics
import time

import torch
from torch._dynamo.utils import counters

from medusa_heads import MedusaModel
from medusa_heads.compiled_llama import CompiledLlama
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.inference.cache import round_up


def step_inputs(size: int, context: int, vocab: int, kv: list):
    """A causal step of `size` tokens after `context` entries, as `FastLlama.forward` takes it."""
    ids = torch.randint(0, vocab, (1, size))
    positions = torch.arange(context, context + size)[None]
    mask = torch.ones(1, 1, size, round_up(context + size), dtype=torch.bool).tril(context)
    return ids, positions, mask, kv, torch.arange(context, context + size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,14", help="step sizes (tokens per forward)")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--python-wrapper", action="store_true", help="also time the graph's Python wrapper")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = MedusaModel.from_pretrained(dtype=dtype, compile_step=True)
    config = model.backbone.config
    compiled = getattr(model.backbone, FAST_FORWARD)
    if not isinstance(compiled, CompiledLlama):
        raise SystemExit("The step did not compile here (see the warning above).")
    eager = compiled.eager
    runs = {"compiled": compiled.forward, "eager": eager.forward}
    if args.python_wrapper:
        runs["python wrapper"] = CompiledLlama(eager, cpp_wrapper=False).forward
    kv_shape = (1, eager.layers[0].kv_heads, 1024, eager.layers[0].head_dim)
    kv = [(torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype)) for _ in eager.layers]
    print(f"{args.dtype}, {args.threads} threads, context {args.context}")
    wrapper = " python wrapper ms |" if args.python_wrapper else ""
    print(f"| step size | first call (s) | graphs for another context | compiled ms | eager ms | eager / compiled "
          f"| max logit diff | same argmax |{wrapper}")
    print("|---|---|---|---|---|---|---|---|" + "---|" * args.python_wrapper)
    with torch.no_grad():
        for size in map(int, args.sizes.split(",")):
            inputs = step_inputs(size, args.context, config.vocab_size, kv)
            start = time.perf_counter()
            logits, _ = compiled.forward(*inputs)
            first = time.perf_counter() - start
            reference, _ = eager.forward(*inputs)
            graphs = counters["stats"]["unique_graphs"]
            compiled.forward(*step_inputs(size, args.context + 100, config.vocab_size, kv))
            again = counters["stats"]["unique_graphs"] - graphs
            if args.python_wrapper:
                runs["python wrapper"](*inputs)  # its own graph: compiled before the timing
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run(*inputs)
                    times[name].append((time.perf_counter() - start) * 1e3)
            ms = {name: statistics.median(t) for name, t in times.items()}
            diff = (logits.float() - reference.float()).abs().max().item()
            same = torch.equal(logits.argmax(-1), reference.argmax(-1))
            print(f"| {size} | {first:.1f} | {again} | {ms['compiled']:.2f} | {ms['eager']:.2f} "
                  f"| {ms['eager'] / ms['compiled']:.2f}x | {diff:.3g} | {same} |"
                  + (f" {ms['python wrapper']:.2f} |" if args.python_wrapper else ""))


if __name__ == "__main__":
    main()
