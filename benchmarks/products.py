r"""
A bf16 forward's products at the row counts of decoding steps, oneDNN's (weights packed for it) against this
project's panel products (`csrc/packed_linear.cpp`), over the embedded model's shapes (30 layers of fused q/k/v,
o, fused gate/up and down projections, and the LM head), in one process, interleaved:

    python benchmarks/products.py --rows 1,4,8,15,32

Prints ms for all products of one forward (medians) and the bandwidth the panels reach. Weights are random: the
timing does not depend on their values.
"""

import argparse

import torch

from medusa_heads.cpu_ops import panel_products
from medusa_heads.packing import panel_layout
from warpers import timed  # this folder's: scripts run with it first on the path

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS + [(VOCAB, HIDDEN)]


def forward_ms(products, inputs, repeats: int) -> float:
    def run():
        for product in products:
            product(inputs[product.in_features])
    return timed(run, repeats)


class Timed:
    def __init__(self, call, weight, in_features: int):
        self.call, self.weight, self.in_features = call, weight, in_features

    def __call__(self, x):
        return self.call(x, self.weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,15,32", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not panel_products():
        raise SystemExit("no panel products here: they need AVX512-BF16 and a C++ compiler")
    torch.set_num_threads(args.threads)
    onednn, panels, nbytes = [], [], 0
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        nbytes += weight.numel() * 2
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        laid = panel_layout(weight)
        onednn.append(Timed(lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), packed,
                            in_features))
        panels.append(Timed(lambda x, w: torch.ops.medusa_heads.panel_linear(x, w, None), laid, in_features))
    print(f"{len(SHAPES)} bf16 products, {nbytes / 1e6:.0f} MB of weights, {args.threads} threads")
    print("| rows | oneDNN (ms) | panels (ms) | panels' speed-up | panels' GB/s |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in (HIDDEN, INTERMEDIATE)}
        a, b = forward_ms(onednn, inputs, args.repeats), forward_ms(panels, inputs, args.repeats)
        print(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {nbytes / b / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
