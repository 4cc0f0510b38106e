"""The CLI: end to end in a subprocess, and bad input (run in-process, the same `main`) gives one clear line
and a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest
import torch

from medusa_heads import MedusaConfig, MedusaHeads
from medusa_heads.backbone import parse_dtype
from medusa_heads.inference.registry import default_configuration
from medusa_heads.inference.generate import encode_prompt

from oracle import hf_greedy  # noqa: E402  (pytest puts tests/ on sys.path)


def run_cli(*args, timeout=600):
    cmd = [sys.executable, "-m", "medusa_heads.apps.cli", *args]
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
def test_generate_json_on_the_embedded_default(drafter, backbone, tokenizer):
    prompt = "Name three colors."
    result = run_cli("generate", "--prompt", prompt, "--max-new-tokens", "12", "--json", "--drafter", drafter,
                     "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["token_ids"] == hf_greedy(backbone, encode_prompt(tokenizer, prompt), 12)  # fp32 greedy: exact
    # the prefill commits the first token, then the steps what they accepted until 12 (the last step cut short)
    lengths = out["accepted_lengths"]
    assert out["new_tokens"] == 12 and sum(lengths[:-1]) < 11 <= sum(lengths)
    assert out["text"] == tokenizer.decode(out["token_ids"], skip_special_tokens=True)


def test_the_default_configuration_is_chosen_by_dtype_and_stated(backbone, tokenizer):
    prompt = "Name three colors."
    auto = run_cli("generate", "--prompt", prompt, "--max-new-tokens", "8")
    assert auto.returncode == 0, auto.stderr
    dtype = parse_dtype("auto")
    default = default_configuration(dtype)  # tuned for this machine by `medusa-heads tune`, else the table's
    configuration = auto.stderr.strip().splitlines()[-1]
    assert f"drafter {default.drafter} (tree {default.options['tree']})" in configuration
    assert "--dtype auto" in configuration and f"default: {default.source}" in configuration
    assert str(dtype).removeprefix("torch.") in configuration
    fp32 = run_cli("generate", "--prompt", prompt, "--max-new-tokens", "12", "--json", "--dtype", "float32")
    out = json.loads(fp32.stdout)
    default = default_configuration(torch.float32)
    assert (out["drafter"], out["tree"]) == (default.drafter, default.options["tree"])
    assert out["token_ids"] == hf_greedy(backbone, encode_prompt(tokenizer, prompt), 12)


def test_a_prompts_file_is_answered_in_batches_each_as_alone(backbone, tokenizer, tmp_path, chat_prompts):
    prompts = chat_prompts[:3]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    result = run_cli("generate", "--prompts-file", str(path), "--batch-size", "2", "--max-new-tokens", "12",
                     "--dtype", "float32", "--drafter", "medusa+ngram", "--tree", "cpu-8")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [row["id"] for row in rows] == ["p0", "p1", "p2"]
    for row, prompt in zip(rows, prompts):
        assert row["token_ids"] == hf_greedy(backbone, encode_prompt(tokenizer, prompt), 12)
    assert "3 prompts" in result.stderr and "batches of 2" in result.stderr


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


def test_a_bad_compile_setting_in_the_environment_is_one_line(cli, monkeypatch):
    monkeypatch.setenv("MEDUSA_HEADS_COMPILE", "yes")  # the default comes from the environment, unchecked by argparse
    assert_clean_error(cli("generate", "--prompt", "hi"), "MEDUSA_HEADS_COMPILE must be one of auto, on, off")


def test_bad_options(cli):
    assert_clean_error(cli("generate", "--prompt", "hi", "--dtype", "float8"), "Unknown dtype")
    assert_clean_error(cli("generate", "--prompt", "hi", "--device", "tpu:x"), "Unknown device")
    if not torch.cuda.is_available():
        assert_clean_error(cli("generate", "--prompt", "hi", "--device", "cuda"), "is not available")
    assert_clean_error(cli("generate", "--prompt", "hi", "--max-new-tokens", "0"), "at least 1")
    assert_clean_error(cli("generate", "--prompts-file", "/no/such/prompts.jsonl"), "does not exist")
    assert_clean_error(cli("generate", "--prompts-file", "/dev/null", "--batch-size", "0"), "at least 1")
    assert_clean_error(cli("generate", "--prompts-file", "/dev/null", "--acceptance", "exact", "--temperature", "0.7"),
                       "--batch-size 1")
    assert_clean_error(cli("generate", "--prompt", "hi", "--acceptance", "typical", "--temperature", "-1"),
                       "temperature")
    assert_clean_error(cli("distill", "--prompts", "/no/such/file.jsonl", "--out", "/tmp/x.jsonl"),
                       "does not exist")
    assert_clean_error(cli("follow-ups", "/no/such/answers.jsonl", "--out", "/tmp/x.jsonl"), "does not exist")
    assert_clean_error(cli("self-instruct", "--out", "/tmp/x.jsonl", "--count", "0"), "at least 1")
