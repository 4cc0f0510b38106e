import json

import pytest

from medusa_heads import MedusaError
from medusa_heads.training.data import load_examples, tokenize_row


def test_assistant_only_mask_openai_and_sharegpt_agree(tokenizer):
    openai = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                           {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "See you"}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there"},
                                  {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "See you"}]}
    a, b = tokenize_row(openai, tokenizer), tokenize_row(sharegpt, tokenizer)
    assert a == b
    full = tokenizer.apply_chat_template(openai["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert a.input_ids == list(full)
    trained = tokenizer.decode([t for t, m in zip(a.input_ids, a.loss_mask) if m])
    assert "Hello there" in trained and "See you" in trained and "Hi" not in trained and "Bye" not in trained


def test_distilled_rows_keep_exact_answer_ids(tokenizer):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}],
           "answer_ids": [5, 6, 7, 2]}
    ex = tokenize_row(row, tokenizer)
    assert ex.input_ids[-4:] == [5, 6, 7, 2] and ex.loss_mask[-4:] == [1] * 4 and sum(ex.loss_mask) == 4


def test_bad_data_is_a_clear_error(tmp_path, tokenizer):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(MedusaError):
        load_examples(str(empty), tokenizer, 64)
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(MedusaError, match="none of `messages`"):
        load_examples(str(odd), tokenizer, 64)
    no_assistant = tmp_path / "user_only.jsonl"
    no_assistant.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    with pytest.raises(MedusaError, match="no assistant tokens"):
        load_examples(str(no_assistant), tokenizer, 64)
    with pytest.raises(MedusaError, match="Cannot load training data"):
        load_examples(str(tmp_path / "missing.jsonl"), tokenizer, 64)


def test_truncation(tmp_path, tokenizer):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "one two three four five six seven eight nine ten"}) + "\n")
    (ex,) = load_examples(str(data), tokenizer, 4)
    assert len(ex.input_ids) == 4
