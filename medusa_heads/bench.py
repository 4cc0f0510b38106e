"""`medusa-heads bench`: methods side by side on the same prompts, interleaved in one process.

Every method decodes every prompt `repeats` times, in rotating order, after a warm-up; the speed-up of a
method is the median over prompts of its tokens/s divided by HF greedy's on the same prompt.
"""

import json
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from medusa_heads.errors import MedusaError
from medusa_heads.inference import GenerationStats, generate_ids, make_drafter
from medusa_heads.inference.generate import encode_prompt, eos_token_ids
from medusa_heads.tree import load_tree


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    stats: GenerationStats | None = None


def hf_method(prompt_lookup: int | None = None):
    def run(model, input_ids, max_new_tokens):
        kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        start = time.perf_counter()
        out = model.backbone.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                      max_new_tokens=max_new_tokens, **kw)
        return Run(out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start)
    return run


def medusa_method(tree_name: str, ngram: bool = False):
    drafters = {}

    def run(model, input_ids, max_new_tokens):
        if id(model) not in drafters:
            drafters[id(model)] = make_drafter(model, tree_name, ngram)
        stats = GenerationStats()
        eos = eos_token_ids(model, None)
        start = time.perf_counter()
        ids = [t for chunk in generate_ids(model, input_ids, drafters[id(model)], None, max_new_tokens, eos, None,
                                           stats) for t in chunk]
        return Run(ids, time.perf_counter() - start, stats)
    return run


def make_methods(names: list[str]) -> dict:
    methods = {}
    for name in names:
        if name == "hf":
            methods[name] = hf_method()
        elif name.startswith("hf-lookup"):
            methods[name] = hf_method(int(name.split(":")[1]) if ":" in name else 10)
        elif name.startswith(("medusa:", "medusa+ngram:")):
            load_tree(name.split(":", 1)[1])  # fail now on a bad tree, not after the warm-up
            methods[name] = medusa_method(name.split(":", 1)[1], ngram=name.startswith("medusa+ngram"))
        else:
            raise MedusaError(f"Unknown method `{name}`; use hf, hf-lookup[:N], medusa:TREE or medusa+ngram:TREE.")
    if "hf" not in methods:
        methods = {"hf": hf_method(), **methods}  # the baseline every ratio is against
    return methods


def read_bench_prompts(path: Path, limit: int | None = None, per_category: int | None = None) -> list[dict]:
    if not path.is_file():
        raise MedusaError(f"Prompt file `{path}` does not exist.")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                rows.append({"id": str(row.get("id", n)), "category": row.get("category", "all"),
                             "prompt": row["prompt"]})
            except (json.JSONDecodeError, KeyError, TypeError):
                raise MedusaError(f"{path}:{n} is not a JSON object with a `prompt`.") from None
    if per_category is not None:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for row in rows:
            seen[row["category"]] += 1
            if seen[row["category"]] <= per_category:
                kept.append(row)
        rows = kept
    if not rows:
        raise MedusaError(f"Prompt file `{path}` holds no prompts.")
    return rows[:limit]


def fingerprint(model) -> dict:
    return {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "dtype": str(model.backbone.dtype), "device": str(model.device),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def bench(model, tokenizer, prompts: list[dict], method_names: list[str], max_new_tokens: int = 128,
          repeats: int = 1, fp32_backbone=None) -> dict:
    """`fp32_backbone`: when the model runs in lower precision, the fp32 greedy outputs to compare against
    (greedy exactness is an fp32 property; bf16 rounding alone changes greedy outputs)."""
    methods = make_methods(method_names)
    encoded = [encode_prompt(tokenizer, p["prompt"]).to(model.device) for p in prompts]
    fp32_outputs = None
    if fp32_backbone is not None:
        fp32_outputs = [fp32_backbone.generate(ids.to(fp32_backbone.device), do_sample=False,
                                               attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens
                                               )[0, ids.shape[1]:].tolist()
                        for ids in tqdm(encoded, desc="fp32 reference", unit="prompt")]
    for run in methods.values():  # warm-up
        run(model, encoded[0], 16)
    rows = []
    order = list(methods)
    for i, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt")):
        runs = defaultdict(list)
        for r in range(repeats):
            rotation = order[(i + r) % len(order):] + order[: (i + r) % len(order)]
            for name in rotation:
                runs[name].append(methods[name](model, ids, max_new_tokens))
        base = runs["hf"][0].token_ids
        for name, rs in runs.items():
            tps = [len(x.token_ids) / x.seconds for x in rs]
            stats = rs[0].stats
            rows.append({"prompt": p["id"], "category": p["category"], "method": name,
                         "tokens": len(rs[0].token_ids), "tokens_per_second": statistics.median(tps),
                         "identical_to_hf": rs[0].token_ids == base,
                         "identical_to_fp32": rs[0].token_ids == fp32_outputs[i] if fp32_outputs else None,
                         "accepted_lengths": stats.accepted_lengths if stats else None,
                         "head_acceptance": stats.head_acceptance if stats else None})
    return {"fingerprint": fingerprint(model), "max_new_tokens": max_new_tokens, "repeats": repeats,
            "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    base = {r["prompt"]: r["tokens_per_second"] for r in rows if r["method"] == "hf"}
    summary = {}
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == name]
        ratios = [r["tokens_per_second"] / base[r["prompt"]] for r in mine]
        lengths = [a for r in mine for a in (r["accepted_lengths"] or [])]
        by_cat = defaultdict(list)
        for r, ratio in zip(mine, ratios):
            by_cat[r["category"]].append(ratio)
        summary[name] = {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in mine),
            "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios),
            "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None,
            "identical_outputs": sum(r["identical_to_hf"] for r in mine), "prompts": len(mine),
            "identical_to_fp32": (sum(r["identical_to_fp32"] for r in mine)
                                  if mine[0]["identical_to_fp32"] is not None else None),
            "speedup_by_category": {c: statistics.median(v) for c, v in by_cat.items()},
        }
    return summary


def markdown(result: dict) -> str:
    fp32 = next(iter(result["summary"].values()))["identical_to_fp32"] is not None
    lines = ["| method | tokens/s (median) | speed-up vs HF greedy (median, min-max) | mean accepted length | "
             "identical to HF greedy |" + (" identical to fp32 greedy |" if fp32 else ""),
             "|---|---|---|---|---|" + ("---|" if fp32 else "")]
    for name, s in result["summary"].items():
        mal = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] else "1.00"
        lines.append(f"| {name} | {s['tokens_per_second']:.1f} | {s['speedup_median']:.2f}x "
                     f"({s['speedup_min']:.2f}-{s['speedup_max']:.2f}) | {mal} | "
                     f"{s['identical_outputs']}/{s['prompts']} |"
                     + (f" {s['identical_to_fp32']}/{s['prompts']} |" if fp32 else ""))
    fp = result["fingerprint"]
    lines.append(f"\n{fp['dtype']} on {fp['device']} ({fp['cpu']}, {fp['threads']} threads), torch {fp['torch']}, "
                 f"transformers {fp['transformers']}, {result['max_new_tokens']} new tokens, "
                 f"{result['repeats']} repeat(s).")
    return "\n".join(lines) + "\n"


def plot_report(result: dict, out: Path) -> list[Path]:
    """Speed-up by method and category, and the accepted-length histogram of each tree method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    methods = [m for m in summary if m != "hf"]
    categories = sorted({c for s in summary.values() for c in s["speedup_by_category"]})
    fig, ax = plt.subplots(figsize=(max(6, len(categories) * 1.2), 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        xs = [c + i * width for c in range(len(categories))]
        ax.bar(xs, [summary[m]["speedup_by_category"].get(c, 0) for c in categories], width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([c + width * (len(methods) - 1) / 2 for c in range(len(categories))], categories, rotation=30)
    ax.set_ylabel("speed-up vs HF greedy (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [out / "speedup_by_category.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    tree_methods = [m for m in methods if summary[m]["mean_accepted_length"]]
    if tree_methods:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in tree_methods:
            lengths = [a for r in result["rows"] if r["method"] == m for a in r["accepted_lengths"]]
            ax.hist(lengths, bins=range(1, max(lengths) + 2), alpha=0.5, label=m, align="left")
        ax.set_xlabel("tokens accepted per step (bonus token included)")
        ax.set_ylabel("steps")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(out / "accepted_lengths.png")
        fig.savefig(paths[1], dpi=120)
        plt.close(fig)
    return paths


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(markdown(result))
    plot_report(result, out)
