"""Several training processes on one CPU machine: they must join one world, or the run must stop."""

import json
import os
import subprocess
import sys

import pytest
import torch

from medusa_heads import MedusaError, load_heads
from medusa_heads.training.trainer import train
from test_training import recipe  # noqa: E402


def test_two_cpu_processes_join_one_world(tiny_backbone, counting_data, tmp_path):
    out = tmp_path / "two"
    overrides = dict(model=tiny_backbone, backbone_dtype="float32", data=counting_data, output_dir=out, num_heads=2,
                     max_steps=4, batch_size=4, max_length=64, warmup_steps=1, eval_every=4, checkpoint_every=100,
                     log_every=2, held_out_fraction=0.1, top_k=3, hidden_cache_dir=tmp_path / "hidden")
    args = [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "medusa_heads.training", *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "world size 2 (process 0)" in run.stderr and "world size 2 (process 1)" in run.stderr
    assert len(json.loads((out / "history.json").read_text())) == 4
    assert load_heads(out / "heads").config.num_heads == 2


def test_a_launched_process_left_alone_stops(tiny_backbone, counting_data, tmp_path, monkeypatch):
    """A launcher said 2 processes, accelerate made 1 (what it does on a CPU unless told `cpu=True`)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    with pytest.raises(MedusaError, match="The launcher started 2 processes but accelerate joined 1"):
        train(recipe(tiny_backbone, counting_data, tmp_path / "run", max_steps=2))
    assert not (tmp_path / "run" / "heads").exists()
