"""Several training processes on one CPU machine: they must join one world (or the run must stop), save every
process's state in each checkpoint and resume each process from its own."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from medusa_heads import MedusaError, load_heads
from medusa_heads.training.trainer import train
from test_training import recipe  # noqa: E402

# Two processes of 4 conversations a micro-batch. `min_lr_ratio: 1` keeps the learning rate flat after the warm-up,
# so the schedule does not depend on `max_steps`: a run stopped by `max_steps: 4` right after its step-4
# checkpoint is the first half of the 8-step run, stopped where a kill after that checkpoint would stop it.
SETTINGS = dict(backbone_dtype="float32", num_heads=2, batch_size=4, max_length=64, learning_rate=1e-2,
                warmup_steps=1, min_lr_ratio=1.0, checkpoint_every=4, eval_every=100, log_every=2,
                held_out_fraction=0.1, top_k=3)


def two_processes(tiny_backbone, counting_data, out, *flags, **overrides) -> subprocess.CompletedProcess:
    """`python -m medusa_heads.training` in two gloo processes under torch's launcher; a hang (a collective
    that one process never joins) kills the whole process group and fails the test."""
    values = dict(model=tiny_backbone, data=counting_data, output_dir=out, hidden_cache_dir=out.parent / "hidden",
                  **SETTINGS, **overrides)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "medusa_heads.training", *[a for k, v in values.items() for a in (f"--{k}", str(v))], *flags]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"the two processes hung: {stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def check_a_stopped_run_resumes_on_the_same_curve(tiny_backbone, counting_data, tmp_path, **overrides) -> str:
    """Uninterrupted 8 steps, against 4 steps (a checkpoint) then `--resume` to 8: the same losses at steps 5-8.
    -> the uninterrupted run's log."""
    full = two_processes(tiny_backbone, counting_data, tmp_path / "full", max_steps=8, **overrides)
    assert "world size 2 (process 0)" in full.stderr and "world size 2 (process 1)" in full.stderr
    assert load_heads(tmp_path / "full" / "heads").config.num_heads == 2
    out = tmp_path / "stopped"
    two_processes(tiny_backbone, counting_data, out, max_steps=4, **overrides)
    checkpoint = out / "checkpoint-4"
    assert json.loads((checkpoint / "trainer.json").read_text())["step"] == 4
    assert (checkpoint / "random_states_0.pkl").is_file() and (checkpoint / "random_states_1.pkl").is_file()
    resumed = two_processes(tiny_backbone, counting_data, out, "--resume", max_steps=8, **overrides)
    assert resumed.stderr.count(f"resumed from {checkpoint} at step 4") == 2  # each process loaded its own state
    expected = json.loads((tmp_path / "full" / "history.json").read_text())[4:]
    # Exact: the same processes, threads and data run the same floating-point operations in the same order.
    assert json.loads((out / "history.json").read_text()) == expected
    return full.stderr


@pytest.mark.slow  # a training run of half a minute or more
def test_two_cpu_processes_checkpoint_and_resume_on_the_same_curve(tiny_backbone, counting_data, tmp_path):
    check_a_stopped_run_resumes_on_the_same_curve(tiny_backbone, counting_data, tmp_path)


@pytest.mark.slow
def test_deepspeed_zero2_in_two_cpu_processes_checkpoints_and_resumes(tiny_backbone, counting_data, tmp_path):
    """ZeRO-2 shards the optimizer state: each process must write its shard, or the run hangs at the first
    checkpoint (DeepSpeed's save is collective)."""
    log = check_a_stopped_run_resumes_on_the_same_curve(tiny_backbone, counting_data, tmp_path,
                                                        deepspeed_config="configs/deepspeed/zero2.json")
    assert "world size 2 (process 1), device cpu, DeepSpeed ZeRO-2" in log
    shards = tmp_path / "stopped" / "checkpoint-4" / "pytorch_model"
    assert {p.name for p in shards.glob("zero_pp_rank_*_optim_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"}


def test_a_launched_process_left_alone_stops(tiny_backbone, counting_data, tmp_path, monkeypatch):
    """A launcher said 2 processes, accelerate made 1 (what it does on a CPU unless told `cpu=True`)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with pytest.raises(MedusaError, match="The launcher started 2 processes but accelerate joined 1"):
        train(recipe(tiny_backbone, counting_data, tmp_path / "run", max_steps=2, warmup_steps=1))
    assert not (tmp_path / "run" / "heads").exists()
