r"""
Speculation on a quantised backbone: the shipped Medusa heads (trained on the reference backbone) and heads
fine-tuned on each backbone's own answers, run on the reference bf16 backbone and on its int8 version, side by
side: held-out head accuracy, tokens per forward and tokens/s, plain decoding speed, and how often the int8
backbone's greedy answers are the reference's.

The reference backbone is the embedded SmolLM2-135M-Instruct as it ships, a Q4_1 GGUF de-quantised to bf16.

    python benchmarks/quantized_backbone.py --out docs/bench/quantized-backbone

Stages, each skipped when its output exists in `--out` (a killed run resumes):
1. prompts from `training/data/distill_prompts.jsonl` (never the benchmark prompts), taken from the longest ones,
   which the shipped Medusa heads did not train on: `--train-prompts` to fine-tune on, `--held-out` to score;
2. each backbone answers them itself (`distill`, bf16, greedy);
3. the shipped heads fine-tuned for `--steps` steps on each backbone's answers (the trainer, `init_heads`);
4. per backbone and heads: top-1 accuracy per head, teacher-forced on that backbone's held-out answers;
5. per backbone: `bench` on `--bench-prompts` benchmark prompts per category: plain decoding (this runtime's
   `plain`, and HF greedy on the same backbone, every ratio's base) and the three heads on `--tree`.
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from medusa_heads import EMBEDDED_MODEL, MedusaModel, load_backbone, load_tokenizer
from medusa_heads.apps.bench import bench, read_bench_prompts
from medusa_heads.model import SHIPPED_HEADS, load_heads
from medusa_heads.quantize import quantize_backbone
from medusa_heads.training.data import load_examples
from medusa_heads.training.distill import distill, read_prompts
from medusa_heads.training.hidden_states import compute_hidden, pad_batch
from medusa_heads.training.losses import rank_hits
from medusa_heads.training.recipe import TrainConfig, load_recipe
from medusa_heads.training.trainer import heads_forward, train

SHIPPED = SHIPPED_HEADS[EMBEDDED_MODEL].parent / "smollm2-135m-embedded-medusa"
BACKBONES = {"reference": "none", "int8": "int8"}  # label -> quantize
SHIPPED_TRAINING_ANSWERS = 2592  # the shipped Medusa heads saw the answers to the 2,592 shortest prompts
ROOT = Path(__file__).resolve().parent.parent


def select_prompts(out: Path, n_train: int, n_held: int) -> dict[str, Path]:
    """The longest distillation prompts (beyond those the shipped heads trained on), every other one held out
    until `n_held` are, written as prompt files."""
    bench_texts = {row["prompt"] for row in read_bench_prompts(ROOT / "benchmarks" / "prompts.jsonl")}
    rows = [r for r in read_prompts(ROOT / "training" / "data" / "distill_prompts.jsonl")
            if r["prompt"] not in bench_texts]
    unseen = sorted(rows, key=lambda r: len(r["prompt"]))[SHIPPED_TRAINING_ANSWERS:]
    held, train_rows = unseen[0:2 * n_held:2], unseen[1:2 * n_held:2] + unseen[2 * n_held:]
    files = {"train": out / "prompts-train.jsonl", "held": out / "prompts-held.jsonl"}
    for name, chosen in (("train", train_rows[:n_train]), ("held", held)):
        files[name].write_text("".join(json.dumps(r) + "\n" for r in chosen))
    return files


def answers(out: Path, backbone: str, split: str) -> Path:
    return out / f"answers-{backbone}-{split}.jsonl"


def fine_tune(out: Path, backbone: str, steps: int, timings: dict) -> Path:
    """The shipped heads trained further on `backbone`'s own answers; -> their folder."""
    heads = out / f"heads-{backbone}" / "heads"
    if not (heads / "config.json").is_file():
        start = time.perf_counter()
        train(load_recipe(ROOT / "configs" / "smollm2-135m-medusa.yaml", {
            "data": str(answers(out, backbone, "train")), "eval_data": str(answers(out, backbone, "held")),
            "init_heads": str(SHIPPED), "quantize": BACKBONES[backbone], "max_steps": steps,
            "warmup_steps": max(steps // 10, 1), "learning_rate": 3e-4, "checkpoint_every": steps,
            "eval_every": steps, "output_dir": str(out / f"heads-{backbone}"),
            "hidden_cache_dir": str(out / "hidden")}))
        timings[f"fine-tune {backbone}"] = time.perf_counter() - start
    return heads


@torch.no_grad()
def head_accuracy(backbone, heads_path: Path, held: Path, tokenizer, batch_size: int = 8) -> list[float]:
    """Top-1 per head on `held` answers, teacher-forced, scored as the trainer scores held-out answers."""
    heads = load_heads(heads_path).eval()
    cfg = TrainConfig(num_heads=heads.config.num_heads, max_length=320)
    lm_head = copy.deepcopy(backbone.get_output_embeddings()).float()
    examples = load_examples(str(held), tokenizer, cfg.max_length)
    hits = torch.zeros(cfg.num_heads, 1, dtype=torch.long)
    counts = torch.zeros(cfg.num_heads, dtype=torch.long)
    for b in range(0, len(examples), batch_size):
        ids, mask, attn = pad_batch(examples[b : b + batch_size])
        hidden = compute_hidden(backbone, ids, attn)
        logits, targets, _ = heads_forward(heads, lm_head, None, hidden.float(), ids, mask, cfg)
        h, c = rank_hits(logits, targets, 1)
        hits, counts = hits + h, counts + c
    return (hits[:, 0].double() / counts.clamp(min=1).double()).tolist()


def agreement(out: Path) -> dict:
    """The int8 backbone's greedy answers against the reference's on every distilled prompt."""
    def load(backbone):
        rows = {}
        for split in ("train", "held"):
            for line in answers(out, backbone, split).read_text().splitlines():
                row = json.loads(line)
                rows[row["id"]] = row["answer_ids"]
        return rows

    ref, int8 = load("reference"), load("int8")
    prefixes = []
    for key, a in ref.items():
        b = int8[key]
        prefixes.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    identical = sum(ref[k] == int8[k] for k in ref)
    return {"prompts": len(ref), "identical": identical,
            "mean_common_prefix": sum(prefixes) / len(prefixes),
            "mean_answer_tokens": sum(map(len, ref.values())) / len(ref)}


def markdown(result: dict) -> str:
    lines = ["| backbone | heads | held-out top-1, heads 1-4 | tokens per forward | tokens/s | vs HF greedy "
             "(median) | plain decoding tokens/s: this runtime, HF greedy |", "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['backbone']} | {row['heads']} | {', '.join(f'{a:.3f}' for a in row['top1'])} | "
                     f"{row['tokens_per_forward']:.2f} | {row['tokens_per_second']:.1f} | {row['speedup']:.2f}x | "
                     f"{row['plain_tokens_per_second']:.1f}, {row['hf_tokens_per_second']:.1f} |")
    a = result["agreement"]
    lines += ["", f"int8 greedy answers identical to the reference's: {a['identical']}/{a['prompts']} prompts; "
              f"first difference after {a['mean_common_prefix']:.1f} tokens on average (answers of "
              f"{a['mean_answer_tokens']:.1f} tokens).",
              "", "Wall times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in result["timings"].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train-prompts", type=int, default=240)
    parser.add_argument("--held-out", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per distilled answer")
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps (batch 8)")
    parser.add_argument("--bench-prompts", type=int, default=2, help="benchmark prompts per category")
    parser.add_argument("--bench-tokens", type=int, default=128)
    parser.add_argument("--tree", default="cpu-8", help="the tree of the speed runs (the default tree)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    timings_file = out / "timings.json"
    timings = json.loads(timings_file.read_text()) if timings_file.exists() else {}
    prompts = select_prompts(out, args.train_prompts, args.held_out)
    for backbone, quantize in BACKBONES.items():
        for split, path in prompts.items():
            start = time.perf_counter()
            if distill(path, answers(out, backbone, split), batch_size=32, max_new_tokens=args.max_new_tokens,
                       quantize=quantize):
                timings[f"distill {backbone} {split}"] = time.perf_counter() - start
        timings_file.write_text(json.dumps(timings, indent=1))
    heads = {"shipped": SHIPPED}
    for backbone in BACKBONES:
        heads[f"fine-tuned on {backbone}"] = fine_tune(out, backbone, args.steps, timings)
        timings_file.write_text(json.dumps(timings, indent=1))
    tokenizer = load_tokenizer()
    labels = {name: f"h{i}" for i, name in enumerate(heads)}
    methods = {name: f"medusa:{args.tree}" + (f"#{label}" if name != "shipped" else "") for name, label in
               labels.items()}
    bench_rows = read_bench_prompts(ROOT / "benchmarks" / "prompts.jsonl", per_category=args.bench_prompts)
    rows = []
    for backbone, quantize in BACKBONES.items():
        start = time.perf_counter()
        scorer = load_backbone(dtype=torch.bfloat16)
        quantize_backbone(scorer, quantize)
        held = answers(out, backbone, "held")
        accuracy = {name: head_accuracy(scorer, path, held, tokenizer) for name, path in heads.items()}
        del scorer
        timings[f"accuracy {backbone}"] = time.perf_counter() - start
        start = time.perf_counter()
        model = MedusaModel.from_pretrained(SHIPPED, dtype=torch.bfloat16, quantize=quantize)
        speed = bench(model, tokenizer, bench_rows, ["hf", "plain", *methods.values()], args.bench_tokens,
                      alt_heads={labels[n]: str(p) for n, p in heads.items() if n != "shipped"})
        (out / f"bench-{backbone}.json").write_text(json.dumps(speed, indent=1))
        timings[f"bench {backbone}"] = time.perf_counter() - start
        summary = speed["summary"]
        for name, method in methods.items():
            rows.append({"backbone": backbone, "heads": name, "top1": accuracy[name],
                         "tokens_per_forward": summary[method]["mean_accepted_length"],
                         "tokens_per_second": summary[method]["tokens_per_second"],
                         "speedup": summary[method]["speedup_median"],
                         "plain_tokens_per_second": summary["plain"]["tokens_per_second"],
                         "hf_tokens_per_second": summary["hf"]["tokens_per_second"]})
        timings_file.write_text(json.dumps(timings, indent=1))
    result = {"rows": rows, "agreement": agreement(out), "timings": timings, "tree": args.tree,
              "bench_prompts": len(bench_rows), "bench_tokens": args.bench_tokens, "threads": args.threads,
              "fingerprint": speed["fingerprint"], "args": {k: str(v) for k, v in vars(args).items()}}
    (out / "quantized_backbone.json").write_text(json.dumps(result, indent=1))
    (out / "quantized_backbone.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
