"""vLLM side by side: vLLM without speculation, with its n-gram drafter and with this project's exported heads,
on the benchmark prompts, one prompt at a time, beside this project's own runtime (and llama.cpp) on the same prompts.

Runs with the python of vLLM's own virtual environment (vLLM pins its own transformers), which
`benchmarks/vllm_env.sh` creates; `vllm-python` is its python with vLLM's preferred libraries preloaded:

    benchmarks/vllm_env.sh                 # .venv-vllm: about 1.5 minutes from a package mirror
    flock /tmp/bench.lock .venv-vllm/bin/vllm-python benchmarks/vllm_side_by_side.py --limit 16 --out bench-out/vllm

Every vLLM method is an engine of its own (`LLM(...)`, started once); each prompt is decoded by every engine in
rotating order after a warm-up, so that the machine's load falls on all alike. Greedy, batch 1, the prompt ids
are the chat template's, as this project's bench builds them. vLLM's speculative counters are its per-request
metrics (`per_request_spec_decode_metrics`). This project's runtime (`--ours`, through `medusa-heads bench` in
the project's `.venv`, its full report and plots in OUT/ours) runs before the engines start, never at the same time; `--ours llama.cpp,...` adds
llama.cpp's row through that bench (llama-cpp-python in `.venv`: `pip install -e '.[llamacpp]'`).

Methods (`--methods`): `plain`; `ngram:K` (vLLM's prompt lookup, K tokens, n-grams of 2-4 tokens like this
project's); `medusa:K` (the heads of `--heads`, written by `medusa-heads export --format vllm`; by default the
shipped Medusa heads, exported here); `eagle:K` (the EAGLE drafter of `--eagle`, written the same way, vLLM's
`eagle` method; by default the shipped drafter, exported here); and `--drafter NAME=DIR:METHOD[:K]` for any other
folder vLLM reads with `method` METHOD (`eagle3`, ...).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHIPPED_MEDUSA = REPO / "medusa_heads" / "pretrained" / "smollm2-135m-embedded-medusa"
SHIPPED_EAGLE = REPO / "medusa_heads" / "pretrained" / "smollm2-135m-embedded-eagle"
SHIPPED_EAGLE3 = REPO / "medusa_heads" / "pretrained" / "smollm2-135m-embedded-eagle3"
# The project's embedded default backbone as the HF folder it caches (what `medusa-heads bench` runs by default).
EMBEDDED_FOLDER = Path(os.environ.get("MEDUSA_HEADS_HOME", Path.home() / ".cache" / "medusa-heads")) / "models" \
    / "smollm2-135m-embedded-v1"
NGRAM_WINDOW = (2, 4)  # shortest and longest n-gram looked up, as this project's `ngram_lookup`


def read_prompts(path: Path, limit: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": str(r.get("id", n)), "category": r.get("category", "all"), "prompt": r["prompt"]}
            for n, r in enumerate(rows)][:limit]


def speculative_configs(methods: list[str], heads: str, eagle: str, drafters: list[str]) -> dict[str, dict | None]:
    """Method name -> vLLM `speculative_config` (None: no speculation); `heads`, `eagle`: the exported folders."""
    configs = {}
    for name in methods:
        kind, _, k = name.partition(":")
        if kind == "plain" and not k:
            configs[name] = None
        elif kind == "ngram" and k.isdigit():
            configs[name] = {"method": "ngram", "num_speculative_tokens": int(k),
                             "prompt_lookup_min": NGRAM_WINDOW[0], "prompt_lookup_max": NGRAM_WINDOW[1]}
        elif kind in ("medusa", "eagle") and k.isdigit():
            configs[name] = {"method": kind, "model": heads if kind == "medusa" else eagle,
                             "num_speculative_tokens": int(k)}
        else:
            raise SystemExit(f"Unknown method `{name}`: use plain, ngram:K, medusa:K or eagle:K (K drafted tokens).")
    for text in drafters:
        name, _, spec = text.partition("=")
        folder, _, rest = spec.partition(":")
        method, _, k = rest.partition(":")
        if not (name and folder and method) or (k and not k.isdigit()):
            raise SystemExit(f"`--drafter {text}`: give NAME=DIR:METHOD[:K], e.g. eagle=runs/eagle-vllm:eagle:3.")
        configs[name] = {"method": method, "model": folder, "num_speculative_tokens": int(k or 3)}
    return configs


def export_shipped(cli: Path, source: Path, folder: Path) -> None:
    """Shipped heads or drafter in vLLM's layout, written by this project's CLI."""
    subprocess.run([str(cli), "export", "--format", "vllm", str(source), str(folder)], check=True)


def run_ours(cli: Path, methods: list[str], args, out: Path) -> dict:
    """`medusa-heads bench` on the same prompts (HF greedy and `methods`), its bench.json."""
    command = [str(cli), "bench", "--prompts", str(args.prompts), "--methods", ",".join(["hf", *methods]),
               "--max-new-tokens", str(args.max_tokens), "--dtype", args.dtype, "--threads", str(args.threads),
               "--no-fp32-reference", "--out", str(out),
               "--alt-heads", f"medusa={SHIPPED_MEDUSA}", "--alt-heads", f"eagle={SHIPPED_EAGLE}",
               "--alt-heads", f"eagle3={SHIPPED_EAGLE3}", "--quantize-drafter", args.quantize_drafter]
    if args.limit:
        command += ["--limit", str(args.limit)]
    print("this project's runtime:", " ".join(command), flush=True)
    if subprocess.run(command).returncode:
        raise SystemExit("`medusa-heads bench` failed: its error is above.")
    return json.loads((out / "bench.json").read_text())


def encode(model: str, prompts: list[dict]) -> list[list[int]]:
    """The chat template around one user turn, as `medusa_heads.inference.generate.encode_prompt`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"] for p in prompts]


def start_engine(args, speculative: dict | None):
    from vllm import LLM

    extra = {"speculative_config": speculative, "per_request_spec_decode_metrics": "summary"} if speculative else {}
    # kv_cache_memory_bytes: a fixed, small cache (batch 1) instead of a share of the host's memory per engine.
    return LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
               kv_cache_memory_bytes=args.kv_cache_mb * 2**20, enforce_eager=args.enforce_eager, **extra)


def decode(llm, prompt_ids: list[int], max_tokens: int) -> dict:
    from vllm import SamplingParams, TokensPrompt

    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], SamplingParams(temperature=0.0,
                       max_tokens=max_tokens), use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - start
    spec = out.spec_decode_metrics.to_dict() if getattr(out, "spec_decode_metrics", None) is not None else None
    return {"token_ids": list(out.token_ids), "seconds": seconds, "tokens_per_second": len(out.token_ids) / seconds,
            "spec": spec}


def run_vllm(args, configs: dict[str, dict | None], prompts: list[dict], prompt_ids: list[list[int]]) -> list[dict]:
    """Every prompt through every engine, in rotating order, after a warm-up: one row per prompt and method."""
    engines = {name: start_engine(args, config) for name, config in configs.items()}
    for llm in engines.values():
        decode(llm, prompt_ids[0], 16)
    rows = []
    order = list(engines)
    for i, (p, ids) in enumerate(zip(prompts, prompt_ids)):
        for name in order[i % len(order):] + order[: i % len(order)]:
            rows.append({"prompt": p["id"], "category": p["category"], "method": name,
                         **decode(engines[name], ids, args.max_tokens)})
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{r['method']} {r['tokens_per_second']:.1f}"
                                                             for r in rows if r["prompt"] == p["id"]), flush=True)
    for llm in engines.values():
        # LLM has no shutdown of its own in vLLM 0.32; left running, its engine process keeps this one from exiting
        # (multiprocessing joins it at exit).
        llm.llm_engine.engine_core.shutdown()
    return rows


def summarize_vllm(rows: list[dict], methods: list[str]) -> dict:
    plain = {r["prompt"]: r for r in rows if r["method"] == "plain"}
    summary = {}
    for name in methods:
        mine = [r for r in rows if r["method"] == name]
        tps = [r["tokens_per_second"] for r in mine]
        s = {"prompts": len(mine), "tokens_per_second": statistics.median(tps), "tokens_per_second_min": min(tps),
             "tokens_per_second_max": max(tps), "tokens": sum(len(r["token_ids"]) for r in mine)}
        if plain:
            s["speedup_vs_plain"] = statistics.median(r["tokens_per_second"] / plain[r["prompt"]]["tokens_per_second"]
                                                      for r in mine)
            s["identical_to_plain"] = sum(r["token_ids"] == plain[r["prompt"]]["token_ids"] for r in mine)
        specs = [r["spec"] for r in mine if r["spec"] is not None]
        if specs:
            drafts = sum(x["num_spec_steps"] for x in specs)
            accepted = sum(x["num_accepted_draft_tokens"] for x in specs)
            draft_tokens = sum(x["num_draft_tokens"] for x in specs)
            histogram = [sum(column) for column in zip(*(x["acceptance_histogram"] for x in specs))]
            decode_tokens = s["tokens"] - len(mine)  # the prefill forward gives each prompt's first token
            s.update(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                     acceptance_rate=accepted / max(draft_tokens, 1),
                     tokens_per_drafted_step=1 + accepted / max(drafts, 1),
                     # decode forwards = decode tokens - accepted drafts: comparable with this project's mean
                     # accepted length, which counts every step (vLLM's n-gram drafts nothing without a match)
                     tokens_per_decode_step=decode_tokens / max(decode_tokens - accepted, 1),
                     # share of drafted steps that accepted at least d tokens, d = 1..K
                     accepted_by_position=[sum(histogram[d:]) / max(drafts, 1) for d in range(1, len(histogram))])
        summary[name] = s
    return summary


def summarize_ours(bench: dict, vllm_rows: list[dict]) -> dict:
    """Per method of `medusa-heads bench`: tokens/s over prompts, also against vLLM plain on the same prompts."""
    plain = {r["prompt"]: r["tokens_per_second"] for r in vllm_rows if r["method"] == "plain"}
    summary = {}
    for name, s in bench["summary"].items():
        mine = [r for r in bench["rows"] if r["method"] == name]
        tps = [r["tokens_per_second"] for r in mine]
        summary[name] = {"prompts": s["prompts"], "tokens_per_second": s["tokens_per_second"],
                         "tokens_per_second_min": min(tps), "tokens_per_second_max": max(tps),
                         "speedup_vs_hf": s["speedup_median"], "tokens_per_decode_step": s["mean_accepted_length"],
                         "identical_to_hf": s["identical_outputs"]}
        if plain:
            summary[name]["speedup_vs_plain"] = statistics.median(r["tokens_per_second"] / plain[r["prompt"]]
                                                                  for r in mine)
    return summary


def _f(value, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def markdown(result: dict) -> str:
    lines = ["| engine | method | tokens/s median (min-max) | vs vLLM plain (median) | drafts | draft tokens | "
             "accepted | acceptance rate | tokens per drafted step | tokens per decode step | identical greedy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ours = (result.get("ours") or {}).get("summary", {})
    for runtime, summary in (("vLLM", result["vllm"]["summary"]), ("medusa-heads", ours)):
        for name, s in summary.items():
            engine = "llama.cpp" if name.startswith("llama.cpp") else runtime  # a peer run by this project's bench
            speed = (f"{s['tokens_per_second']:.1f} ({s['tokens_per_second_min']:.1f}-"
                     f"{s['tokens_per_second_max']:.1f})")
            identical = (f"{s['identical_to_plain']}/{s['prompts']} vs plain" if engine == "vLLM" else
                         f"{s['identical_to_hf']}/{s['prompts']} vs hf")
            cells = [engine, name, speed, _f(s.get("speedup_vs_plain"), unit="x"), _f(s.get("drafts"), "d"),
                     _f(s.get("draft_tokens"), "d"), _f(s.get("accepted_tokens"), "d"), _f(s.get("acceptance_rate")),
                     _f(s.get("tokens_per_drafted_step")), _f(s.get("tokens_per_decode_step")), identical]
            lines.append("| " + " | ".join(cells) + " |")
    fp = result["fingerprint"]
    lines.append(f"\n{result['date']}: {fp['dtype']}, {result['prompts']} prompts, batch 1, {result['max_tokens']} "
                 f"new tokens at most, greedy; vLLM {fp['vllm']} (torch {fp['torch']}, cores "
                 f"{fp['VLLM_CPU_OMP_THREADS_BIND']}, LD_PRELOAD {fp['LD_PRELOAD'] or 'none'}, "
                 f"{'eager' if fp['enforce_eager'] else 'torch.compile'}) on {fp['cpu']}; wall time "
                 f"{result['wall_seconds'] / 60:.1f} min.")
    lines.append("Tokens/s: new tokens over the whole call (prefill included), per prompt. Drafts: decode steps "
                 "that drafted; tokens per drafted step: 1 + accepted / drafts; tokens per decode step: new tokens "
                 "after the first over decode forwards (this project's mean accepted length).")
    for name, s in result["vllm"]["summary"].items():
        if s.get("accepted_by_position"):
            shares = ", ".join(f"{a:.2f}" for a in s["accepted_by_position"])
            lines.append(f"- {name}: share of drafted steps accepting at least 1, 2, ... tokens: {shares}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(EMBEDDED_FOLDER), help="the backbone as an HF folder (default: the "
                        "project's embedded SmolLM2-135M-Instruct, as it caches it)")
    parser.add_argument("--prompts", type=Path, default=REPO / "benchmarks" / "prompts.jsonl")
    parser.add_argument("--limit", type=int, default=16, help="only the first N prompts (0: all)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--methods", default="plain,ngram:5,medusa:1,medusa:2",
                        help="comma-separated vLLM methods: plain, ngram:K, medusa:K, eagle:K")
    parser.add_argument("--heads", help="Medusa heads in vLLM's layout (default: the shipped ones, exported here)")
    parser.add_argument("--eagle", help="an EAGLE drafter in vLLM's layout, for eagle:K (default: the shipped one, "
                        "exported here)")
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR:METHOD[:K]",
                        help="another drafter vLLM reads as `method` METHOD (repeatable)")
    parser.add_argument("--ours", default="medusa+ngram:cpu-16,medusa:cpu-16",
                        help="this project's methods as `medusa-heads bench` names them (HF greedy is always "
                             "added; `METHOD#medusa`, `METHOD#eagle` and `METHOD#eagle3` use the shipped Medusa "
                             "heads, EAGLE and EAGLE-3 drafters; `llama.cpp` its peer on the model's GGUF); empty "
                             "to skip")
    parser.add_argument("--quantize-drafter", default="none", help="this project's runtime: as for `medusa-heads "
                        "bench` (int8: the drafters' own weights in int8, lossless)")
    parser.add_argument("--project-cli", type=Path, default=REPO / ".venv" / "bin" / "medusa-heads",
                        help="this project's `medusa-heads`, in its own virtual environment")
    parser.add_argument("--cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND unless already set")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of this project's runtime")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--enforce-eager", action="store_true", help="skip vLLM's torch.compile (faster start)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.limit = args.limit or None
    # vLLM computes on one core and reserves the other for its engine unless told which cores to bind.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.cores)
    preload = os.environ.get("LD_PRELOAD", "")  # as given: vLLM appends torch's libgomp to it for its workers
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = read_prompts(args.prompts, args.limit)
    methods = [m for m in args.methods.split(",") if m]
    with tempfile.TemporaryDirectory() as tmp:
        heads, eagle = args.heads or str(Path(tmp) / "medusa-vllm"), args.eagle or str(Path(tmp) / "eagle-vllm")
        # a bad method fails now, not after the bench
        configs = speculative_configs(methods, heads, eagle, args.drafter)
        ours_methods = [m for m in args.ours.split(",") if m]
        bench = run_ours(args.project_cli, ours_methods, args, args.out / "ours") if ours_methods else None
        for given, source, folder in ((args.heads, SHIPPED_MEDUSA, heads), (args.eagle, SHIPPED_EAGLE, eagle)):
            if given is None and any(c and c.get("model") == folder for c in configs.values()):
                export_shipped(args.project_cli, source, Path(folder))
        prompt_ids = encode(args.model, prompts)
        rows = run_vllm(args, configs, prompts, prompt_ids)
    import torch
    import vllm

    result = {
        "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts), "max_tokens": args.max_tokens,
        "prompt_ids": prompt_ids, "speculative_configs": configs,
        "fingerprint": {"vllm": vllm.__version__, "torch": torch.__version__, "python": platform.python_version(),
                        "cpu": platform.processor() or platform.machine(), "dtype": args.dtype,
                        "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                        "LD_PRELOAD": preload, "enforce_eager": args.enforce_eager},
        "vllm": {"summary": summarize_vllm(rows, list(configs)), "rows": rows},
        "ours": bench and {"methods": list(bench["summary"]), "fingerprint": bench["fingerprint"],
                           "summary": summarize_ours(bench, rows),
                           "rows": [{k: r[k] for k in ("prompt", "method", "tokens", "tokens_per_second",
                                                       "identical_to_hf", "accepted_lengths")}
                                    for r in bench["rows"]]},
        "wall_seconds": time.perf_counter() - started,
    }
    (args.out / "vllm_side_by_side.json").write_text(json.dumps(result, indent=1))
    (args.out / "vllm_side_by_side.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
