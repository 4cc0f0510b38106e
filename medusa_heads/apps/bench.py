"""`medusa-heads bench`: methods side by side on the same prompts, interleaved in one process.

Every method decodes every prompt `repeats` times, in rotating order, after a warm-up; the speed-up of a
method is the median over prompts of its tokens/s divided by HF greedy's on the same prompt. Peak memory is
what a method needs beyond the backbone and heads, which every method shares: its run's peak (`PeakMemory`)
plus its draft model's weights. HF methods run the backbone's stock `nn.Linear` layers, as `generate` runs for
its users; this runtime runs them packed for oneDNN (`medusa_heads/packing.py`), as `from_pretrained` loads them.
"""

import contextlib
import importlib.metadata
import json
import platform
import statistics
import sys
import time
import unittest.mock
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from medusa_heads.backbone import EMBEDDED_GGUF, _embedded_gguf_folder, load_backbone, weight_bytes
from medusa_heads.device import cpu_features, device_name
from medusa_heads.errors import MedusaError, read_jsonl
from medusa_heads.fast_llama import FAST_FORWARD
from medusa_heads.inference import GenerationStats, generate_ids, make_acceptance, make_drafter, warm_up
from medusa_heads.inference.generate import encode_prompt, eos_token_ids
from medusa_heads.inference.registry import ACCEPTANCE_RULES, DRAFTERS, INT_OPTIONS, check_drafter_options
from medusa_heads.model import MedusaModel, load_heads
from medusa_heads.packing import PackedLinear, pack_linears, stock_linears
from medusa_heads.quantize import draft_weights_quantization, quantization_of, quantize_draft_weights

from .memory import PeakMemory


@dataclass
class Run:
    token_ids: list[int]
    seconds: float
    stats: GenerationStats | None = None
    tree_nodes: int | None = None  # the drafter's largest tree
    weight_bytes: int = 0  # weights the method needs beyond the backbone and heads (a draft model)
    peak_bytes: int | None = None  # PeakMemory of the run: its working memory


MB = 2**20


class DraftModels:
    """Draft models by path, loaded once like the backbone, shared by the methods that name the same one."""

    def __init__(self):
        self.loaded = {}

    def get(self, path: str, model):
        if path not in self.loaded:
            self.loaded[path] = load_backbone(path, dtype=model.backbone.dtype, device=model.device)
        return self.loaded[path]


def hf_method(prompt_lookup: int | None = None, assistant: str | None = None, drafts: DraftModels | None = None):
    def run(model, input_ids, max_new_tokens):
        kw = {"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}
        if assistant is not None:
            kw["assistant_model"] = drafts.get(assistant, model)
        start = time.perf_counter()
        with stock_linears(model.backbone):
            out = model.backbone.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                          max_new_tokens=max_new_tokens, **kw)
        seconds = time.perf_counter() - start
        extra = weight_bytes(kw["assistant_model"]) if assistant is not None else 0
        return Run(out[0, input_ids.shape[1]:].tolist(), seconds, weight_bytes=extra)
    return run


def hf_sample_method(temperature: float):
    """HF `generate` sampling at `temperature` alone (no top-k or top-p), seeded per run: the sampling baseline."""
    def run(model, input_ids, max_new_tokens):
        torch.manual_seed(0)
        start = time.perf_counter()
        with stock_linears(model.backbone):
            out = model.backbone.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                          temperature=temperature, top_k=0, top_p=1.0,
                                          max_new_tokens=max_new_tokens)
        return Run(out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start)
    return run


LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.36 (or `pip install -e '.[llamacpp]'`; it builds from source)"


def _llama_class():
    try:
        from llama_cpp import Llama
    except ImportError:
        raise MedusaError(f"Method `llama.cpp` needs llama-cpp-python: {LLAMA_CPP_INSTALL}.") from None
    return Llama


def _without_extra_layouts():
    """llama-cpp-python's model defaults, less llama.cpp's extra weight layouts (AMX, repacking): on a CPU with AMX
    its AMX layout crashes the first product (ggml-org/llama.cpp#20824, seen here with 0.3.36 on a Xeon), and
    `Llama` has no argument for them."""
    import llama_cpp.llama_cpp as api

    defaults = api.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p
    return unittest.mock.patch.object(api, "llama_model_default_params", params)


def load_llama(gguf: Path, model):
    """llama.cpp on `gguf` with torch's thread count, for the prompts of `model`'s tokenizer (its vocabulary)."""
    Llama, threads = _llama_class(), torch.get_num_threads()
    with _without_extra_layouts() if "amx_int8" in cpu_features() else contextlib.nullcontext():
        # n_ctx=0: the model's own context length, as HF allows
        llm = Llama(model_path=str(gguf), n_ctx=0, n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = model.backbone.config.vocab_size
    if llm.n_vocab() != vocab:
        raise MedusaError(f"`{gguf}` has {llm.n_vocab()} tokens, the backbone {vocab}: give llama.cpp:GGUF the "
                          "backbone's own GGUF.")
    return llm


def llama_cpp_method(gguf: str | None = None):
    """Greedy decoding by llama.cpp (llama-cpp-python) on `gguf`, by default the embedded model's Q4_1 file (the
    weights the embedded backbone is de-quantized from), fed the same prompt ids and stopped by the same EOS."""
    _llama_class()  # fail now, not after the warm-up
    path = Path(gguf) if gguf else _embedded_gguf_folder() / EMBEDDED_GGUF
    if not path.is_file():
        raise MedusaError(f"Method `llama.cpp:{gguf}`: `{path}` is not a GGUF file.")
    llms = {}

    def run(model, input_ids, max_new_tokens):
        if id(model) not in llms:
            llms[id(model)] = load_llama(path, model)
        llm = llms[id(model)]
        eos = set(eos_token_ids(model, None))
        llm.reset()  # no KV reuse from the last run: it pays for the whole prefill, as the other methods do
        ids = []
        start = time.perf_counter()
        for token in llm.generate(input_ids[0].tolist(), temp=0.0):
            ids.append(token)
            if token in eos or len(ids) == max_new_tokens:
                break
        return Run(ids, time.perf_counter() - start, weight_bytes=path.stat().st_size)
    return run


def drafter_method(name: str, options: dict, drafts: DraftModels, sampling: tuple[str, float] | None = None):
    """Tree decoding with the registry's drafter `name` and `options` (a `draft_model` path is loaded once by
    `drafts`). `sampling`: (acceptance rule, temperature), seeded per run; greedy without it."""
    drafters = {}

    def run(model, input_ids, max_new_tokens):
        draft = drafts.get(options["draft_model"], model) if "draft_model" in options else None
        if id(model) not in drafters:
            drafters[id(model)] = make_drafter(model, name, **{**options, **({"draft_model": draft} if draft else {})})
        drafter = drafters[id(model)]
        # every run: another method's drafter may have tapped the backbone's layers since (EAGLE-3), which takes
        # this one's steps through other graphs; a run that finds them compiled compiles nothing
        acceptance = make_acceptance(*sampling, seed=0, device=model.device) if sampling else None
        warm_up(model, drafter, say=lambda line: print(line, file=sys.stderr, flush=True), acceptance=acceptance)
        stats = GenerationStats()
        eos = eos_token_ids(model, None)
        start = time.perf_counter()
        ids = [t for chunk in generate_ids(model, input_ids, drafter, acceptance, max_new_tokens, eos, None,
                                           stats) for t in chunk]
        return Run(ids, time.perf_counter() - start, stats, drafter.tree.size,
                   weight_bytes(draft) if draft is not None else 0)
    return run


def sampled(method: str) -> bool:
    """Sampled methods (`...@T`) have no single right output: they are not compared with greedy ones."""
    return "@" in method


def _temperature(text: str, method: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise MedusaError(f"Method `{method}` needs a temperature > 0 after `@`, got `{text}`.")
    return value


def _int(text: str, method: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise MedusaError(f"Method `{method}` needs a positive integer where it has `{text}`.")
    return int(text)


def method_syntax(name: str) -> str:
    """`NAME[:FIELD]...` for a registry drafter, e.g. `medusa+ngram[:TREE][:DRAFT_LENGTH]`."""
    spec = DRAFTERS[name]
    return name + "".join(f":{o.upper()}" if o in spec.required else f"[:{o.upper()}]" for o in spec.options)


HF_METHODS = "hf, hf-sample@T, hf-lookup[:N], hf-assisted:PATH, llama.cpp[:GGUF]"
SAMPLING_RULES = " or ".join(f"{rule}@T" for rule in ACCEPTANCE_RULES if rule != "greedy")


def parse_drafter_method(method: str) -> tuple[str, dict, tuple[str, float] | None]:
    """`NAME[:FIELD...][:RULE@T]` -> (drafter name, options, (rule, temperature) or None for greedy). The fields
    are the drafter's options in the registry's order, e.g. `medusa+ngram:cpu-16:10` or `early-exit:6:4`."""
    name, *fields = method.split(":")
    sampling = None
    if fields and "@" in fields[-1]:
        rule, _, temperature = fields.pop().partition("@")
        if rule not in ACCEPTANCE_RULES or rule == "greedy":
            raise MedusaError(f"Method `{method}` samples with {SAMPLING_RULES}, not `{rule}@`.")
        sampling = (rule, _temperature(temperature, method))
    spec = DRAFTERS[name]
    if len(fields) > len(spec.options):
        raise MedusaError(f"Method `{method}` has too many fields: it takes {method_syntax(name)}.")
    options = {key: _int(value, method) if key in INT_OPTIONS else value
               for key, value in zip(spec.options, fields) if value}
    missing = [key for key in spec.required if key not in options]
    if missing:
        raise MedusaError(f"Method `{method}` needs {missing[0].upper()}: {method_syntax(name)}.")
    check_drafter_options(name, **options)  # fail now (e.g. on a bad tree), not after the warm-up
    return name, options, sampling


def _make_method(name: str, drafts: DraftModels):
    kind, _, spec = name.partition(":")
    if name == "hf":
        return hf_method()
    elif name.startswith("hf-sample@"):
        return hf_sample_method(_temperature(name.split("@", 1)[1], name))
    elif name.startswith("hf-lookup"):
        return hf_method(_int(spec, name) if spec else 10)
    elif kind == "hf-assisted":
        if not spec:
            raise MedusaError(f"Method `{name}` needs a draft model: `{kind}:PATH`.")
        return hf_method(assistant=spec, drafts=drafts)
    elif kind == "llama.cpp":
        return llama_cpp_method(spec or None)
    elif kind in DRAFTERS:
        drafter, options, sampling = parse_drafter_method(name)
        return drafter_method(drafter, options, drafts, sampling)
    raise MedusaError(f"Unknown method `{name}`; use {HF_METHODS}, or a drafter: "
                      f"{', '.join(method_syntax(n) for n in DRAFTERS)}, each optionally followed by "
                      f":{SAMPLING_RULES}.")


def with_heads(method, heads_path: str):
    """The same method decoding with other heads on the same backbone (loaded once), for heads side by side."""
    models = {}

    def run(model, input_ids, max_new_tokens):
        if id(model) not in models:
            heads = load_heads(heads_path, dtype=model.backbone.dtype).to(model.device)
            if heads.config.base_model_adapter:
                raise MedusaError(f"`{heads_path}` comes with a LoRA adapter; bench it as the main `--heads`.")
            other = MedusaModel(model.backbone, heads)
            quantize_draft_weights(other, draft_weights_quantization(model))  # as the main heads
            if any(isinstance(m, PackedLinear) for m in model.backbone.modules()):
                # as `from_pretrained` packs the main model: the heads and their draft-vocabulary projection (the
                # backbone's linears are packed already), else these would draft slower
                heads.requires_grad_(False)
                pack_linears(other)
            models[id(model)] = other
        return method(models[id(model)], input_ids, max_new_tokens)
    return run


def make_methods(names: list[str], heads: dict[str, str] | None = None) -> dict:
    """Methods by name; `NAME#LABEL` decodes with the heads `heads[LABEL]` instead of the model's own."""
    heads = heads or {}
    methods = {}
    drafts = DraftModels()
    for name in names:
        base, _, label = name.partition("#")
        if label and label not in heads:
            raise MedusaError(f"Method `{name}` names heads `{label}`, but no `--alt-heads {label}=PATH` was given.")
        method = _make_method(base, drafts)
        methods[name] = with_heads(method, heads[label]) if label else method
    if "hf" not in methods:
        methods = {"hf": hf_method(), **methods}  # the baseline every ratio is against
    return methods


def read_bench_prompts(path: Path, limit: int | None = None, per_category: int | None = None) -> list[dict]:
    rows = [{"id": str(row.get("id", n)), "category": row.get("category", "all"), "prompt": row["prompt"]}
            for n, row in read_jsonl(path, "Prompt file", "prompt", str)]
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


def fingerprint(model, methods: list[str]) -> dict:
    llama_cpp = any(name.startswith("llama.cpp") for name in methods)
    return {"cpu": device_name(torch.device("cpu")), "cpu_features": cpu_features(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "dtype": str(model.backbone.dtype), "device": str(model.device),
            "quantize": quantization_of(model.backbone), "quantize_drafter": draft_weights_quantization(model),
            "forward": type(getattr(model.backbone, FAST_FORWARD, model.backbone)).__name__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "llama_cpp": importlib.metadata.version("llama-cpp-python") if llama_cpp else None}


def bench(model, tokenizer, prompts: list[dict], method_names: list[str], max_new_tokens: int = 128,
          repeats: int = 1, fp32_backbone=None, alt_heads: dict[str, str] | None = None) -> dict:
    """`fp32_backbone`: when the model runs in lower precision, the fp32 greedy outputs to compare against
    (greedy exactness is an fp32 property; bf16 rounding alone changes greedy outputs). `alt_heads`: label ->
    heads folder, for methods named `METHOD#LABEL`."""
    started = time.perf_counter()
    methods = make_methods(method_names, alt_heads)
    encoded = [encode_prompt(tokenizer, p["prompt"]).to(model.device) for p in prompts]
    fp32_outputs = None
    if fp32_backbone is not None:
        fp32_outputs = [fp32_backbone.generate(ids.to(fp32_backbone.device), do_sample=False,
                                               attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens
                                               )[0, ids.shape[1]:].tolist()
                        for ids in tqdm(encoded, desc="fp32 reference", unit="prompt")]
    for _ in range(2):  # warm-up, twice: a drafter that taps the backbone's layers (EAGLE-3) changes the others' step
        for run in methods.values():
            run(model, encoded[0], 16)
    rows = []
    order = list(methods)
    for i, (p, ids) in enumerate(tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt")):
        runs = defaultdict(list)
        for r in range(repeats):
            rotation = order[(i + r) % len(order):] + order[: (i + r) % len(order)]
            for name in rotation:
                with PeakMemory(model.device) as peak:
                    run = methods[name](model, ids, max_new_tokens)
                run.peak_bytes = peak.bytes
                runs[name].append(run)
        base = runs["hf"][0].token_ids
        for name, rs in runs.items():
            tps = [len(x.token_ids) / x.seconds for x in rs]
            stats = rs[0].stats
            rows.append({"prompt": p["id"], "category": p["category"], "method": name,
                         "tokens": len(rs[0].token_ids), "tokens_per_second": statistics.median(tps),
                         "identical_to_hf": rs[0].token_ids == base if not sampled(name) else None,
                         "identical_to_fp32": (rs[0].token_ids == fp32_outputs[i]
                                               if fp32_outputs and not sampled(name) else None),
                         "accepted_lengths": stats.accepted_lengths if stats else None,
                         "head_acceptance": stats.head_acceptance if stats else None,
                         "depth_accepts": stats.depth_accepts if stats else None,
                         "rank_accepts": stats.rank_accepts if stats else None,
                         "first_rejections": stats.first_rejections if stats else None,
                         "steps": stats.steps if stats else None,
                         "step_ms": stats.step_ms if stats else None,
                         "tree_nodes": rs[0].tree_nodes, "weights_mb": rs[0].weight_bytes / MB,
                         "peak_memory_mb": (max(x.peak_bytes + x.weight_bytes for x in rs) / MB
                                            if rs[0].peak_bytes is not None else None)})
    return {"fingerprint": fingerprint(model, method_names), "max_new_tokens": max_new_tokens, "repeats": repeats,
            "prompts": len(prompts), "wall_seconds": time.perf_counter() - started,
            "peak_memory": f"the largest over a method's runs of {PeakMemory.measures(model.device)}, plus the "
                           "weights of its draft model if it has one",
            "rows": rows, "summary": summarize(rows)}


def _add(lists) -> list:
    """Element-wise sum of lists of any lengths."""
    total = []
    for values in lists:
        total.extend([0] * (len(values) - len(total)))
        for i, x in enumerate(values):
            total[i] += x
    return total


def acceptance_detail(rows: list[dict]) -> dict:
    """One method's steps over all its prompts: acceptance by depth given the parent was accepted and had children
    drafted, accepted ranks (a dynamic tree's are per-parent child order) as shares of steps, and the first-rejection
    histogram by depth (with the steps that reached a leaf)."""
    rows = [r for r in rows if r.get("depth_accepts") is not None]
    if not rows:
        return {"depth_acceptance": None, "rank_acceptance": None, "first_rejections": None,
                "steps_without_rejection": None}
    steps = sum(len(r["accepted_lengths"]) for r in rows)
    accepts, rejections = _add(r["depth_accepts"] for r in rows), _add(r["first_rejections"] for r in rows)
    ranks = [_add(r["rank_accepts"][d] for r in rows if d < len(r["rank_accepts"])) for d in range(len(accepts))]
    return {"depth_acceptance": [a / (a + j) if a + j else None for a, j in zip(accepts, rejections)],
            "rank_acceptance": [[n / steps for n in row] for row in ranks],
            "first_rejections": rejections, "steps_without_rejection": steps - sum(rejections)}


def acceptance_table(summary: dict, ranks: int = 4) -> list[str]:
    """Markdown lines: per tree method, acceptance by depth, the first-rejection histogram, accepted ranks."""
    names = [name for name, s in summary.items() if s.get("depth_acceptance") is not None]
    if not names:
        return []
    lines = ["", "Acceptance by depth given the parent was accepted, where the accepted path was first rejected "
             f"(share of steps), and the accepted node's rank at each depth (share of steps, ranks 0-{ranks - 1}):",
             "", "| method | acceptance by depth | first rejection at depth 1, 2, ...; none | accepted rank by depth |",
             "|---|---|---|---|"]
    for name in names:
        s = summary[name]
        steps = sum(s["first_rejections"]) + s["steps_without_rejection"]
        by_depth = ", ".join("-" if a is None else f"{a:.2f}" for a in s["depth_acceptance"])
        rejected = ", ".join(f"{n / max(steps, 1):.2f}" for n in s["first_rejections"])
        rank = "; ".join(f"{d + 1}: " + " ".join(f"{x:.2f}" for x in row[:ranks])
                         for d, row in enumerate(s["rank_acceptance"]) if row)
        lines.append(f"| {name} | {by_depth} | {rejected}; {s['steps_without_rejection'] / max(steps, 1):.2f} | "
                     f"{rank} |")
    return lines


def summarize(rows: list[dict]) -> dict:
    base = {r["prompt"]: r["tokens_per_second"] for r in rows if r["method"] == "hf"}
    summary = {}
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == name]
        ratios = [r["tokens_per_second"] / base[r["prompt"]] for r in mine]
        lengths = [a for r in mine for a in (r["accepted_lengths"] or [])]
        depth = max(len(r.get("head_acceptance") or []) for r in mine)
        memory = [r["peak_memory_mb"] for r in mine if r.get("peak_memory_mb") is not None]
        by_cat = defaultdict(list)
        for r, ratio in zip(mine, ratios):
            by_cat[r["category"]].append(ratio)
        summary[name] = {
            "tokens_per_second": statistics.median(r["tokens_per_second"] for r in mine),
            "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios),
            "mean_accepted_length": sum(lengths) / len(lengths) if lengths else None,
            "identical_outputs": (sum(r["identical_to_hf"] for r in mine)
                                  if mine[0]["identical_to_hf"] is not None else None), "prompts": len(mine),
            "identical_to_fp32": (sum(r["identical_to_fp32"] for r in mine)
                                  if mine[0]["identical_to_fp32"] is not None else None),
            "speedup_by_category": {c: statistics.median(v) for c, v in by_cat.items()},
            **acceptance_detail(mine),
            "tree_nodes": mine[0].get("tree_nodes"),
            # share of steps whose accepted path reached depth d + 1 (a step committing n tokens reached n - 1)
            "acceptance_by_depth": ([sum(a > d + 1 for a in lengths) / len(lengths) for d in range(depth)]
                                    if lengths else None),
            "peak_memory_mb": max(memory) if memory else None,
            "step_ms": _step_ms(mine),
        }
    return summary


def _step_ms(rows: list[dict]) -> dict[str, float] | None:
    """Where a method's decoding steps went, in ms per step over all its prompts (`GenerationStats.step_ms`)."""
    timed = [r for r in rows if r.get("step_ms")]
    steps = sum(r["steps"] for r in timed)
    if not steps:
        return None
    return {phase: sum(r["step_ms"][phase] * r["steps"] for r in timed) / steps for phase in timed[0]["step_ms"]}


def step_table(summary: dict) -> list[str]:
    """Markdown: per tree method, the time of a step and where it goes."""
    lines = ["| method | ms per step | drafting | verification (forward + acceptance) | other (cache, loop) |",
             "|---|---|---|---|---|"]
    for name, s in summary.items():
        ms = s.get("step_ms")
        if ms:
            lines.append(f"| {name} | {sum(ms.values()):.1f} | {ms['draft']:.1f} | {ms['verify']:.1f} | "
                         f"{ms['other']:.1f} |")
    return lines if len(lines) > 2 else []


def _share(count: int | None, total: int) -> str:
    return "-" if count is None else f"{count}/{total}"


def markdown(result: dict) -> str:
    summary = result["summary"]
    fp32 = next(iter(summary.values()))["identical_to_fp32"] is not None
    lines = ["| method | tokens/s (median) | speed-up vs HF greedy (median, min-max) | mean accepted length | "
             "identical to HF greedy |" + (" identical to fp32 greedy |" if fp32 else "") + " peak memory (MB) |",
             "|---|---|---|---|---|---|" + ("---|" if fp32 else "")]
    for name, s in summary.items():
        mal = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] else "-"
        memory = s.get("peak_memory_mb")
        lines.append(f"| {name} | {s['tokens_per_second']:.1f} | {s['speedup_median']:.2f}x "
                     f"({s['speedup_min']:.2f}-{s['speedup_max']:.2f}) | {mal} | "
                     f"{_share(s['identical_outputs'], s['prompts'])} |"
                     + (f" {_share(s['identical_to_fp32'], s['prompts'])} |" if fp32 else "")
                     + (f" {memory:.0f} |" if memory is not None else " - |"))
    fp = result["fingerprint"]
    weights = f", {fp['quantize']} weights" if fp.get("quantize", "none") != "none" else ""
    if fp.get("quantize_drafter", "none") != "none":
        weights += f", {fp['quantize_drafter']} drafter weights"
    features = f"; {', '.join(fp['cpu_features'])}" if fp.get("cpu_features") else ""
    lines.append(f"\n{fp['dtype']}{weights} on {fp['device']} ({fp['cpu']}{features}, {fp['threads']} threads), "
                 f"torch {fp['torch']}, transformers {fp['transformers']}"
                 + (f", llama-cpp-python {fp['llama_cpp']}" if fp.get("llama_cpp") else "")
                 + f", {result['max_new_tokens']} new tokens, "
                 f"{result['repeats']} repeat(s)"
                 + (f", {result['prompts']} prompts in {result['wall_seconds'] / 60:.1f} min (warm-up and "
                    "references included)." if "wall_seconds" in result else "."))
    if "peak_memory" in result:
        lines.append(f"Peak memory: {result['peak_memory']}.")
    depths = {name: s["acceptance_by_depth"] for name, s in summary.items() if s.get("acceptance_by_depth")}
    if depths:
        deepest = max(len(a) for a in depths.values())
        lines += ["", "Share of steps whose accepted path reached each depth:", "",
                  "| method | tree nodes | " + " | ".join(f"depth {d + 1}" for d in range(deepest)) + " |",
                  "|---|---|" + "---|" * deepest]
        for name, shares in depths.items():
            cells = [f"{a:.2f}" for a in shares] + [""] * (deepest - len(shares))
            lines.append(f"| {name} | {summary[name]['tree_nodes']} | " + " | ".join(cells) + " |")
    lines += acceptance_table(summary)
    steps = step_table(summary)
    if steps:
        lines += ["", "Where a decoding step goes (host clock; on a GPU, queued work counts where it is waited for):",
                  ""] + steps
    return "\n".join(lines) + "\n"


def plot_report(result: dict, out: Path) -> list[Path]:
    """Speed-up by method and category, the accepted-length histogram of each tree method, and the speed-up of
    the Medusa methods against their tree's size."""
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
    paths = [_save(fig, ax, out / "speedup_by_category.png")]
    tree_methods = [m for m in methods if summary[m]["mean_accepted_length"]]
    if tree_methods:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in tree_methods:
            lengths = [a for r in result["rows"] if r["method"] == m for a in r["accepted_lengths"]]
            ax.hist(lengths, bins=range(1, max(lengths) + 2), alpha=0.5, label=m, align="left")
        ax.set_xlabel("tokens accepted per step (bonus token included)")
        ax.set_ylabel("steps")
        paths.append(_save(fig, ax, out / "accepted_lengths.png"))
    timed = [m for m in methods if summary[m].get("step_ms")]
    if timed:
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(timed) + 1.5))
        left = [0.0] * len(timed)
        for phase in ("draft", "verify", "other"):
            widths = [summary[m]["step_ms"][phase] for m in timed]
            ax.barh(timed, widths, left=left, label=phase)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_xlabel("ms per decoding step")
        paths.append(_save(fig, ax, out / "step_time.png"))
    families = tree_families(summary)
    if families:
        fig, ax = plt.subplots(figsize=(6, 4))
        for family, trees in families.items():
            points = sorted((summary[m]["tree_nodes"], summary[m]["speedup_median"], tree) for tree, m in trees)
            ax.plot([x for x, _, _ in points], [y for _, y, _ in points], marker="o", label=family)
            for x, y, tree in points:
                ax.annotate(tree, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("tree nodes (root included)")
        ax.set_ylabel("speed-up vs HF greedy (median)")
        paths.append(_save(fig, ax, out / "speedup_vs_tree_size.png"))
    return paths


def _save(fig, ax, path: Path) -> Path:
    """Legend, layout, the PNG, and the figure closed."""
    import matplotlib.pyplot as plt

    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def tree_families(summary: dict) -> dict[str, list[tuple[str, str]]]:
    """Methods of drafters on a static tree grouped by everything in their name but the tree:
    {"medusa": [("cpu-8", "medusa:cpu-8")]}."""
    families = defaultdict(list)
    for name in summary:
        base, hashed, label = name.partition("#")  # other heads make another family
        kind, *rest = base.split(":")
        takes_tree = kind in DRAFTERS and DRAFTERS[kind].options[:1] == ("tree",)
        if takes_tree and rest and summary[name].get("tree_nodes"):
            families[":".join([kind] + rest[1:]) + hashed + label].append((rest[0], name))
    return dict(families)


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    (out / "bench.md").write_text(markdown(result))
    plot_report(result, out)
