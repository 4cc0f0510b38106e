"""benchmarks/results_table.py: the README's Results table from a side-by-side run, and its place in the README."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "results_table.py"
spec = importlib.util.spec_from_file_location("results_table", SCRIPT)
results_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(results_table)


def side_by_side() -> dict:
    """Two prompts: vLLM plain 10 and 20 tokens/s, HF greedy 5 and 5, this runtime's default 30 and 30."""
    def rows(method, rates):
        return [{"prompt": f"p{i}", "method": method, "tokens_per_second": r} for i, r in enumerate(rates)]
    return {
        "date": "2026-12-05",
        "fingerprint": {"vllm": "0.32.0"},
        "vllm": {"rows": rows("plain", [10, 20]), "summary": {"plain": {}}},
        "ours": {"fingerprint": {"cpu": "Some CPU (x86_64, family 6 model 167)", "cpu_features": ["avx2", "amx_bf16"],
                                 "threads": 2, "dtype": "torch.bfloat16", "torch": "2.13.0+cpu", "llama_cpp": None},
                 "rows": rows("hf", [5, 5]) + rows("medusa+ngram:hydra-cpu-6", [30, 30]),
                 "summary": {"hf": {}, "medusa+ngram:hydra-cpu-6": {"mean_accepted_length": 2.13}}},
    }


def test_rows_are_medians_of_per_prompt_ratios_fastest_first():
    rows = results_table.table_rows(side_by_side())
    assert [(r["engine"], r["method"]) for r in rows] == [
        ("medusa-heads", "medusa+ngram:hydra-cpu-6"), ("vLLM-cpu", "plain"), ("HF transformers", "hf")]
    ours = rows[0]
    assert ours["tokens_per_second"] == 30 and ours["vs_hf"] == 6 and ours["vs_vllm"] == pytest.approx(2.25)
    assert ours["tokens_per_forward"] == 2.13 and rows[1]["vs_vllm"] == 1


def test_the_table_goes_between_the_readme_markers_and_names_the_machine(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "vllm_side_by_side.json").write_text(json.dumps(side_by_side()))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- results -->\nold table\n<!-- /results -->\n\nafter\n")
    table = results_table.markdown(side_by_side(), folder)
    results_table.splice(readme, table)
    text = readme.read_text()
    assert "old table" not in text and text.endswith("<!-- /results -->\n\nafter\n")
    assert "| medusa-heads | Hydra heads + n-gram branch" in text and "| 30.0 | 6.00x | 2.25x | 2.13 |" in text
    assert "family 6 model 167" in text and "amx_bf16" in text and "2026-12-05" in text


def test_a_readme_without_markers_is_a_one_line_refusal(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="no `<!-- results -->`"):
        results_table.splice(readme, "| table |\n")
    assert readme.read_text() == "# no markers\n"
