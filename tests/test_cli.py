"""The CLI: end to end in a subprocess, and bad input (run in-process, the same `main`) gives one clear line
and a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest

from medusa_heads import MedusaConfig, MedusaHeads


def run_cli(*args, timeout=600):
    cmd = [sys.executable, "-m", "medusa_heads.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def assert_clean_error(result, *needles):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    # The error is one line, the last; anything before it may only be a log line (e.g. "untrained heads").
    assert lines and lines[-1].startswith("medusa-heads: error: "), result.stderr
    assert all(line.startswith(("WARNING ", "INFO ")) for line in lines[:-1]), result.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


@pytest.mark.parametrize("drafter", ["medusa", "medusa+ngram"])
def test_generate_json_on_the_embedded_default(drafter):
    result = run_cli("generate", "--prompt", "Name three colors.", "--max-new-tokens", "12", "--json",
                     "--drafter", drafter)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["new_tokens"] == len(out["token_ids"]) == 12
    assert out["steps"] >= 1 and out["mean_accepted_length"] >= 1.0 and out["tokens_per_second"] > 0
    assert isinstance(out["text"], str) and out["text"]


def test_missing_heads_folder(cli, tmp_path):
    assert_clean_error(cli("generate", "--prompt", "hi", "--heads", str(tmp_path / "nope")), "does not exist")


def test_heads_for_another_vocabulary(cli, tmp_path):
    MedusaHeads(MedusaConfig(base_model_name_or_path="smollm2-135m-embedded", hidden_size=576,
                             vocab_size=32000)).save_pretrained(tmp_path)
    assert_clean_error(cli("generate", "--prompt", "hi", "--heads", str(tmp_path)), "vocabulary 32000")


def test_corrupted_heads_checkpoint(cli, tmp_path):
    MedusaHeads(MedusaConfig(base_model_name_or_path="smollm2-135m-embedded")).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    assert_clean_error(cli("generate", "--prompt", "hi", "--heads", str(tmp_path)), "Cannot load Medusa heads")


@pytest.mark.parametrize("content, needle", [("[[0], [1, 0, 0]]", "has no parent"), ("{[0]", "not valid JSON"),
                                            ("[[0], [0], [1]]", "appears twice")])
def test_malformed_tree(cli, tmp_path, content, needle):
    tree = tmp_path / "tree.json"
    tree.write_text(content)
    assert_clean_error(cli("generate", "--prompt", "hi", "--tree", str(tree)), needle)


def test_tree_deeper_than_the_heads(cli, tmp_path):
    tree = tmp_path / "deep.json"
    tree.write_text(json.dumps([[0] * d for d in range(1, 7)]))
    assert_clean_error(cli("generate", "--prompt", "hi", "--tree", str(tree)), "6 deep")


def test_prompt_longer_than_the_context(cli):
    assert_clean_error(cli("generate", "--prompt", "word " * 9000), "exceed the model's context of 8192")


def test_bad_options(cli):
    assert_clean_error(cli("generate", "--prompt", "hi", "--dtype", "float8"), "Unknown dtype")
    assert_clean_error(cli("generate", "--prompt", "hi", "--max-new-tokens", "0"), "at least 1")
    assert_clean_error(cli("generate", "--prompt", "hi", "--acceptance", "typical", "--temperature", "-1"),
                       "temperature")
    assert_clean_error(cli("distill", "--prompts", "/no/such/file.jsonl", "--out", "/tmp/x.jsonl"),
                       "does not exist")
