#!/usr/bin/env bash
# Issue 18's training run on one CUDA GPU, sized for a lent device's few minutes: the EAGLE-3 drafter of
# configs/smollm2-135m-eagle3.yaml trained far longer than two CPU cores allow, and a first measurement on the GPU.
#
#   benchmarks/eagle3_gpu.sh [SECONDS]     (default 540: what this call may take, start-up of Python included)
#
# Each stage resumes from what the last call left in runs/eagle3-gpu (kept between calls on a warm machine), so a
# call cut short by its budget is continued by the next. Stages:
#   1. data: the mix and held-out answers the checkout lacks (training/data/, the commands of docs/training.md
#      "Data beyond the templates"; PROMPTS above the 2,600 shipped asks for more), answered on the GPU in bf16
#      with large batches, for at most DATA_SECONDS; the held-out prompts stay lines 2,451-2,600 as the file grows;
#   2. train: the recipe with `--loss kl`, hidden states computed online, continuing the shipped drafter
#      (`init_heads`; INIT_HEADS= starts from scratch), until MEASURE_SECONDS before the end or STEPS;
#   3. measure: the n-gram store, with FIT_TREE=1 a tree fitted to the drafter's held-out counts and this GPU's
#      step times, and a bench of PER_CATEGORY prompts per category: HF greedy, the shipped EAGLE and EAGLE-3
#      drafters' best configurations and the new drafter on dynamic trees.
# Writes the drafter (heads/), the data files, bench.json/md and run.log to bench-out/eagle3-gpu; with $OUT set
# (the lent device) also packs that folder as $OUT/eagle3.tar.gz.part-* (15 MiB parts: what comes back from a
# device is a few files of at most 16 MiB), on every exit. Give SECONDS 30 s under the call's own limit.
#
# The sizes are variables, so that the whole chain can be tried on a CPU at toy scale before a device's minutes
# are spent on it (in a scratch clone: its data lands in training/data/): DEVICE=cpu DTYPE=float32 BATCH=8
# PROMPTS=2606 SAMPLED=402 NEW_TOKENS=24 STEPS=4 TRAIN_BATCH=4 PER_CATEGORY=1 BENCH_TOKENS=16.
set -euo pipefail
cd "$(dirname "$0")/.."

budget=${1:-540}
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
prompts_count=${PROMPTS:-2600}    # self-instruct prompts
dev_end=${DEV_END:-2600}          # the HELD_OUT prompts up to this line are held out (fixed as the file grows)
held_out=${HELD_OUT:-150}
data_seconds=${DATA_SECONDS:-0}   # a cap on the data stage (0: none); what is answered by then is kept
templates=${TEMPLATES:-1392}      # shipped template prompts answered
sampled=${SAMPLED:-400}           # self-instruct prompts answered again at temperature 0.7
loss=${LOSS:-kl}                  # the trainer's objective: kl (the backbone's distribution) or ce
turn2_share=${TURN2_SHARE:-0.17}  # share of the self-instruct answers continued with a follow-up request
new_tokens=${NEW_TOKENS:-192}
batch=${BATCH:-512}               # prompts a generation batch
train_batch=${TRAIN_BATCH:-32}    # sequences a training step (an H200 ran 10 steps a second at 32)
learning_rate=${LR:-3e-4}
steps=${STEPS:-3000}              # at batch 32 about 20 epochs of the shipped mix
nodes=${NODES:-64}                # largest tree `tree optimize` considers
per_category=${PER_CATEGORY:-1}   # benchmark prompts of each category
bench_tokens=${BENCH_TOKENS:-64}   # the tree runtime took 5-9 s a method for 128 tokens there
init_heads=${INIT_HEADS-medusa_heads/pretrained/smollm2-135m-embedded-eagle3}  # continued; INIT_HEADS= starts afresh
repick=${REPICK:-1}               # 1: the continued drafter's draft vocabulary is counted again on the grown data

bin=medusa-heads
python=${PYTHON:-python}
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
data_end=$((data_seconds > 0 ? data_seconds : budget))
data_left() { local s=$((data_end - SECONDS)); echo $((s > 1 ? s : 1)); }
# past the data stage's cap a command is stopped and the stage goes on with what it wrote (rows are appended whole)
distill() { timeout "$(data_left)" "$bin" distill "${gpu[@]}" --batch-size "$batch" --max-new-tokens "$new_tokens" "$@"; }

# 1. Data (each command skips what its output already holds).
mkdir -p "$data/mix" "$data/dev"
touch "$data/self_instruct_prompts.jsonl"
if [ "$(wc -l < "$data/self_instruct_prompts.jsonl")" -lt "$prompts_count" ]; then
    timeout "$(data_left)" "$bin" self-instruct "${gpu[@]}" --batch-size "$batch" --count "$prompts_count" \
        --out "$data/self_instruct_prompts.jsonl" --exclude benchmarks/prompts.jsonl || true
fi
dev_start=$((dev_end - held_out + 1))
sed -n "${dev_start},${dev_end}p" "$data/self_instruct_prompts.jsonl" > "$work/self_dev_prompts.jsonl"
sed "${dev_start},${dev_end}d" "$data/self_instruct_prompts.jsonl" > "$work/self_train_prompts.jsonl"
distill --prompts "$work/self_dev_prompts.jsonl" --out "$data/dev/self_dev_greedy.jsonl"
distill --prompts "$work/self_train_prompts.jsonl" --out "$data/mix/self_greedy.jsonl" || true
distill --prompts "$data/distill_prompts.jsonl" --out "$data/mix/template_greedy.jsonl" --limit "$templates" || true
[ -s "$work/self_turn2_prompts.jsonl" ] || "$bin" follow-ups "$data/mix/self_greedy.jsonl" \
    --out "$work/self_turn2_prompts.jsonl" --share "$turn2_share"
if [ -s "$work/self_turn2_prompts.jsonl" ]; then
    distill --prompts "$work/self_turn2_prompts.jsonl" --out "$data/mix/self_turn2_greedy.jsonl" || true
fi
distill --prompts "$work/self_train_prompts.jsonl" --out "$data/mix/self_sampled.jsonl" --limit "$sampled" \
    --temperature 0.7 --top-p 0.95 --seed 1 || true
wc -l "$data"/mix/*.jsonl "$data"/dev/*.jsonl
keep

# 2. Train: at most STEPS steps, as many as fit before the MEASURE_SECONDS that 3. keeps, from the shipped drafter;
# the hidden states are computed online (a GPU forward costs less than reading them back from disk).
run=$work/run
init=(); [ -n "$init_heads" ] && init=(--init_heads "$init_heads")
[ -n "$init_heads" ] && [ "$repick" = 1 ] && init+=(--repick_draft_vocab true)
mixed=no; [ "$dtype" = bfloat16 ] && mixed=bf16
if [ ! -f "$run/heads/config.json" ]; then
    minutes=$("$python" -c "print(max(1.0, ($(left) - ${MEASURE_SECONDS:-150}) / 60))")
    resume=(); compgen -G "$run/checkpoint-*" > /dev/null && resume=(--resume)
    timeout "$(left)" "$python" -m medusa_heads.training --config configs/smollm2-135m-eagle3.yaml "${resume[@]}" \
        "${init[@]}" --output_dir "$run" --cache_hidden_states false --batch_size "$train_batch" \
        --max_steps "$steps" --max_minutes "$minutes" --warmup_steps "$((steps < 30 ? steps : 30))" \
        --learning_rate "$learning_rate" --loss "$loss" --eval_every 100000 --checkpoint_every 400 \
        --backbone_dtype "$dtype" --mixed_precision "$mixed"
fi
cp -r "$run/heads" "$out/" && cp "$run/history.json" "$out/"

# 3. Measure.
heads=$out/heads
[ -f "$heads/ngram_store.safetensors" ] || "$bin" ngram-store "$data/mix" --heads "$heads"
if [ "${FIT_TREE:-0}" = 1 ] && [ ! -f "$out/eagle3-gpu.json" ]; then
    # step times per tree size, measured with the default heads (a drafter over the context cannot be profiled)
    profile=$(timeout "$(left)" "$bin" profile "${gpu[@]}" --max-nodes "$nodes" | tee /dev/stderr \
        | sed -n 's/^profile: //p')
    timeout "$(left)" "$bin" tree optimize "${gpu[@]}" --heads "$heads" --profile "$profile" \
        --calibration "$heads/head_accuracies.json" --max-nodes "$nodes" --out "$out/eagle3-gpu.json"
fi
# the shipped drafters' best configurations (eagle3-shipped: the drafter that 2. continued) against the new one
methods=hf,medusa+ngram+store:eagle-cpu-16#eagle,dynamic+ngram+store:32::6#eagle3-shipped
methods+=,dynamic+ngram+store:24#eagle3,dynamic+ngram+store:32::6#eagle3
timeout "$(left)" "$bin" bench "${gpu[@]}" --prompts benchmarks/prompts.jsonl --per-category "$per_category" \
    --max-new-tokens "$bench_tokens" --no-fp32-reference --out "$out" \
    --alt-heads eagle=medusa_heads/pretrained/smollm2-135m-embedded-eagle --alt-heads "eagle3=$heads" \
    --alt-heads eagle3-shipped=medusa_heads/pretrained/smollm2-135m-embedded-eagle3 \
    --methods "$methods"
