#!/usr/bin/env bash
# Issue 18's training run on one CUDA GPU, sized for a lent device's few minutes: the EAGLE-3 drafter of
# configs/smollm2-135m-eagle3.yaml trained far longer than two CPU cores allow, its tree fitted on held-out counts,
# and a first measurement against the shipped default on the GPU.
#
#   benchmarks/eagle3_gpu.sh [SECONDS]     (default 540: what this call may take, start-up of Python included)
#
# Each stage resumes from what the last call left in runs/eagle3-gpu (kept between calls on a warm machine), so a
# call cut short by its budget is continued by the next. Stages:
#   1. data: the mix and held-out answers the checkout lacks (training/data/, the commands of docs/training.md
#      "Data beyond the templates"), answered on the GPU in bf16 with large batches;
#   2. train: the recipe with a time budget (`max_minutes`: what is left of SECONDS, less 2 minutes for 3.),
#      continuing the shipped preview drafter (`init_heads`; INIT_HEADS= starts from scratch);
#   3. measure: the n-gram store, a tree fitted to the drafter's held-out counts and this GPU's step times, and a
#      bench of 2 prompts per category against the default configuration and the shipped EAGLE drafter.
# Writes the drafter (heads/), its tree, the data files, bench.json/md and run.log to bench-out/eagle3-gpu; with
# $OUT set (the lent device) also packs that folder as $OUT/eagle3.tar.gz.part-* (15 MiB parts: what comes back
# from a device is a few files of at most 16 MiB), on every exit. Give SECONDS 30 s under the call's own limit.
#
# The sizes are variables, so that the whole chain can be tried on a CPU at toy scale before a device's minutes
# are spent on it: DEVICE=cpu DTYPE=float32 BATCH=8 PROMPTS=14 HELD_OUT=4 TEMPLATES=6 SAMPLED=4 TURN2_SHARE=0.5
# NEW_TOKENS=24 STEPS=30 NODES=6 PER_CATEGORY=1 BENCH_TOKENS=16 (in a scratch clone: its data lands in training/data/).
set -euo pipefail
cd "$(dirname "$0")/.."

budget=${1:-540}
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
prompts_count=${PROMPTS:-2600}    # self-instruct prompts, the last HELD_OUT of them held out
held_out=${HELD_OUT:-150}
templates=${TEMPLATES:-1392}      # shipped template prompts answered
sampled=${SAMPLED:-400}           # self-instruct prompts answered again at temperature 0.7
turn2_share=${TURN2_SHARE:-0.17}  # share of the self-instruct answers continued with a follow-up request
new_tokens=${NEW_TOKENS:-192}
batch=${BATCH:-256}               # prompts a generation batch
steps=${STEPS:-3000}              # at batch 24 about 15 epochs of the mix; the time budget may stop it earlier
nodes=${NODES:-64}                # largest tree `tree optimize` considers
per_category=${PER_CATEGORY:-2}   # benchmark prompts of each category
bench_tokens=${BENCH_TOKENS:-128}
init_heads=${INIT_HEADS-medusa_heads/pretrained/smollm2-135m-embedded-eagle3}  # continued; INIT_HEADS= starts afresh

bin=medusa-heads
python=python
if [ -x .venv/bin/medusa-heads ]; then bin=.venv/bin/medusa-heads; python=.venv/bin/python; fi
if [ "$device" = cuda ]; then
    "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'eagle3_gpu.sh: no CUDA device')"
fi

out=bench-out/eagle3-gpu
work=runs/eagle3-gpu
mkdir -p "$out" "$work"
exec > >(tee -a "$out/run.log") 2>&1
left() { local s=$((budget - SECONDS)); echo $((s > 1 ? s : 1)); }  # `timeout 0` would not time out
keep() {
    mkdir -p "$out/data" && cp -r training/data/mix training/data/dev "$out/data/" 2>/dev/null || true
    if [ -n "${OUT:-}" ]; then
        rm -f "$OUT"/eagle3.tar.gz.part-*
        tar czf - "$out" | split -b 15M - "$OUT/eagle3.tar.gz.part-"
    fi
}
trap keep EXIT

data=training/data
gpu=(--device "$device" --dtype "$dtype")
distill() { timeout "$(left)" "$bin" distill "${gpu[@]}" --batch-size "$batch" --max-new-tokens "$new_tokens" "$@"; }

# 1. Data (each command skips what its output already holds).
mkdir -p "$data/mix" "$data/dev"
touch "$data/self_instruct_prompts.jsonl"
if [ "$(wc -l < "$data/self_instruct_prompts.jsonl")" -lt "$prompts_count" ]; then
    timeout "$(left)" "$bin" self-instruct "${gpu[@]}" --batch-size "$batch" --count "$prompts_count" \
        --out "$data/self_instruct_prompts.jsonl" --exclude benchmarks/prompts.jsonl
fi
head -n "$((prompts_count - held_out))" "$data/self_instruct_prompts.jsonl" > "$work/self_train_prompts.jsonl"
tail -n "+$((prompts_count - held_out + 1))" "$data/self_instruct_prompts.jsonl" | head -n "$held_out" \
    > "$work/self_dev_prompts.jsonl"
distill --prompts "$work/self_dev_prompts.jsonl" --out "$data/dev/self_dev_greedy.jsonl"
distill --prompts "$work/self_train_prompts.jsonl" --out "$data/mix/self_greedy.jsonl"
distill --prompts "$data/distill_prompts.jsonl" --out "$data/mix/template_greedy.jsonl" --limit "$templates"
[ -s "$work/self_turn2_prompts.jsonl" ] || "$bin" follow-ups "$data/mix/self_greedy.jsonl" \
    --out "$work/self_turn2_prompts.jsonl" --share "$turn2_share"
if [ -s "$work/self_turn2_prompts.jsonl" ]; then
    distill --prompts "$work/self_turn2_prompts.jsonl" --out "$data/mix/self_turn2_greedy.jsonl"
fi
distill --prompts "$work/self_train_prompts.jsonl" --out "$data/mix/self_sampled.jsonl" --limit "$sampled" \
    --temperature 0.7 --top-p 0.95 --seed 1
keep

# 2. Train: batches of 24 (3x the CPU recipe's), at most STEPS steps, as many as fit, from the shipped preview.
run=$work/run
init=(); [ -n "$init_heads" ] && init=(--init_heads "$init_heads")
mixed=no; [ "$dtype" = bfloat16 ] && mixed=bf16
if [ ! -f "$run/heads/config.json" ]; then
    minutes=$("$python" -c "print(max(1.0, ($(left) - 120) / 60))")
    resume=(); compgen -G "$run/checkpoint-*" > /dev/null && resume=(--resume)
    timeout "$(left)" "$python" -m medusa_heads.training --config configs/smollm2-135m-eagle3.yaml "${resume[@]}" \
        "${init[@]}" --output_dir "$run" --hidden_cache_dir "$work/hidden" --batch_size 24 --max_steps "$steps" \
        --max_minutes "$minutes" --warmup_steps "$((steps < 50 ? steps : 50))" --eval_every 500 \
        --checkpoint_every 500 --backbone_dtype "$dtype" --mixed_precision "$mixed"
fi
cp -r "$run/heads" "$out/" && cp "$run/history.json" "$out/"

# 3. Measure.
heads=$out/heads
[ -f "$heads/ngram_store.safetensors" ] || "$bin" ngram-store "$data/mix" --heads "$heads"
if [ ! -f "$out/eagle3-gpu.json" ]; then
    # step times per tree size, measured with the default heads (a drafter over the context cannot be profiled)
    profile=$(timeout "$(left)" "$bin" profile "${gpu[@]}" --max-nodes "$nodes" | tee /dev/stderr \
        | sed -n 's/^profile: //p')
    timeout "$(left)" "$bin" tree optimize "${gpu[@]}" --heads "$heads" --profile "$profile" \
        --calibration "$heads/head_accuracies.json" --max-nodes "$nodes" --out "$out/eagle3-gpu.json"
fi
methods=hf,medusa+ngram:hydra-cpu-6,medusa+ngram+store:eagle-cpu-16#eagle
methods+=,medusa+ngram+store:$out/eagle3-gpu.json#eagle3,dynamic+ngram+store:24#eagle3,dynamic+ngram+store:48#eagle3
timeout "$(left)" "$bin" bench "${gpu[@]}" --prompts benchmarks/prompts.jsonl --per-category "$per_category" \
    --max-new-tokens "$bench_tokens" --no-fp32-reference --out "$out" \
    --alt-heads eagle=medusa_heads/pretrained/smollm2-135m-embedded-eagle --alt-heads "eagle3=$heads" \
    --methods "$methods"
