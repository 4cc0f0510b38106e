"""llama.cpp as a peer in `medusa-heads bench`: one line of error without llama-cpp-python (the CI's case), and with
it (`pip install -e '.[llamacpp]'`) greedy decoding of the same prompt ids on the embedded model's GGUF."""

import importlib.util
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from medusa_heads import MedusaError
from medusa_heads.apps.bench import bench, load_llama, markdown
from medusa_heads.backbone import EMBEDDED_GGUF, _embedded_gguf_folder
from medusa_heads.inference.generate import encode_prompt

from test_cli import assert_clean_error  # noqa: E402

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed: pip install -e '.[llamacpp]'")


def test_without_llama_cpp_the_method_is_a_one_line_error(cli, tiny_backbone, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if not installed
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = cli("bench", "--prompts", str(prompts), "--model", str(tiny_backbone), "--methods", "hf,llama.cpp",
                 "--dtype", "float32", "--out", str(tmp_path / "out"))
    assert_clean_error(result, "needs llama-cpp-python", "pip install llama-cpp-python==0.3.36")


@needs_llama_cpp
def test_llama_cpp_decodes_the_same_prompt_ids_greedily(model, backbone, tokenizer, chat_prompts):
    prompts = [{"id": str(i), "category": "x", "prompt": p} for i, p in enumerate(chat_prompts[:2])]
    result = bench(model, tokenizer, prompts, ["hf", "llama.cpp"], max_new_tokens=8)
    rows = [r for r in result["rows"] if r["method"] == "llama.cpp"]
    gguf = _embedded_gguf_folder() / EMBEDDED_GGUF
    assert [r["tokens"] for r in rows] == [8, 8] and all(r["tokens_per_second"] > 0 for r in rows)
    assert rows[0]["weights_mb"] == pytest.approx(gguf.stat().st_size / 2**20)
    s = result["summary"]["llama.cpp"]
    assert s["mean_accepted_length"] is None and 0 <= s["identical_outputs"] <= 2  # reported, not asserted
    assert f"llama-cpp-python {result['fingerprint']['llama_cpp']}" in markdown(result)
    # The backbone is this GGUF de-quantized: fed the same chat-template ids, llama.cpp's first token is one HF ranks
    # near the top (its logits differ by up to 0.8 with 8-bit activations: the first prompt is a near tie, 0.01)
    llm = load_llama(gguf, model)
    assert llm.n_threads == torch.get_num_threads()
    for p in chat_prompts[:3]:
        ids = encode_prompt(tokenizer, p)
        llm.reset()
        with torch.no_grad():
            top = backbone(ids).logits[0, -1].topk(3).indices.tolist()
        assert next(llm.generate(ids[0].tolist(), temp=0.0)) in top, p


@needs_llama_cpp
def test_a_gguf_of_another_vocabulary_is_refused():
    other = SimpleNamespace(backbone=SimpleNamespace(config=SimpleNamespace(vocab_size=100)))
    with pytest.raises(MedusaError, match="has 49152 tokens, the backbone 100"):
        load_llama(_embedded_gguf_folder() / EMBEDDED_GGUF, other)
