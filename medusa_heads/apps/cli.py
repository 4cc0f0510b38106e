"""`medusa-heads`: generate with tree decoding, benchmark, fit trees, make self-distillation data."""

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError

from medusa_heads.backbone import first_line
from medusa_heads.errors import MedusaError
from medusa_heads.inference.registry import ACCEPTANCE_RULES, DEFAULT_TREE, DRAFTERS, drafters_taking
from medusa_heads.quantize import QUANTIZATIONS

from .bench import method_syntax


QUANTIZE_HELP = ("int8 or int4: the backbone's decoder computes with int8 weights, or 4-bit ones in groups of 32 "
                 "(bf16 activations) (CPU only; docs/benchmarks.md)")
QUANTIZE_DRAFTER_HELP = ("int8 or int4: the drafter's own weights (its layers, its draft-vocabulary projection) "
                         "quantized as --quantize does the backbone's; lossless, as the backbone still verifies every "
                         "token (CPU only)")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="float32", help="float32 (exact greedy), bfloat16, float16 or auto (bfloat16 "
                   "where the device computes in it natively, else float32)")
    p.add_argument("--threads", type=int, help="CPU threads for torch (default: all cores)")


COMPILE_CHOICES = ("auto", "on", "off")


def _add_compile_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compile", choices=COMPILE_CHOICES, default=os.environ.get("MEDUSA_HEADS_COMPILE", "auto"),
                   help="decode a Llama-family backbone through the compiled step (about 40 s a step size the first "
                   "time, then cached on disk); auto: on a CPU computing in bf16 (default: auto, or the "
                   "MEDUSA_HEADS_COMPILE environment variable)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medusa-heads", description="Medusa multi-head speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one prompt (or a file of them) with tree decoding; print statistics")
    what = g.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt")
    what.add_argument("--prompts-file", type=Path, help="jsonl with a `prompt` per line: answered in batches of "
                      "--batch-size, one JSON object per answer on stdout, in the file's order")
    g.add_argument("--batch-size", type=int, default=8, help="--prompts-file: prompts decoded together")
    g.add_argument("--model", help="backbone hub id or folder (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--heads", help="heads folder or hub id (default: the heads shipped for the model)")
    g.add_argument("--tree", help=f"{', '.join(drafters_taking('tree'))}: a shipped tree name or a JSON file "
                   f"(default {DEFAULT_TREE})")
    g.add_argument("--drafter", choices=list(DRAFTERS),
                   help="default: the configuration `medusa-heads tune` found fastest on this machine for the dtype, "
                   "else the project's table (bf16: medusa+ngram on hydra-cpu-6, fp32: medusa+ngram on cpu-3); "
                   + "; ".join(f"{name}: {spec.help}" for name, spec in DRAFTERS.items()))
    g.add_argument("--draft-model", help=f"{', '.join(drafters_taking('draft_model'))}: a small LM with the "
                   "backbone's tokenizer (hub id or folder)")
    g.add_argument("--draft-length", type=int, help=f"{', '.join(drafters_taking('draft_length'))}: tokens per "
                   "chain (default: 6 for the n-gram chains, 4 for the others)")
    g.add_argument("--exit-layer", type=int, help=f"{', '.join(drafters_taking('exit_layer'))}: draft with the "
                   "backbone's first N layers")
    g.add_argument("--budget", type=int, help=f"{', '.join(drafters_taking('budget'))}: drafted nodes per step "
                   "(dynamic: default 16; adaptive: the most it may choose, default 32)")
    g.add_argument("--depth", type=int, help=f"{', '.join(drafters_taking('depth'))}: the deepest the tree grows "
                   "(default: the number of heads, which Medusa and Hydra heads cannot exceed; an EAGLE drafter "
                   "may go deeper than it was trained)")
    g.add_argument("--stats", action="store_true", help="also print acceptance by depth and rank, the accepted-length "
                   "histogram and where paths were first rejected")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--acceptance", choices=list(ACCEPTANCE_RULES), default="greedy",
                   help="; ".join(f"{name}: {rule.help}" for name, rule in ACCEPTANCE_RULES.items()))
    g.add_argument("--temperature", type=float, default=0.0,
                   help="exact and typical acceptance: sampling temperature (typical: default 0.7)")
    g.add_argument("--epsilon", type=float, default=0.09, help="typical acceptance: hard threshold")
    g.add_argument("--delta", type=float, default=0.3, help="typical acceptance: entropy-scaled threshold")
    g.add_argument("--top-k", type=int, default=0, help="exact acceptance: sample from the K likeliest tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="exact acceptance: nucleus sampling mass (1: all)")
    g.add_argument("--seed", type=int, help="seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument("--quantize", choices=QUANTIZATIONS, default="none", help=QUANTIZE_HELP)
    g.add_argument("--quantize-drafter", choices=QUANTIZATIONS,
                   help=QUANTIZE_DRAFTER_HELP + " (default: none, or the tuned configuration's)")
    _add_runtime_args(g)
    _add_compile_arg(g)
    g.set_defaults(dtype="auto")

    d = sub.add_parser("distill", help="let the backbone answer prompts itself (resumable)")
    d.add_argument("--prompts", type=Path, required=True, help="jsonl with a `prompt` field per line")
    d.add_argument("--out", type=Path, required=True, help="jsonl to append answers to")
    d.add_argument("--model", default=None, help="backbone (default: the embedded SmolLM2-135M-Instruct)")
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=256)
    d.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers; above: sampled ones")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling when --temperature > 0")
    d.add_argument("--limit", type=int, help="answer only the first N prompts")
    d.add_argument("--seed", type=int, default=0)
    _add_runtime_args(d)
    d.set_defaults(dtype="auto")  # batched generation: bf16 where native (emulated bf16 is several times slower)
    si = sub.add_parser("self-instruct", help="let the backbone write new prompts, continuing lists of the shipped "
                        "ones; near copies and any overlap with --exclude are dropped (resumable)")
    si.add_argument("--out", type=Path, required=True, help="jsonl of prompts to append to")
    si.add_argument("--count", type=int, required=True, help="stop when --out holds this many prompts")
    si.add_argument("--exclude", type=Path, help="prompts (jsonl) that no new prompt may share 4 words in a row with, "
                    "e.g. benchmarks/prompts.jsonl")
    si.add_argument("--model", default=None, help="backbone (default: the embedded SmolLM2-135M-Instruct)")
    si.add_argument("--batch-size", type=int, default=32)
    si.add_argument("--temperature", type=float, default=1.0)
    si.add_argument("--seed", type=int, default=0)
    _add_runtime_args(si)
    si.set_defaults(dtype="auto")
    fu = sub.add_parser("follow-ups", help="two-turn conversations from distilled answers, ending in a follow-up "
                        "request, for `distill` to answer")
    fu.add_argument("answers", type=Path, help="a `distill` output")
    fu.add_argument("--out", type=Path, required=True)
    fu.add_argument("--share", type=float, default=1.0, help="share of the answers to continue")
    fu.add_argument("--seed", type=int, default=0)
    ns = sub.add_parser("ngram-store", help="count the backbone's frequent continuations in answers, for the "
                        "medusa+ngram+store drafter; saved into the heads folder")
    ns.add_argument("data", help="the backbone's own answers (a `distill` jsonl) or other training data: a "
                    "jsonl/json/parquet file or folder, or a hub dataset; assistant turns are counted")
    ns.add_argument("--heads", type=Path, required=True, help="heads folder to write ngram_store.safetensors into")
    ns.add_argument("--model", help="backbone whose tokenizer to use (default: the one the heads name)")
    ns.add_argument("--max-n", type=int, default=4, help="longest context, in tokens")
    ns.add_argument("--min-count", type=int, default=2, help="keep a context seen at least this often")
    ns.add_argument("--max-length", type=int, default=4096, help="truncate conversations to this many tokens")
    b = sub.add_parser("bench", help="speed and acceptance of several methods side by side")
    b.add_argument("--prompts", type=Path, required=True, help="jsonl with `prompt` (and `category`) per line")
    b.add_argument("--methods", default="hf,hf-lookup,medusa:cpu-16,medusa+ngram:cpu-16",
                   help="comma-separated, each compared with HF greedy: the HF peers (hf, hf-sample@T, hf-lookup[:N], "
                   "hf-assisted:PATH), llama.cpp[:GGUF] (llama-cpp-python greedy on the embedded model's Q4_1 "
                   "GGUF or on GGUF) and the drafters, NAME[:OPTION...] with the options of `generate` in this "
                   "order: " + ", ".join(method_syntax(n) for n in DRAFTERS) + "; a drafter samples with a last "
                   "field exact@T or typical@T; METHOD#LABEL uses the heads of --alt-heads LABEL=PATH")
    b.add_argument("--model", help="backbone (default: the embedded SmolLM2-135M-Instruct)")
    b.add_argument("--heads", help="heads folder (default: the heads shipped for the model)")
    b.add_argument("--alt-heads", action="append", default=[], metavar="LABEL=PATH",
                   help="other heads on the same backbone, used by methods named METHOD#LABEL (repeatable)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--limit", type=int, help="only the first N prompts")
    b.add_argument("--per-category", type=int, help="only the first N prompts of each category")
    b.add_argument("--out", type=Path, default=Path("bench-out"))
    b.add_argument("--no-fp32-reference", action="store_true",
                   help="in bf16/fp16, skip comparing outputs with fp32 greedy")
    b.add_argument("--quantize", choices=QUANTIZATIONS, default="none", help=QUANTIZE_HELP + "; every method, the "
                   "HF ones and the fp32 reference included, runs the same quantized backbone")
    b.add_argument("--quantize-drafter", choices=QUANTIZATIONS, default="none", help=QUANTIZE_DRAFTER_HELP + "; "
                   "--alt-heads too")
    _add_runtime_args(b)
    _add_compile_arg(b)
    e = sub.add_parser("export", help="write Medusa heads or an EAGLE or EAGLE-3 drafter in the layout a serving "
                       "engine reads")
    e.add_argument("--format", required=True, choices=["vllm", "medusa", "trtllm", "speculators"],
                   help="vllm: vLLM's Medusa layout (draft vocabulary as token_map), or for an EAGLE drafter its "
                   "eagle method's; medusa: the original Medusa project's layout; trtllm: the original layout plus "
                   "the tree as medusa_choices, what TensorRT-LLM's Medusa converter reads; speculators (or vllm): "
                   "an EAGLE-3 drafter as vLLM's eagle3 method reads it")
    e.add_argument("heads", help="heads folder (plain Medusa heads, an EAGLE drafter for vllm, an EAGLE-3 drafter for "
                   "speculators or vllm)")
    e.add_argument("out", type=Path, help="folder to write")
    e.add_argument("--tree", default=DEFAULT_TREE, help="trtllm: the tree written as medusa_choices")
    e.add_argument("--model", help="backbone whose LM head shared heads use (default: the one the heads name)")
    c = sub.add_parser("convert", help="read heads saved by the original Medusa project (v0.1 or v1.0) into this "
                       "project's format")
    c.add_argument("original", type=Path, help="folder in the original layout: heads alone or inside a whole model")
    c.add_argument("out", type=Path, help="folder to write")
    _add_tree_commands(sub)
    _add_serve_command(sub)
    tu = sub.add_parser("tune", help="time the shipped lossless configurations on this machine (a minute or two) and "
                        "record the fastest: what `generate` and `serve` then run at batch 1 when given no drafter")
    tu.add_argument("--max-new-tokens", type=int, default=96, help="tokens per timed answer")
    tu.add_argument("--seconds", type=float, default=120, help="time no more prompts once this is spent (the "
                    "loading and warm-up not counted)")
    _add_runtime_args(tu)
    _add_compile_arg(tu)
    tu.set_defaults(dtype="auto")
    return parser


def _add_tree_commands(sub) -> None:
    """`profile` and `tree optimize`: trees fitted to the heads and the hardware."""
    pr = sub.add_parser("profile", help="time one decoding step per tree size on this device (cached)")
    pr.add_argument("--model", help="backbone (default: the embedded SmolLM2-135M-Instruct)")
    pr.add_argument("--heads", help="heads folder (default: the heads shipped for the model)")
    pr.add_argument("--max-nodes", type=int, default=64, help="largest tree to time, the root included")
    pr.add_argument("--contexts", default="128,512", help="context lengths to time at, comma-separated")
    pr.add_argument("--repeats", type=int, default=10)
    pr.add_argument("--refresh", action="store_true", help="measure again even if a cached profile covers the sizes")
    _add_runtime_args(pr)

    tree = sub.add_parser("tree", help="fit trees to the heads and the hardware")
    tree_sub = tree.add_subparsers(dest="tree_command", required=True)
    opt = tree_sub.add_parser("optimize", help="the tree of the best expected tokens per step time")
    opt.add_argument("--calibration", type=Path, required=True,
                     help="jsonl of the backbone's own answers (calibrates on it; never the benchmark prompts), "
                          "or a JSON of calibration counts: a tree this command wrote reuses its own, and a "
                          "trainer's head_accuracies.json holds its held-out counts")
    opt.add_argument("--rows", help="START:END, the jsonl rows to calibrate on (default: all)")
    opt.add_argument("--top-k", type=int, default=10, help="ranks per head to calibrate")
    opt.add_argument("--max-nodes", type=int, default=64, help="largest tree to consider, the root included")
    opt.add_argument("--budget", type=int,
                     help="fit a tree of exactly this many nodes (the root included) instead of choosing")
    opt.add_argument("--profile", type=Path,
                     help="latency profile JSON (default: this device's cached one, measured when missing)")
    opt.add_argument("--out", type=Path, required=True, help="tree JSON to write (usable as --tree)")
    opt.add_argument("--model", help="backbone (default: the embedded SmolLM2-135M-Instruct)")
    opt.add_argument("--heads", help="heads folder (default: the heads shipped for the model)")
    _add_runtime_args(opt)


def _add_serve_command(sub) -> None:
    """`serve`: an OpenAI-compatible HTTP server (docs/serving.md)."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with Prometheus metrics (docs/serving.md)")
    s.add_argument("--model", help="backbone hub id or folder (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--heads", help="heads folder or hub id (default: the heads shipped for the model)")
    s.add_argument("--drafter", choices=list(DRAFTERS),
                   help="as for generate, with its default: a request alone gets generate's answer; `dynamic --budget "
                   "0` drafts nothing (plain decoding)")
    s.add_argument("--tree", help="as for generate")
    s.add_argument("--draft-model", help="as for generate")
    s.add_argument("--draft-length", type=int, help="as for generate")
    s.add_argument("--exit-layer", type=int, help="as for generate")
    s.add_argument("--quantize-drafter", choices=QUANTIZATIONS, help="as for generate")
    s.add_argument("--budget", type=int, help="as for generate")
    s.add_argument("--depth", type=int, help="as for generate")
    s.add_argument("--acceptance", choices=["exact", "typical"], default="exact",
                   help="the rule for requests with temperature > 0 (temperature 0 is greedy; a request without "
                   "`temperature` samples at 1.0, OpenAI's default): exact (lossless, the default) or typical "
                   "(faster, lossy)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="0-65535; 0: any free port (printed at start)")
    s.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get 503")
    s.add_argument("--max-batch", type=int, default=8, help="queued requests decoded together at most; large "
                   "batches draft nothing (docs/serving.md)")
    _add_runtime_args(s)
    _add_compile_arg(s)
    s.set_defaults(dtype="auto")  # generate's: the same answer from both


def _bench(args) -> None:
    import torch

    from medusa_heads.backbone import load_backbone
    from medusa_heads.model import MedusaModel
    from medusa_heads.quantize import quantize_backbone

    from .bench import bench, markdown, read_bench_prompts, write_report

    prompts = read_bench_prompts(args.prompts, args.limit, args.per_category)
    if any("=" not in pair for pair in args.alt_heads):
        raise MedusaError("`--alt-heads` takes LABEL=PATH.")
    alt_heads = dict(pair.split("=", 1) for pair in args.alt_heads)
    model = MedusaModel.from_pretrained(args.heads, base_model=args.model, dtype=args.dtype, device=args.device,
                                        quantize=args.quantize, quantize_drafter=args.quantize_drafter,
                                        compile_step=_compile_step(args))
    tokenizer = _tokenizer(args, model)
    fp32 = None
    if model.backbone.dtype != torch.float32 and not args.no_fp32_reference:
        fp32 = load_backbone(_backbone_name(args, model), gguf_file=_gguf_file(args, model), dtype=torch.float32,
                             device=args.device)
        quantize_backbone(fp32, args.quantize)
    result = bench(model, tokenizer, prompts, args.methods.split(","), args.max_new_tokens, args.repeats, fp32,
                   alt_heads)
    write_report(result, args.out)
    print(markdown(result))
    print(f"report: {args.out}/bench.json, bench.md, speedup_by_category.png, accepted_lengths.png, "
          "speedup_vs_tree_size.png")


def _compile_step(args) -> bool | str:
    if args.compile not in COMPILE_CHOICES:  # argparse checks a given value, not a default from the environment
        raise MedusaError(f"MEDUSA_HEADS_COMPILE must be one of {', '.join(COMPILE_CHOICES)}, got {args.compile!r}.")
    return {"on": True, "off": False}.get(args.compile, args.compile)


def _backbone_name(args, model) -> str:
    """The backbone the command runs: `--model`, else the one the heads name, else the embedded default."""
    from medusa_heads.backbone import EMBEDDED_MODEL

    return args.model or model.config.base_model_name_or_path or EMBEDDED_MODEL


def _gguf_file(args, model) -> str | None:
    return None if args.model else model.config.base_model_gguf_file


def _tokenizer(args, model):
    from medusa_heads.backbone import load_tokenizer

    return load_tokenizer(_backbone_name(args, model), gguf_file=_gguf_file(args, model))


def _generate(args) -> None:
    from medusa_heads.inference import GenerationStats, generate, make_acceptance, make_drafter, stream, warm_up
    from medusa_heads.inference.registry import OPTIONS, check_drafter_options
    from medusa_heads.model import MedusaModel

    if args.max_new_tokens < 1:
        raise MedusaError(f"`--max-new-tokens` must be at least 1, got {args.max_new_tokens}.")
    by_batch = args.drafter is None and args.tree is None  # the drafter follows the batch size (--prompts-file)
    source = None
    default = _use_default_configuration(args, 1 if args.prompts_file is None else args.batch_size)
    if default is not None:
        by_batch, source = by_batch and default.tuned_on is None, default.source
    # bad options and broken trees fail before the model loads
    options = check_drafter_options(args.drafter, **{name: getattr(args, name) for name in OPTIONS})
    acceptance = make_acceptance(args.acceptance, args.temperature, args.epsilon, args.delta, args.seed,
                                 device=args.device, top_k=args.top_k, top_p=args.top_p)
    if args.prompts_file is not None:
        _generate_file(args, options, acceptance, by_batch, source)
        return
    model = MedusaModel.from_pretrained(args.heads, base_model=args.model, dtype=args.dtype, device=args.device,
                                        quantize=args.quantize, quantize_drafter=args.quantize_drafter,
                                        compile_step=_compile_step(args))
    tokenizer = _tokenizer(args, model)
    drafter = make_drafter(model, args.drafter, **options)
    warm_up(model, drafter, say=lambda line: print(line, file=sys.stderr, flush=True), acceptance=acceptance)
    if args.json:
        result = generate(model, tokenizer, args.prompt, drafter, acceptance, args.max_new_tokens, args.stop, args.raw)
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, **result.stats.as_dict(),
                          "tree": args.tree or DEFAULT_TREE, "tree_nodes": drafter.tree.size, "drafter": args.drafter,
                          "acceptance": args.acceptance}))
        return
    stats = GenerationStats()
    for piece in stream(model, tokenizer, args.prompt, drafter, acceptance, args.max_new_tokens, args.stop, args.raw,
                        stats):
        print(piece, end="", flush=True)
    print()
    print(f"[{stats.new_tokens} tokens in {stats.steps} steps, mean accepted length "
          f"{stats.mean_accepted_length:.2f}, {stats.tokens_per_second:.1f} tokens/s; per-head acceptance "
          f"{', '.join(f'{a:.2f}' for a in stats.head_acceptance)}]", file=sys.stderr)
    print(f"[{_configuration(args, model, drafter, options, source)}]", file=sys.stderr)
    if args.stats:
        print("\n".join(_stats_lines(stats)), file=sys.stderr)


def _use_default_configuration(args, batch_size: int):
    """Without --drafter, `args` take the default configuration (the drafter, its heads and their quantization, the
    options not given) and it is returned; generate and serve share it, so that one prompt gets one answer."""
    default = None
    if args.drafter is None:
        default = _default_configuration(args, batch_size)
        args.drafter, args.heads = default.drafter, args.heads or default.heads_path
        args.quantize_drafter = args.quantize_drafter or default.quantize_drafter
        for key, value in default.options.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    args.quantize_drafter = args.quantize_drafter or "none"
    return default


def _default_configuration(args, batch_size: int):
    """What runs without --drafter: with no --tree, --heads or --model either, the default for `batch_size`, tuned
    for this machine or the table's; else the table's batch-1 drafter."""
    from medusa_heads.backbone import parse_device, parse_dtype
    from medusa_heads.inference.registry import Configuration, default_configuration, default_drafter

    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    if args.tree is None and args.heads is None and args.model is None:
        return default_configuration(dtype, batch_size, device)
    return Configuration(*default_drafter(dtype))


def _generate_file(args, options: dict, acceptance, by_batch: bool, source: str | None) -> None:
    """`generate --prompts-file`: the prompts in batches, one JSON line per answer. `by_batch`: each batch drafts
    what `configs/batching.json` gives for its size (the last one may be smaller)."""
    import time

    from medusa_heads.inference import generate_batch, make_drafters
    from medusa_heads.inference.registry import default_drafter
    from medusa_heads.model import MedusaModel

    from .bench import read_bench_prompts

    if args.batch_size < 1:
        raise MedusaError(f"`--batch-size` must be at least 1, got {args.batch_size}.")
    if args.acceptance != "greedy" and args.batch_size > 1:
        # one sampler for the whole batch would make each answer depend on the others
        raise MedusaError("Sampling with --prompts-file needs --batch-size 1 (each answer its own random draws).")
    rows = read_bench_prompts(args.prompts_file)
    model = MedusaModel.from_pretrained(args.heads, base_model=args.model, dtype=args.dtype, device=args.device,
                                        quantize=args.quantize, quantize_drafter=args.quantize_drafter,
                                        compile_step=_compile_step(args))
    tokenizer = _tokenizer(args, model)
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(rows), args.batch_size):
        batch = rows[first : first + args.batch_size]
        if by_batch:
            args.drafter, options = default_drafter(model.backbone.dtype, len(batch))
        drafters = make_drafters(model, args.drafter, len(batch), **options)
        results = generate_batch(model, tokenizer, [row["prompt"] for row in batch], drafters,
                                 [acceptance] * len(batch), args.max_new_tokens, args.stop, args.raw)
        for row, result in zip(batch, results):
            tokens += result.stats.new_tokens
            print(json.dumps({"id": row["id"], "prompt": row["prompt"], "text": result.text,
                              "token_ids": result.token_ids, **result.stats.as_dict()}), flush=True)
    seconds = time.perf_counter() - start
    print(f"[{len(rows)} prompts, {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s), batches of "
          f"{args.batch_size}]", file=sys.stderr)
    print(f"[{_configuration(args, model, drafters[0], options, source)}]", file=sys.stderr)


def _configuration(args, model, drafter, options: dict, source: str | None) -> str:
    """What ran, in words: drafter and the options it was given, heads, acceptance, dtype and device, and where a
    default came from (`source`)."""
    shown = ({"tree": DEFAULT_TREE} if "tree" in DRAFTERS[args.drafter].options else {}) | options
    taken = [f"{k} {v}" for k, v in shown.items()]
    heads = model.heads.name_or_path or "untrained"
    dtype = str(model.backbone.dtype).removeprefix("torch.")
    if args.dtype == "auto":
        dtype += " (--dtype auto" + ("" if dtype == "float32" else "; greedy output is the backbone's up to rounding, "
                                     "--dtype float32 for HF-identical tokens") + ")"
    return (f"drafter {args.drafter}" + (f" ({', '.join(taken)})" if taken else "")
            + f", up to {drafter.tree.size} tree nodes; {model.heads.head_type} heads {heads}; "
            f"{args.acceptance} acceptance; {dtype}" + (f", {args.quantize} weights" if args.quantize != "none" else "")
            + (f", {args.quantize_drafter} drafter weights" if args.quantize_drafter != "none" else "")
            + f" on {model.device}" + (f"; default: {source}" if source else ""))


def _stats_lines(stats) -> list[str]:
    def share(x):
        return "-" if x is None else f"{x:.2f}"

    counts = stats.accepted_length_counts
    lines = ["accepted tokens per step (bonus included): "
             + ", ".join(f"{n + 1}: {c}" for n, c in enumerate(counts)) + f" steps (of {stats.steps})",
             "acceptance by depth, given the parent was accepted and had children drafted: "
             + ", ".join(f"{d + 1}: {share(a)}" for d, a in enumerate(stats.depth_acceptance)),
             "first rejection by depth: " + ", ".join(f"{d + 1}: {n}" for d, n in enumerate(stats.first_rejections))
             + f" steps; none (a leaf was reached): {stats.steps_without_rejection}",
             "accepted rank among its parent's children, share of steps:"]
    lines += [f"  depth {d + 1}: " + ", ".join(f"r{r} {x:.2f}" for r, x in enumerate(row))
              for d, row in enumerate(stats.rank_acceptance) if row]
    if ms := stats.step_ms:
        lines.append(f"a step: {sum(ms.values()):.1f} ms, drafting {ms['draft']:.1f}, verification {ms['verify']:.1f}, "
                     f"other {ms['other']:.1f}")
    return lines


def _distill(args) -> None:
    from medusa_heads.backbone import EMBEDDED_MODEL
    from medusa_heads.training.distill import distill

    distill(args.prompts, args.out, model=args.model or EMBEDDED_MODEL, batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, dtype=args.dtype,
            device=args.device, limit=args.limit, seed=args.seed, top_p=args.top_p)


def _self_instruct(args) -> None:
    from medusa_heads.backbone import EMBEDDED_MODEL
    from medusa_heads.training.self_instruct import self_instruct

    if args.count < 1:
        raise MedusaError(f"--count must be at least 1, got {args.count}.")
    self_instruct(args.out, args.count, model=args.model or EMBEDDED_MODEL, exclude=args.exclude,
                  batch_size=args.batch_size, temperature=args.temperature, seed=args.seed, dtype=args.dtype,
                  device=args.device)


def _follow_ups(args) -> None:
    from medusa_heads.training.self_instruct import follow_ups

    follow_ups(args.answers, args.out, share=args.share, seed=args.seed)


def _serve(args) -> None:
    from medusa_heads.inference import make_acceptance, make_drafter, warm_up
    from medusa_heads.inference.registry import OPTIONS, check_drafter_options
    from medusa_heads.model import MedusaModel

    from .serve import listen, run_server

    for flag, value in (("--max-queue", args.max_queue), ("--max-batch", args.max_batch)):
        if value < 1:
            raise MedusaError(f"`{flag}` must be at least 1, got {value}.")
    if not 0 <= args.port <= 65535:
        raise MedusaError(f"`--port` must be in 0..65535, got {args.port}.")
    _use_default_configuration(args, 1)  # a request alone decodes as generate does; batches follow batching.json
    options = check_drafter_options(args.drafter, **{name: getattr(args, name) for name in OPTIONS})
    sock = listen(args.host, args.port)
    model = MedusaModel.from_pretrained(args.heads, base_model=args.model, dtype=args.dtype, device=args.device,
                                        quantize_drafter=args.quantize_drafter,
                                        compile_step=_compile_step(args))
    drafter = make_drafter(model, args.drafter, **options)
    for rule in ("greedy", args.acceptance):  # temperature 0, and any other (top-k or top-p compile at first use)
        warm_up(model, drafter, say=lambda line: print(line, file=sys.stderr, flush=True),
                acceptance=make_acceptance(rule, temperature=0.7))
    run_server(sock, model, _tokenizer(args, model), _backbone_name(args, model), args.drafter, options,
               args.acceptance, args.max_queue, args.max_batch, args.verbose)


def _ngram_store(args) -> None:
    from medusa_heads.model import load_heads
    from medusa_heads.ngram_store import NgramStore
    from medusa_heads.training.data import assistant_spans, load_examples

    if not args.heads.is_dir():
        raise MedusaError(f"`--heads {args.heads}` is not a folder of heads.")
    if args.max_n < 1 or args.min_count < 1:
        raise MedusaError("`--max-n` and `--min-count` must be at least 1.")
    heads = load_heads(args.heads)
    examples = load_examples(args.data, _tokenizer(args, heads), args.max_length)
    answers = [span for ex in examples for span in assistant_spans(ex)]
    store = NgramStore.build(answers, heads.config.vocab_size, args.max_n, args.min_count)
    path = store.save(args.heads)
    print(f"{len(store)} contexts of up to {max(store.tables, default=0)} tokens from "
          f"{sum(map(len, answers))} answer tokens in {len(answers)} turns; wrote {path}")


def _export(args) -> None:
    from medusa_heads.backbone import load_backbone
    from medusa_heads.formats import check_format, export_original, export_speculators, export_vllm
    from medusa_heads.heads import MedusaHeads
    from medusa_heads.model import load_heads
    from medusa_heads.tree import load_tree, validate_tree

    if args.out.exists() and any(args.out.iterdir()):
        raise MedusaError(f"`{args.out}` exists and is not empty; export into a new folder.")
    heads = load_heads(args.heads)
    check_format(heads, args.format)
    tree = validate_tree(load_tree(args.tree), num_heads=heads.config.num_heads) if args.format == "trtllm" else None
    lm_head = None
    if isinstance(heads, MedusaHeads) and heads.config.share_lm_head:  # the EAGLE layout leaves the LM head out
        backbone = load_backbone(_backbone_name(args, heads), gguf_file=_gguf_file(args, heads))
        lm_head = backbone.get_output_embeddings().weight.to(heads.dtype)
    if args.format == "vllm":
        out = export_vllm(heads, lm_head, args.out)
    elif args.format == "speculators":
        out = export_speculators(heads, args.out)
    else:
        out = export_original(heads, lm_head, args.out, tree)
    print(f"wrote {args.format} heads to {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


def _convert(args) -> None:
    from medusa_heads.formats import import_original
    from medusa_heads.model import save_heads

    if args.out.exists() and any(args.out.iterdir()):
        raise MedusaError(f"`{args.out}` exists and is not empty; convert into a new folder.")
    heads = import_original(args.original)
    out = save_heads(args.out, heads)
    config = heads.config
    projection = "the backbone's LM head" if config.share_lm_head else "their own LM heads"
    print(f"wrote {config.num_heads} Medusa heads ({config.num_layers} residual blocks each, {projection}) for "
          f"`{config.base_model_name_or_path}` to {out}")


def _check_tree_args(args) -> None:
    if args.max_nodes < 2:
        raise MedusaError(f"`--max-nodes` must be at least 2 (the root and one draft), got {args.max_nodes}.")
    if getattr(args, "repeats", 1) < 1:
        raise MedusaError(f"`--repeats` must be at least 1, got {args.repeats}.")


def _profile(args) -> None:
    from medusa_heads.model import MedusaModel

    from .profile import cached_profile

    _check_tree_args(args)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise MedusaError(f"`--contexts` must be comma-separated integers, got {args.contexts!r}.") from None
    model = MedusaModel.from_pretrained(args.heads, base_model=args.model, dtype=args.dtype, device=args.device)
    profile, path = cached_profile(model, args.max_nodes, refresh=args.refresh, contexts=contexts,
                                   repeats=args.repeats)
    cost = profile.relative_cost(profile.sizes[-1])
    print(f"{profile.model} ({profile.heads} heads) on {profile.device}, {profile.dtype}, {profile.threads} threads")
    print("nodes | " + " | ".join(f"ms at context {c}" for c in profile.step_ms) + " | cost vs 1 token")
    for i, n in enumerate(profile.sizes):
        print(f"{n} | " + " | ".join(f"{ms[i]:.1f}" for ms in profile.step_ms.values()) + f" | {cost[n - 1]:.2f}")
    print(f"profile: {path}")


def _tune(args) -> None:
    import os
    import time

    import torch

    from medusa_heads.backbone import parse_device, parse_dtype
    from medusa_heads.inference.registry import tune_candidates, tuning_prompts

    from .tune import greedy_timer, tune

    if args.max_new_tokens < 1:
        raise MedusaError(f"`--max-new-tokens` must be at least 1, got {args.max_new_tokens}.")
    if not args.seconds > 0:
        raise MedusaError(f"`--seconds` must be above 0, got {args.seconds}.")
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    candidates, prompts = tune_candidates(dtype), tuning_prompts()
    if len(candidates) < 2:
        raise MedusaError(f"In {str(dtype).removeprefix('torch.')} the project ships one lossless configuration, "
                          f"{candidates[0]}: nothing to tune.")
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load >= 1 and load + torch.get_num_threads() > cores:
        logging.getLogger(__name__).warning(
            "The CPU is busy (load average %.1f on %d cores): other work's share of the timings may decide the "
            "choice; tune again on a quiet machine.", load, cores)
    start = time.perf_counter()
    print(f"loading and warming up {len(candidates)} configurations", file=sys.stderr)
    measure = greedy_timer(candidates, dtype, device, args.max_new_tokens, warmup=prompts[0],
                           compile_step=_compile_step(args))
    record, path = tune(dtype, device, prompts, measure, args.max_new_tokens, args.seconds)
    print(f"{len(candidates)} configurations on {record['prompts']} prompts, up to {args.max_new_tokens} tokens each, "
          f"in {time.perf_counter() - start:.0f} s on {record['device']}, {record['dtype']}, {record['threads']} "
          "threads:")
    table = record["measured"][0]["ms_per_token"]
    for candidate, measured in zip(candidates, record["measured"]):
        print(f"  {measured['ms_per_token']:.1f} ms a token ({measured['ms_per_token'] / table:.3f}x the table's, "
              f"{measured['tokens_per_second']:.1f} tokens/s): {candidate}"
              + ("  <- chosen" if candidate.settings() == record["choice"] else ""))
    print(f"recorded in {path}: `generate` and `serve` run the chosen one at batch 1 in {record['dtype']} with "
          f"{record['threads']} threads when given no drafter")


def _tree(args) -> None:
    from medusa_heads.model import MedusaModel
    from medusa_heads.tree.optimize import fit_tree, write_tree

    from medusa_heads.inference import heads_drafter
    from medusa_heads.tree import build_tree

    from .calibrate import calibrate, load_calibration, parse_rows, read_rows, replayed_tokens_per_step, to_conversations
    from .profile import cached_profile, load_profile

    _check_tree_args(args)
    if args.top_k < 1:
        raise MedusaError(f"`--top-k` must be at least 1, got {args.top_k}.")
    if args.budget is not None and not 2 <= args.budget <= args.max_nodes:
        raise MedusaError(f"`--budget` must be in 2..--max-nodes ({args.max_nodes}), got {args.budget}.")
    selection = parse_rows(args.rows)
    from_data = args.calibration.suffix == ".jsonl"
    rows = read_rows(args.calibration, selection) if from_data else None
    calibration = None if from_data else load_calibration(args.calibration)
    profile = load_profile(args.profile) if args.profile else None
    if profile is not None:
        profile.relative_cost(args.max_nodes)  # a profile too small fails before any work
    if from_data or profile is None:
        model = MedusaModel.from_pretrained(args.heads, base_model=args.model, dtype=args.dtype, device=args.device)
    if from_data:
        name = _backbone_name(args, model)
        tokenizer = _tokenizer(args, model)
        conversations = to_conversations(rows, tokenizer)
        calibration = calibrate(model, conversations, args.top_k, meta={
            "data": str(args.calibration), "rows": args.rows or ":", "model": name,
            "heads": args.heads or "shipped", "dtype": str(model.backbone.dtype).removeprefix("torch.")})
        print(f"calibrated on {calibration.conversations} conversations: accepted given the parent, top-1 per depth "
              + ", ".join(f"{row[0]:.3f}" for row in calibration.p))
    if profile is None:
        profile, path = cached_profile(model, args.max_nodes)
        print(f"profile: {path}")
    fitted = fit_tree(calibration.p, profile.relative_cost(args.max_nodes), args.budget)
    # The expectation counts every answer position as a step's root; decoding jumps over easy stretches, so the
    # fitted tree is also replayed on the answers, step by step, for the tokens per step decoding would get.
    replayed = replayed_tokens_per_step(model, heads_drafter(model, build_tree(fitted.paths, model.device)),
                                        conversations) if from_data else None
    write_tree(fitted, args.out, calibration.as_dict(), profile.as_dict(), replayed)
    for n in [n for n in profile.sizes if n <= len(fitted.cost)]:
        e, c = fitted.expected[n - 1], fitted.cost[n - 1]
        print(f"{n:3d} nodes: expected accepted length {e:.3f}, cost {c:.2f}x, predicted speed-up {e / c:.3f}x")
    print(f"{'given' if args.budget else 'chosen'} budget: {fitted.budget} nodes (root included), "
          f"expected accepted length "
          f"{fitted.expected_accepted_length:.3f}, predicted speed-up {fitted.predicted_speedup:.3f}x over plain "
          f"decoding; wrote {args.out}")
    if replayed is not None:
        print(f"replayed on the calibration answers: {replayed:.3f} tokens per step")
    if fitted.predicted_speedup < 1:
        print(f"note: plain decoding is predicted to be faster than {'this tree' if args.budget else 'any tree here'}",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    chatty = ("distill", "self-instruct", "follow-ups")
    logging.basicConfig(level=logging.INFO if args.verbose or args.command in chatty else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        import torch
        import transformers

        if not args.verbose:
            transformers.logging.set_verbosity_error()
            transformers.logging.disable_progress_bar()
        if getattr(args, "threads", None):
            torch.set_num_threads(args.threads)
        commands = {"generate": _generate, "distill": _distill, "self-instruct": _self_instruct,
                    "follow-ups": _follow_ups, "bench": _bench, "profile": _profile, "tree": _tree,
                    "ngram-store": _ngram_store, "export": _export, "convert": _convert,
                    "serve": _serve, "tune": _tune}
        commands[args.command](args)
    except (MedusaError, StrictDataclassError) as err:
        print(f"medusa-heads: error: {first_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("medusa-heads: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
