import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads import MedusaError, MedusaModel
from medusa_heads.apps.bench import (bench, make_methods, markdown, summarize, tree_families, with_heads,
                                     write_report)
from medusa_heads.inference import GenerationStats, MedusaDrafter
from medusa_heads.inference.generate import generate_ids
from medusa_heads.model import untrained_heads
from medusa_heads.tree import build_tree, load_tree


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
                                      "cpu_features": ["avx2", "avx512_bf16"], "torch": "t", "transformers": "t"}})
    assert "| medusa:cpu-8 | 15.0 | 1.50x (1.00-2.00) | 2.00 | 2/3 |" in table
    assert "float32 on cpu (x; avx2, avx512_bf16, 2 threads)" in table


def test_report_files(tmp_path):
    import json

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

    from medusa_heads.apps.bench import read_bench_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"{c}-{i}", "category": c, "prompt": "hi"}) + "\n"
                            for c in "ab" for i in range(3)))
    assert [r["id"] for r in read_bench_prompts(path, per_category=1)] == ["a-0", "b-0"]
    assert len(read_bench_prompts(path, limit=4)) == 4
    path.write_text('{"category": "a"}\n')
    with pytest.raises(MedusaError, match="not a JSON object with a str field `prompt`"):
        read_bench_prompts(path)


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    """A tiny random Llama with SmolLM2's vocabulary and untrained heads, and a tinier draft model saved to disk."""
    def llama(layers, hidden):
        return LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                            eos_token_id=None, bos_token_id=None)).eval()

    torch.manual_seed(0)
    backbone = llama(2, 64)
    draft = tmp_path_factory.mktemp("draft")
    llama(1, 32).save_pretrained(draft)
    return MedusaModel(backbone, untrained_heads(backbone, "tiny")), str(draft)


METHODS = ["hf", "hf-lookup:3", "ngram:3", "early-exit:1:2", "medusa:chain-4", "medusa:cpu-8", "medusa+ngram:cpu-8",
           "medusa+ngram:cpu-8:2"]


def test_the_harness_on_a_tiny_model(tiny, tokenizer, tmp_path):
    model, draft = tiny
    prompts = [{"id": "a", "category": "x", "prompt": "Say hi."}, {"id": "b", "category": "y", "prompt": "Count."}]
    methods = METHODS + [f"draft-model:{draft}:2", f"hf-assisted:{draft}"]
    result = bench(model, tokenizer, prompts, methods, max_new_tokens=12)
    summary = result["summary"]
    assert list(summary) == methods
    for name, s in summary.items():  # fp32 greedy: every method gives HF greedy's output
        assert s["identical_outputs"] == s["prompts"] == 2, name
    nodes = {name: s["tree_nodes"] for name, s in summary.items()}
    assert nodes == {"hf": None, "hf-lookup:3": None, "ngram:3": 4, "early-exit:1:2": 3, "medusa:chain-4": 5,
                     "medusa:cpu-8": 9, "medusa+ngram:cpu-8": 15, "medusa+ngram:cpu-8:2": 11,  # a 2-token chain
                     f"draft-model:{draft}:2": 3, f"hf-assisted:{draft}": None}
    assert len(summary["medusa:chain-4"]["acceptance_by_depth"]) == 4 and summary["hf"]["acceptance_by_depth"] is None
    draft_mb = [r["weights_mb"] for r in result["rows"] if r["method"] == f"draft-model:{draft}:2"][0]
    assert draft_mb == pytest.approx(49152 * 32 * 4 * 2 / 2**20, rel=0.1)  # embeddings and LM head dominate
    if summary["hf"]["peak_memory_mb"] is not None:  # measurable here (Linux or CUDA)
        assert summary[f"hf-assisted:{draft}"]["peak_memory_mb"] >= draft_mb
    write_report(result, tmp_path)
    # other heads side by side on the same backbone: hydra heads that start as the same LM head, same output
    hydra = tmp_path / "hydra"
    untrained_heads(model.backbone, "tiny", head_type="hydra", draft_vocab=torch.arange(5000)).save_pretrained(hydra)
    side = bench(model, tokenizer, prompts[:1], ["medusa:cpu-8", "medusa:cpu-8#hydra"], max_new_tokens=12,
                 alt_heads={"hydra": str(hydra)})["summary"]
    assert side["medusa:cpu-8#hydra"]["identical_outputs"] == 1 and side["medusa:cpu-8#hydra"]["tree_nodes"] == 9
    for png in ("speedup_by_category.png", "accepted_lengths.png", "speedup_vs_tree_size.png", "step_time.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    for name, s in summary.items():  # where the steps went: the tree methods' decoding loop, not HF's
        assert (s["step_ms"] is None) == name.startswith("hf"), name
        if s["step_ms"]:
            assert s["step_ms"]["draft"] > 0 and s["step_ms"]["verify"] > 0 and s["step_ms"]["other"] >= 0, name
    table = (tmp_path / "bench.md").read_text()
    assert "Where a decoding step goes" in table and "| medusa:cpu-8 | " in table.split("Where a decoding")[1]
    assert "| medusa:cpu-8 | 9 |" in table and "Peak memory: the largest over a method's runs of" in table
    assert result["prompts"] == 2 and 0 < result["wall_seconds"] and "2 prompts in " in table


def test_a_step_s_time_is_split_where_it_is_spent(tiny, tokenizer):
    """A drafter that sleeps 100 ms in every proposal: each step's 100 ms shows up as drafting, and neither in the
    verification nor in the rest, which on a tiny model take a few ms (100 ms leaves room for a busy machine)."""
    model, _ = tiny
    ids = tokenizer("Count to ten.", return_tensors="pt")["input_ids"]

    class Slow(MedusaDrafter):
        def propose(self, state):
            time.sleep(0.1)
            return super().propose(state)

    tree = build_tree(load_tree("cpu-8"))
    timed = {}
    for label, drafter in (("fast", MedusaDrafter(model, tree)), ("slow", Slow(model, tree))):
        stats = GenerationStats()
        tokens = [t for chunk in generate_ids(model, ids, drafter, max_new_tokens=12, stats=stats) for t in chunk]
        assert stats.draft_seconds + stats.verify_seconds <= stats.decode_seconds
        timed[label] = (tokens, stats.step_ms)
    assert timed["slow"][0] == timed["fast"][0]
    slow = timed["slow"][1]
    assert slow["draft"] >= 100 and slow["verify"] < 100 and slow["other"] < 100


def test_other_heads_are_packed_as_the_main_heads(tmp_path):
    """`NAME#LABEL` heads (here an EAGLE drafter: a decoder layer of linears) draft with packed linear layers as the
    main heads do, so that they race fairly."""
    torch.manual_seed(0)
    backbone = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1)).eval().requires_grad_(False)
    for name in ("main", "alt"):  # with a draft vocabulary, scored by a projection of the backbone's LM head
        heads = untrained_heads(backbone, "tiny", head_type="eagle", draft_vocab=torch.arange(32))
        heads.save_pretrained(tmp_path / name)
    model = MedusaModel.from_pretrained(tmp_path / "main", base_model=backbone)
    alt = with_heads(lambda other, *_: other, str(tmp_path / "alt"))(model, None, 0)

    def linears(medusa):  # the heads' and the projection's, not the shared backbone's
        return sorted((name, type(m).__name__) for name, m in medusa.named_modules()
                      if isinstance(m, torch.nn.Linear) and not name.startswith("backbone."))

    assert alt.backbone is model.backbone and ("projection", "PackedLinear") in linears(model)
    assert linears(alt) == linears(model)


def test_method_names_and_their_errors():
    assert tree_families({"medusa:cpu-8": {"tree_nodes": 9}, "medusa+ngram:cpu-8": {"tree_nodes": 15},
                          "medusa:cpu-16:exact@0.7": {"tree_nodes": 16}, "ngram": {"tree_nodes": 7},
                          "medusa:cpu-8#hydra": {"tree_nodes": 9}, "hf": {"tree_nodes": None}}) == {
        "medusa": [("cpu-8", "medusa:cpu-8")], "medusa+ngram": [("cpu-8", "medusa+ngram:cpu-8")],
        "medusa#hydra": [("cpu-8", "medusa:cpu-8#hydra")],
        "medusa:exact@0.7": [("cpu-16", "medusa:cpu-16:exact@0.7")]}
    assert list(make_methods(["ngram", "early-exit:12", "draft-model:/a/b:3", "hf-assisted:/a/b"])) == [
        "hf", "ngram", "early-exit:12", "draft-model:/a/b:3", "hf-assisted:/a/b"]
    for name, needle in [("draft-model:", "needs DRAFT_MODEL"), ("hf-assisted:", "needs a draft model"),
                         ("early-exit:x", "positive integer"), ("ngram:0", "positive integer"),
                         ("early-exit:4:y", "positive integer"), ("lookahead", "Unknown method"),
                         ("medusa:cpu-8#nowhere", "no `--alt-heads nowhere=PATH`"),
                         ("medusa:cpu-8:4", "too many fields: it takes medusa\\[:TREE\\]"),
                         ("medusa+ngram:cpu-8:0", "positive integer")]:
        with pytest.raises(MedusaError, match=needle):
            make_methods([name])
