from medusa_heads.bench import markdown, summarize


def test_speedup_is_the_median_per_prompt_ratio_against_hf():
    rows = []
    for prompt, base, fast in [("a", 10.0, 15.0), ("b", 20.0, 20.0), ("c", 5.0, 10.0)]:
        rows.append({"prompt": prompt, "category": "x" if prompt != "c" else "y", "method": "hf",
                     "tokens_per_second": base, "identical_to_hf": True, "identical_to_fp32": None,
                     "accepted_lengths": None})
        rows.append({"prompt": prompt, "category": "x" if prompt != "c" else "y", "method": "medusa:cpu-8",
                     "tokens_per_second": fast, "identical_to_hf": prompt != "b", "identical_to_fp32": None,
                     "accepted_lengths": [1, 2, 3]})
    summary = summarize(rows)
    assert summary["hf"]["speedup_median"] == 1.0
    m = summary["medusa:cpu-8"]
    assert m["speedup_median"] == 1.5 and m["speedup_min"] == 1.0 and m["speedup_max"] == 2.0
    assert m["speedup_by_category"] == {"x": 1.25, "y": 2.0}
    assert m["mean_accepted_length"] == 2.0 and m["identical_outputs"] == 2
    table = markdown({"summary": summary, "max_new_tokens": 8, "repeats": 1,
                      "fingerprint": {"dtype": "float32", "device": "cpu", "cpu": "x", "threads": 2,
                                      "torch": "t", "transformers": "t"}})
    assert "| medusa:cpu-8 | 15.0 | 1.50x (1.00-2.00) | 2.00 | 2/3 |" in table


def test_report_files(tmp_path):
    import json

    from medusa_heads.bench import write_report

    rows = [{"prompt": "a", "category": "x", "method": "hf", "tokens_per_second": 10.0, "identical_to_hf": True,
             "identical_to_fp32": None, "accepted_lengths": None},
            {"prompt": "a", "category": "x", "method": "medusa:cpu-8", "tokens_per_second": 12.0,
             "identical_to_hf": True, "identical_to_fp32": None, "accepted_lengths": [1, 2, 2, 3]}]
    result = {"summary": summarize(rows), "rows": rows, "max_new_tokens": 4, "repeats": 1,
              "fingerprint": {"dtype": "float32", "device": "cpu", "cpu": "x", "threads": 1, "torch": "t",
                              "transformers": "t"}}
    write_report(result, tmp_path)
    assert json.loads((tmp_path / "bench.json").read_text())["summary"]["medusa:cpu-8"]["speedup_median"] == 1.2
    assert "medusa:cpu-8" in (tmp_path / "bench.md").read_text()
    for png in ("speedup_by_category.png", "accepted_lengths.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_prompt_selection(tmp_path):
    import json

    import pytest

    from medusa_heads import MedusaError
    from medusa_heads.bench import read_bench_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"{c}-{i}", "category": c, "prompt": "hi"}) + "\n"
                            for c in "ab" for i in range(3)))
    assert [r["id"] for r in read_bench_prompts(path, per_category=1)] == ["a-0", "b-0"]
    assert len(read_bench_prompts(path, limit=4)) == 4
    path.write_text('{"category": "a"}\n')
    with pytest.raises(MedusaError, match="not a JSON object with a `prompt`"):
        read_bench_prompts(path)
