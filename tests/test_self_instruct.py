"""Data beyond the shipped templates: prompts the backbone writes itself, second turns, sampled answers."""

import json
from pathlib import Path

import pytest
import torch

from medusa_heads import MedusaError
from medusa_heads.backbone import EMBEDDED_MODEL
from medusa_heads.training.data import load_examples
from medusa_heads.training.distill import distill, read_prompts
from medusa_heads.training.prompt_set import SHIPPED, shingles
from medusa_heads.training.self_instruct import FOLLOW_UPS, Novelty, follow_ups, listed_items, self_instruct

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts.jsonl"


def bench_prompts() -> list[str]:
    return [json.loads(line)["prompt"] for line in BENCH.read_text().splitlines() if line.strip()]


def test_the_seed_prompts_are_installed_with_the_package():
    """A wheel, not only an editable install, holds the shipped prompts that `self-instruct` starts from."""
    import tomllib
    from fnmatch import fnmatch

    import medusa_heads.training

    setuptools = tomllib.loads((BENCH.parent.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = "medusa_heads.training." + SHIPPED.parent.name  # the folder it lies in, a package of data
    globs = setuptools["package-data"].get(package, [])
    folder = Path(medusa_heads.training.__file__).parent / SHIPPED.parent.name
    assert package in setuptools["packages"] and any(fnmatch(str(SHIPPED.relative_to(folder)), g) for g in globs)


def test_listed_items_keeps_complete_items_of_fitting_length():
    text = (" Write a poem about the sea at night.\n6. Explain how a lock works, step by step.\n7. Hi there.\n"
            "Not an item but a line of text.\n8. Describe a day in the life of a")
    assert listed_items(text) == ["Write a poem about the sea at night.", "Explain how a lock works, step by step."]
    assert listed_items("a line with no end") == []


def test_novelty_drops_near_copies_and_anything_sharing_four_words_with_the_excluded():
    novelty = Novelty(["Write a short essay about growing tomatoes."], ["Explain how a rainbow forms in the sky."])
    assert not novelty.admit("Write a short essay about growing tomatoes on a balcony.")  # mostly seen
    assert not novelty.admit("Tell me, explain how a rainbow forms after rain.")  # 4 words of the benchmark
    assert novelty.admit("Describe the life cycle of a monarch butterfly.")
    assert not novelty.admit("Describe the life cycle of a monarch butterfly!")  # now it is seen
    assert not novelty.admit("Too short.")


def test_follow_ups_never_overlap_the_benchmark():
    banned = set().union(*(shingles(p) for p in bench_prompts()))
    assert all(not shingles(f) & banned for f in FOLLOW_UPS)


def test_follow_ups_make_two_turn_conversations_distill_answers(tmp_path, tokenizer):
    answers = tmp_path / "answers.jsonl"
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}],
             "answer_ids": [5, 2]} for i in range(40)]
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "turn2.jsonl"
    made = follow_ups(answers, out, share=0.5, seed=1)
    conversations = read_prompts(out)
    assert 10 < made == len(conversations) < 30
    for c in conversations:
        n = int(c["id"].removesuffix("-turn2"))
        assert c["messages"][:2] == rows[n]["messages"] and c["messages"][2]["content"] in FOLLOW_UPS
    with pytest.raises(MedusaError, match="`share` must be in"):
        follow_ups(answers, out, share=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": rows[0]["messages"]}) + "\n")
    with pytest.raises(MedusaError, match="must end with a user turn"):
        read_prompts(bad)


def test_self_instruct_writes_new_prompts_off_the_benchmark_and_resumes(tmp_path):
    """The real backbone continues lists of shipped prompts: what it keeps is new, off the benchmark, and a second
    run tops the file up to the new count without repeating ids."""
    out = tmp_path / "self.jsonl"
    assert self_instruct(out, 6, exclude=BENCH, batch_size=4, max_new_tokens=64) == 6
    assert self_instruct(out, 10, exclude=BENCH, batch_size=4, max_new_tokens=64) == 4
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"self-{i}" for i in range(10)]
    shipped = {json.loads(line)["prompt"] for line in SHIPPED.read_text().splitlines()}
    banned = set().union(*(shingles(p) for p in bench_prompts()))
    for row in rows:
        assert row["prompt"] not in shipped and not shingles(row["prompt"]) & banned
        assert 5 <= len(row["prompt"].split()) <= 60
    assert len({r["prompt"] for r in rows}) == 10


def test_distilled_second_turns_are_the_backbone_s_greedy_answers(tmp_path, backbone, tokenizer):
    """A two-turn conversation is answered with the backbone's own greedy tokens for the whole context, and the
    trainer reads it back with the loss on the last answer's exact ids."""
    prompts = tmp_path / "turn2.jsonl"
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "An apple."},
                {"role": "user", "content": "Can you make that shorter?"}]
    prompts.write_text(json.dumps({"id": "a-turn2", "messages": messages}) + "\n")
    out = tmp_path / "answers.jsonl"
    distill(prompts, out, model=EMBEDDED_MODEL, max_new_tokens=12, dtype="float32")
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        reference = backbone.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert row["answer_ids"] == reference[: reference.index(eos) + 1 if eos in reference else None]
    assert row["messages"][:3] == messages and row["messages"][3]["role"] == "assistant"
    (example,) = load_examples(str(out), tokenizer, 512)
    assert [t for t, m in zip(example.input_ids, example.loss_mask) if m] == row["answer_ids"]


def test_the_committed_data_stays_off_the_benchmark_and_its_held_out_prompts_off_training():
    data = SHIPPED.parent
    bench = set().union(*(shingles(p) for p in bench_prompts()))
    written = [json.loads(line)["prompt"] for line in (data / "self_instruct_prompts.jsonl").read_text().splitlines()]
    assert len(written) == len(set(written)) >= 2600
    assert not [p for p in written if shingles(p) & bench]

    def user_turns(folder: Path) -> set[str]:
        return {m["content"] for f in folder.glob("*.jsonl") for line in f.read_text().splitlines()
                for m in json.loads(line)["messages"] if m["role"] == "user"}

    trained, held_out = user_turns(data / "mix"), user_turns(data / "dev")
    assert held_out and not trained & held_out
    assert not [p for p in trained | held_out if shingles(p) & bench]
