"""A real (short) training run on a tiny backbone built from a config, with the real tokenizer."""

import dataclasses
import json
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from medusa_heads import MedusaError, load_heads
from medusa_heads.training.recipe import TrainConfig, load_recipe
from medusa_heads.training.trainer import batch_order, get_lr, micro_batch, steps_in_budget, train


def recipe(tiny_backbone, data, out, **kw):
    values = dict(model=str(tiny_backbone), backbone_dtype="float32", data=str(data), output_dir=str(out),
                  num_heads=2, max_steps=40, batch_size=8, learning_rate=1e-2, warmup_steps=4, eval_every=40,
                  checkpoint_every=20, log_every=10, held_out_fraction=0.1, top_k=3,
                  hidden_cache_dir=str(out.parent / "hidden"))
    values.update(kw)
    return load_recipe(None, {k: v for k, v in values.items()})


def test_training_lowers_the_loss_and_raises_accuracy(tiny_backbone, counting_data, tmp_path):
    result = train(recipe(tiny_backbone, counting_data, tmp_path / "run", share_lm_head=False))
    losses = [h["loss"] for h in result["history"]]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    acc = json.loads((tmp_path / "run" / "heads" / "head_accuracies.json").read_text())
    assert acc["num_heads"] == 2 and len(acc["per_rank"][0]) == 3
    heads = load_heads(tmp_path / "run" / "heads")
    assert heads.config.num_heads == 2 and heads.config.base_model_name_or_path == str(tiny_backbone)
    # untrained heads predict the next token again: their top-1 on t+2 and t+3 is near zero here (0.00 and 0.002
    # measured); the trained ones must be well above
    assert min(acc["top1"]) > 0.1


@pytest.mark.slow  # a training run of half a minute or more
def test_a_killed_run_resumes_on_the_same_loss_curve(tiny_backbone, counting_data, tmp_path):
    full = train(recipe(tiny_backbone, counting_data, tmp_path / "full", max_steps=14, checkpoint_every=5))
    # The same run in a subprocess, SIGKILLed once its first checkpoint is complete.
    out = tmp_path / "killed"
    overrides = dict(model=str(tiny_backbone), backbone_dtype="float32", data=str(counting_data), output_dir=str(out),
                     num_heads=2, max_steps=14, batch_size=8, learning_rate=1e-2, warmup_steps=4, eval_every=40,
                     checkpoint_every=5, log_every=10, held_out_fraction=0.1, top_k=3,
                     hidden_cache_dir=str(tmp_path / "hidden"))
    cmd = [sys.executable, "-m", "medusa_heads.training"] + [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / "checkpoint-5").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "heads").exists(), "the run finished before it could be killed"
    assert (out / "checkpoint-5" / "trainer.json").exists()
    resumed = train(load_recipe(None, overrides), resume=True)
    assert [h["step"] for h in resumed["history"]] == list(range(6, 15))
    for a, b in zip(full["history"][5:], resumed["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-5)


@pytest.mark.slow  # a training run of half a minute or more
def test_kl_objective_runs_and_learns(tiny_backbone, counting_data, tmp_path):
    result = train(recipe(tiny_backbone, counting_data, tmp_path / "kl", loss="kl", max_steps=20))
    losses = [h["loss"] for h in result["history"]]
    assert losses[-1] < losses[0]


def test_recipe_errors(tmp_path):
    with pytest.raises(MedusaError, match="Unknown recipe key"):
        load_recipe(None, {"lerning_rate": "1e-3"})
    with pytest.raises(MedusaError, match="takes a int"):
        load_recipe(None, {"max_steps": "many"})
    with pytest.raises(MedusaError, match="`loss`"):
        load_recipe(None, {"loss": "mse"})
    with pytest.raises(MedusaError, match="does not exist"):
        load_recipe(tmp_path / "none.yaml")
    assert load_recipe(None, {"learning_rate": "2e-4", "share_lm_head": "false"}).share_lm_head is False


# One bad value (or combination) per field of `TrainConfig`, and the field the error must name.
BAD_VALUES = [
    ("model", {"model": " "}), ("backbone_dtype", {"backbone_dtype": "float8"}), ("data", {"data": ""}),
    ("max_length", {"max_length": 0}), ("held_out_fraction", {"held_out_fraction": 1.0}),
    ("held_out_fraction", {"held_out_fraction": -0.1}), ("eval_data", {"eval_data": ""}),
    ("num_heads", {"num_heads": 0}), ("num_layers", {"num_layers": -1}),
    ("share_lm_head", {"share_lm_head": False, "head_type": "eagle"}), ("head_type", {"head_type": "mamba"}),
    ("draft_vocab_size", {"draft_vocab_size": 0}), ("draft_vocab_coverage", {"draft_vocab_coverage": 0.0}),
    ("draft_vocab_coverage", {"draft_vocab_coverage": 1.5}),
    ("draft_vocab_size", {"draft_vocab_size": 100, "draft_vocab_coverage": 0.9}),
    ("loss", {"loss": "mse"}), ("decay", {"decay": 0.0}), ("decay", {"decay": 1.5}),
    ("loss_weighting", {"loss_weighting": "uniform"}), ("tree", {"loss_weighting": "tree"}), ("tree", {"tree": ""}),
    ("learning_rate", {"learning_rate": 0.0}), ("learning_rate", {"learning_rate": -1e-3}),
    ("weight_decay", {"weight_decay": -0.1}), ("warmup_steps", {"warmup_steps": -1}),
    ("warmup_steps", {"warmup_steps": 60, "max_steps": 40}), ("max_steps", {"max_steps": 0}),
    ("max_minutes", {"max_minutes": 0.0}), ("max_minutes", {"max_minutes": "soon"}),
    ("min_lr_ratio", {"min_lr_ratio": 1.5}), ("batch_size", {"batch_size": 0}), ("length_window", {"length_window": 0}),
    ("gradient_accumulation_steps", {"gradient_accumulation_steps": 0}), ("grad_clip", {"grad_clip": -1.0}),
    ("mixed_precision", {"mixed_precision": "fp8"}),
    ("medusa2", {"medusa2": True, "cache_hidden_states": False, "head_type": "eagle"}),
    ("lora_r", {"lora_r": 0}), ("lora_alpha", {"lora_alpha": 0}), ("lora_dropout", {"lora_dropout": 1.0}),
    ("lora_target_modules", {"lora_target_modules": ""}), ("lora_target_modules", {"lora_target_modules": "q_proj,,v"}),
    ("heads_loss_weight", {"heads_loss_weight": 0.0}), ("heads_warmup_steps", {"heads_warmup_steps": -1}),
    ("cache_hidden_states", {"medusa2": True}), ("hidden_cache_dir", {"hidden_cache_dir": ""}),
    ("output_dir", {"output_dir": ""}), ("checkpoint_every", {"checkpoint_every": 0}),
    ("eval_every", {"eval_every": 0}), ("log_every", {"log_every": 0}), ("top_k", {"top_k": 0}),
    ("top_k", {"top_k": 10, "draft_vocab_size": 5}), ("seed", {"seed": -1}),
    ("deepspeed_config", {"deepspeed_config": ""}),
    ("deepspeed_config", {"medusa2": True, "cache_hidden_states": False, "deepspeed_config": "ds.json"}),
    ("report_to", {"report_to": " "}),
    ("quantize", {"quantize": "fp8"}), ("init_heads", {"init_heads": ""}),
    ("repick_draft_vocab", {"repick_draft_vocab": True, "draft_vocab_size": 10}),
    ("feature_layers", {"feature_layers": "1"}),  # medusa heads read one layer
    ("feature_layers", {"head_type": "eagle3", "share_lm_head": False, "feature_layers": "2,x"}),
    # wrong types, from a recipe, the command line or Python
    ("max_steps", {"max_steps": "many"}), ("max_steps", {"max_steps": 2.5}), ("num_heads", {"num_heads": True}),
    ("share_lm_head", {"share_lm_head": "maybe"}), ("learning_rate", {"learning_rate": None}),
    ("model", {"model": 7}),
]


@pytest.mark.parametrize("field, values", BAD_VALUES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_VALUES)])
def test_each_bad_value_is_a_one_line_error_naming_its_field(field, values):
    with pytest.raises(MedusaError) as err:
        load_recipe(None, values)
    assert re.search(f"`{field}[`:]", str(err.value)), str(err.value)
    assert "\n" not in str(err.value)


def test_every_field_is_checked():
    assert {f.name for f in dataclasses.fields(TrainConfig)} == {field for field, _ in BAD_VALUES}


def test_a_bad_override_on_the_command_line_exits_2_with_one_line(capsys):
    from medusa_heads.training.__main__ import main

    assert main(["--checkpoint_every", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`checkpoint_every` must be at least 1" in err


def test_lr_schedule():
    cfg = load_recipe(None, {"learning_rate": 1.0, "warmup_steps": 10, "max_steps": 110, "min_lr_ratio": 0.1})
    assert get_lr(0, cfg) == pytest.approx(0.1) and get_lr(9, cfg) == pytest.approx(1.0)
    assert get_lr(60, cfg) == pytest.approx(0.55) and get_lr(110, cfg) == pytest.approx(0.1)


def test_a_time_budget_fits_the_steps_to_the_pace():
    cfg = load_recipe(None, {"max_minutes": 10.0, "max_steps": 1000})
    # 20 steps in 60 s: 3 s a step, 540 s left -> 180 more
    assert steps_in_budget(cfg, 20, 20, 60.0, 1000) == 200
    assert steps_in_budget(cfg, 20, 20, 6.0, 1000) == 1000  # never above the recipe's max_steps
    assert steps_in_budget(cfg, 20, 20, 700.0, 1000) == 20  # over the budget: stop at this step


def test_a_run_out_of_time_stops_evaluates_and_saves_with_its_schedule_ended(tiny_backbone, counting_data, tmp_path):
    # a budget of 6 ms has run out when the run first times itself (step 20 of 40)
    cfg = recipe(tiny_backbone, counting_data, tmp_path / "run", max_steps=40, max_minutes=1e-4)
    result = train(cfg)
    assert [h["step"] for h in result["history"]] == list(range(1, 21))
    assert "held_out_top1" in result["history"][-1]  # the last step was evaluated, as a planned last step is
    assert get_lr(20, cfg) == pytest.approx(cfg.learning_rate * cfg.min_lr_ratio)
    assert (tmp_path / "run" / "heads" / "head_accuracies.json").exists()


@pytest.mark.parametrize("window", [1, 3])
def test_processes_take_disjoint_micro_batches_of_one_shared_order(window):
    cfg = load_recipe(None, {"batch_size": 4, "seed": 3, "length_window": window})
    lengths = [(7 * i) % 26 + 1 for i in range(26)]
    order = batch_order(lengths, 4, 0, 3, window)
    assert [micro_batch(cfg, lengths, p, 1, 0) for p in range(6)] == order  # 6 batches an epoch
    for world in (2, 3):
        taken = [i for p in range(6 // world) for rank in range(world)
                 for i in micro_batch(cfg, lengths, p, world, rank)]
        assert len(taken) == len(set(taken)) == 24  # one epoch: every batch once, by one process
    assert micro_batch(cfg, lengths, 3, 2, 0) == batch_order(lengths, 4, 1, 3, window)[0]  # then the next epoch's
    assert batch_order(lengths, 4, 1, 3, window) != order


def test_length_windows_cut_padding_and_keep_batches_random():
    lengths = torch.randint(20, 500, (960,), generator=torch.Generator().manual_seed(0)).tolist()

    def padded(order):  # tokens a step computes: every row padded to its batch's longest
        return sum(len(batch) * max(lengths[i] for i in batch) for batch in order)

    plain, grouped = batch_order(lengths, 8, 0, 1), batch_order(lengths, 8, 0, 1, window=16)
    assert sorted(i for b in grouped for i in b) == list(range(960))
    assert padded(grouped) < 0.75 * padded(plain)
    firsts = [min(lengths[i] for i in batch) for batch in grouped[:10]]
    assert firsts != sorted(firsts)  # the batches themselves are shuffled, not served short to long


@pytest.mark.slow  # a training run of half a minute or more
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_runs_on_cpu_and_resumes(tiny_backbone, counting_data, tmp_path, stage):
    """In a subprocess (DeepSpeed sets up torch.distributed, which would leak into later tests)."""
    out = tmp_path / f"zero{stage}"
    overrides = dict(model=str(tiny_backbone), backbone_dtype="float32", data=str(counting_data), output_dir=str(out),
                     num_heads=2, max_steps=6, batch_size=8, learning_rate=1e-2, warmup_steps=2, eval_every=6,
                     checkpoint_every=3, held_out_fraction=0.1, top_k=3, share_lm_head=False,
                     deepspeed_config=f"configs/deepspeed/zero{stage}.json", hidden_cache_dir=str(tmp_path / "hidden"))
    args = [a for k, v in overrides.items() for a in (f"--{k}", str(v))]
    first = subprocess.run([sys.executable, "-m", "medusa_heads.training", *args], capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "world size 1 (process 0)" in first.stderr and f"DeepSpeed ZeRO-{stage}" in first.stderr
    history = json.loads((out / "history.json").read_text())
    assert len(history) == 6 and all(h["loss"] == h["loss"] for h in history)
    assert history[-1]["loss"] < history[0]["loss"]
    assert load_heads(out / "heads").config.num_heads == 2
    # resume from checkpoint-3 of a longer run: DeepSpeed's own checkpoint format round-trips
    resumed = subprocess.run([sys.executable, "-m", "medusa_heads.training", *args, "--max_steps", "9", "--resume"],
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "at step 6" in resumed.stderr
    assert len(json.loads((out / "history.json").read_text())) == 3


@pytest.mark.slow  # a training run of half a minute or more
def test_medusa2_trains_adapters_and_keeps_the_backbone_close(tiny_backbone, counting_data, tmp_path, tokenizer):
    from medusa_heads import MedusaModel, load_backbone
    from medusa_heads.inference.generate import encode_prompt

    out = tmp_path / "m2"
    result = train(recipe(tiny_backbone, counting_data, out, medusa2=True, cache_hidden_states=False, max_steps=16,
                          heads_warmup_steps=4, share_lm_head=False, lora_r=4, learning_rate=3e-3))
    assert all(h["loss"] == h["loss"] for h in result["history"])
    assert (out / "heads" / "adapter" / "adapter_config.json").exists()
    assert not any("lora" in k for k in json.loads((out / "heads" / "config.json").read_text()))
    original = load_backbone(str(tiny_backbone))
    adapted = MedusaModel.from_pretrained(out / "heads").backbone
    q_before = original.model.layers[0].self_attn.q_proj.weight
    q_after = adapted.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q_before, q_after), "the adapter was not applied"
    # Closeness on the original's own greedy continuations, teacher-forced (a random tiny model is full of
    # near ties, so free-running greedy text would diverge at the first flipped tie and say little).
    agree = total = 0
    kls = []
    for prompt in ["Count from 3.", "Count from 17.", "Count from 40."]:
        ids = encode_prompt(tokenizer, prompt)
        seq = original.generate(ids, do_sample=False, max_new_tokens=16)
        with torch.no_grad():
            a, b = original(seq).logits[0, ids.shape[1] - 1 : -1], adapted(seq).logits[0, ids.shape[1] - 1 : -1]
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        kls.append(float(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                                    reduction="batchmean")))
    # measured here: 14/17 on one prompt, KL about 0.04
    assert agree / total >= 0.7, f"top-1 agreement with the original backbone {agree}/{total}"
    assert max(kls) < 0.2, kls


def test_medusa2_needs_live_hidden_states():
    with pytest.raises(MedusaError, match="cache_hidden_states"):
        load_recipe(None, {"medusa2": True})


def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tiny_backbone, counting_data, tmp_path):
    out = tmp_path / "nan"
    with pytest.raises(MedusaError, match=r"The loss became (nan|inf).*checkpoint-\d+"):
        train(recipe(tiny_backbone, counting_data, out, learning_rate=1e30, warmup_steps=1, checkpoint_every=1,
                     max_steps=30, share_lm_head=False))
    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert json.loads((last / "trainer.json").read_text())["step"] >= 1
    assert not (out / "heads").exists()


def test_shipped_recipes_and_deepspeed_configs_are_valid():
    from pathlib import Path

    configs = Path(__file__).parent.parent / "configs"
    recipes = sorted(configs.glob("*.yaml"))
    assert {"smollm2-135m", "smollm2-135m-medusa2", "llama-7b-1gpu", "llama-7b-8gpu-zero2",
            "llama-7b-8gpu-zero3"} <= {p.stem for p in recipes}
    for path in recipes:
        cfg = load_recipe(path)
        if cfg.deepspeed_config:
            ds = json.loads((configs.parent / cfg.deepspeed_config).read_text())
            assert ds["zero_optimization"]["stage"] in (2, 3)


@pytest.fixture(scope="module")
def pairs_data(tmp_path_factory):
    """Answers of random words, each said twice: the token after next is known only to heads that read the
    next token (Hydra); from the hidden state alone it is a guess among 16 words."""
    rng = random.Random(0)
    words = "cat dog sun tree car book fish bird milk rain door road lamp king ship song".split()
    rows = []
    for _ in range(160):
        answer = " ".join(w for w in rng.choices(words, k=14) for _ in range(2))
        rows.append({"messages": [{"role": "user", "content": "Say words twice."},
                                  {"role": "assistant", "content": answer}]})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_hydra_heads_use_the_path_and_train_on_a_draft_vocabulary(tiny_backbone, pairs_data, tmp_path):
    common = dict(num_heads=1, max_steps=60, held_out_fraction=0.15, draft_vocab_coverage=0.99, eval_every=60)
    train(recipe(tiny_backbone, pairs_data, tmp_path / "medusa", **common))
    train(recipe(tiny_backbone, pairs_data, tmp_path / "hydra", head_type="hydra", **common))
    medusa = json.loads((tmp_path / "medusa" / "heads" / "head_accuracies.json").read_text())["top1"][0]
    hydra = json.loads((tmp_path / "hydra" / "heads" / "head_accuracies.json").read_text())["top1"][0]
    # Half the positions are a second word (a copy of the next token): only Hydra can know them (measured after
    # 60 steps: 0.04 for Medusa, 0.37 for Hydra; a chance guess among 16 words is 0.06).
    assert medusa < 0.15 and hydra > 0.25, (medusa, hydra)
    heads = load_heads(tmp_path / "hydra" / "heads")
    assert heads.config.head_type == "hydra" and 16 <= heads.config.draft_vocab_size < 100


@pytest.mark.slow  # a training run of half a minute or more
def test_acceptance_weighting_trains(tiny_backbone, counting_data, tmp_path):
    result = train(recipe(tiny_backbone, counting_data, tmp_path / "run", loss_weighting="acceptance",
                          head_type="hydra", share_lm_head=False))
    losses = [h["loss"] for h in result["history"]]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


@pytest.mark.slow  # a training run of half a minute or more
def test_tree_path_loss_trains_and_reports_the_accepted_length(tiny_backbone, counting_data, tmp_path):
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([[0], [1], [0, 0], [0, 1], [1, 0]]))
    result = train(recipe(tiny_backbone, counting_data, tmp_path / "run", loss_weighting="tree", tree=str(tree),
                          share_lm_head=False, length_window=1))  # a plain shuffle: batches of like length
    # hold like numbers here, and the five first and last steps' losses would compare batches of unlike difficulty
    losses = [h["loss"] for h in result["history"]]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    acc = result["accuracies"]
    # Replayed verification: at least the bonus token, at most the tree's depth + 1; trained heads accept.
    assert acc["tree"] == str(tree) and 1.2 < acc["tree_accepted_length"] <= 3
    with pytest.raises(MedusaError, match="needs `tree`"):
        recipe(tiny_backbone, counting_data, tmp_path / "bad", loss_weighting="tree")


def test_eval_data_is_the_held_out_set(tiny_backbone, counting_data, tmp_path):
    """With `eval_data`, every conversation of `data` trains and accuracy is measured on the other file only:
    two runs on different training data count the same held-out positions. The held-out conversations that also
    train are read from the training set's cache; the others get a cache shard of their own."""
    rows = counting_data.read_text().splitlines()
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[:8]) + "\n")
    (tmp_path / "train.jsonl").write_text("\n".join(rows[8:]) + "\n")
    positions = []
    for name, data in (("all", counting_data), ("rest", tmp_path / "train.jsonl")):
        out = tmp_path / name
        result = train(recipe(tiny_backbone, data, out, eval_data=str(tmp_path / "eval.jsonl"), max_steps=2,
                              warmup_steps=1, eval_every=2, held_out_fraction=0.5,
                              hidden_cache_dir=str(out / "hidden")))
        positions.append(result["accuracies"]["positions"])
        assert len(list((out / "hidden").glob("*.safetensors"))) == (1 if name == "all" else 2)
    assert positions[0] == positions[1] and min(positions[0]) > 8 * 10


def test_eagle_drafter_trains_on_the_context_and_decodes_exactly(tiny_backbone, pairs_data, tmp_path, tokenizer):
    """The same pairs: an EAGLE drafter reads the next token too, so it learns the copies; unrolled two deep,
    saved, loaded by `MedusaModel.from_pretrained` and decoding exactly like the backbone."""
    from medusa_heads import MedusaModel
    from medusa_heads.apps.calibrate import load_calibration
    from medusa_heads.eagle import EagleHead
    from medusa_heads.inference.drafters.eagle import EagleDrafter
    from medusa_heads.inference.generate import encode_prompt
    from medusa_heads.tree import build_tree

    from oracle import decode, hf_greedy

    train(recipe(tiny_backbone, pairs_data, tmp_path / "eagle", head_type="eagle", num_heads=2, max_steps=60,
                 held_out_fraction=0.15, draft_vocab_coverage=0.99, eval_every=60))
    top1 = json.loads((tmp_path / "eagle" / "heads" / "head_accuracies.json").read_text())["top1"]
    assert top1[0] > 0.25, top1  # Medusa heads: 0.04 on the same data (the Hydra test above)
    calibration = load_calibration(tmp_path / "eagle" / "heads" / "head_accuracies.json")  # for `tree optimize`
    assert len(calibration.p) == 2 and calibration.p[0][0] == pytest.approx(top1[0])
    model = MedusaModel.from_pretrained(tmp_path / "eagle" / "heads")
    assert isinstance(model.heads, EagleHead) and model.config.draft_vocab_size < 100
    ids = encode_prompt(tokenizer, "Say words twice.")
    drafter = EagleDrafter(model, build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0)]))
    assert decode(model, ids, drafter, max_new_tokens=40) == hf_greedy(model.backbone, ids, 40)
