"""`report_to`: a tracker named in a recipe really receives the training curves, or the run stops at once."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from medusa_heads import MedusaError
from medusa_heads.training import trainer
from medusa_heads.training.trainer import train
from test_training import recipe  # noqa: E402


def test_tensorboard_receives_the_losses_and_held_out_accuracy(tiny_backbone, counting_data, tmp_path):
    out = tmp_path / "run"
    train(recipe(tiny_backbone, counting_data, out, report_to="tensorboard", max_steps=4, log_every=2, eval_every=2))
    events = EventAccumulator(str(out / "medusa-heads"))
    events.Reload()
    wanted = {"loss", "loss_head1", "loss_head2", "held_out_top1_head1", "held_out_top1_head2"}
    assert wanted <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss")] == [2, 4]
    assert [e.step for e in events.Scalars("held_out_top1_head2")] == [2, 4]
    assert all(e.value > 0 for e in events.Scalars("loss_head1"))
    assert all(0 <= e.value <= 1 for e in events.Scalars("held_out_top1_head1"))


def test_a_missing_or_unknown_tracker_is_an_error_before_any_compute(tiny_backbone, counting_data, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr("accelerate.tracking.get_available_trackers", lambda: [])
    monkeypatch.setattr(trainer, "load_backbone", lambda *a, **k: pytest.fail("the backbone was loaded"))
    with pytest.raises(MedusaError, match=r"`report_to: wandb`: the wandb package is not installed"):
        train(recipe(tiny_backbone, counting_data, tmp_path / "run", report_to="wandb"))
    with pytest.raises(MedusaError, match="Unknown tracker `tensorbord`"):
        train(recipe(tiny_backbone, counting_data, tmp_path / "run", report_to="tensorboard,tensorbord"))
