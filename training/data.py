"""Training data: conversations -> token ids with a mask that is 1 on assistant tokens only."""

import logging
from dataclasses import dataclass
from pathlib import Path

from medusa_heads.backbone import first_line
from medusa_heads.errors import MedusaError

logger = logging.getLogger(__name__)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Example:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the token is the assistant's


def load_rows(source: str, split: str = "train") -> list[dict]:
    """A local jsonl/json/parquet file (or folder of them) or a hub dataset name, through `datasets`."""
    import datasets

    path = Path(source)
    try:
        if path.exists():
            files = sorted(str(p) for p in path.glob("*") if p.suffix in {".jsonl", ".json", ".parquet"}) \
                if path.is_dir() else [str(path)]
            if not files:
                raise MedusaError(f"`{source}` holds no .jsonl, .json or .parquet files.")
            kind = "parquet" if files[0].endswith(".parquet") else "json"
            data = datasets.load_dataset(kind, data_files=files, split="train")
        else:
            data = datasets.load_dataset(source, split=split)
    except MedusaError:
        raise
    except Exception as err:  # datasets raises many types (FileNotFoundError, DatasetNotFoundError, ArrowInvalid...)
        raise MedusaError(f"Cannot load training data `{source}`: {first_line(err)}") from err
    if len(data) == 0:
        raise MedusaError(f"Training data `{source}` is empty.")
    return list(data)


def to_messages(row: dict) -> list[dict] | None:
    """OpenAI `messages`, ShareGPT `conversations` -> [{role, content}]; None for plain `text` rows."""
    if "messages" in row:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    if "conversations" in row:
        turns = []
        for m in row["conversations"]:
            if m.get("from") not in SHAREGPT_ROLES:
                raise MedusaError(f"ShareGPT turn with unknown `from`: {m.get('from')!r}.")
            turns.append({"role": SHAREGPT_ROLES[m["from"]], "content": m["value"]})
        return turns
    if "text" in row:
        return None
    raise MedusaError(f"A data row has none of `messages`, `conversations` or `text` (its fields: {sorted(row)}).")


def tokenize_row(row: dict, tokenizer) -> Example:
    messages = to_messages(row)
    if messages is None:
        ids = tokenizer(row["text"])["input_ids"]
        return Example(ids, [1] * len(ids))
    if "answer_ids" in row and messages[-1]["role"] == "assistant":
        # Self-distilled rows keep the backbone's exact tokens instead of a re-tokenization of its text.
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        answer = list(row["answer_ids"])
        return Example(list(prompt) + answer, [0] * len(prompt) + [1] * len(answer))
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"] if i else []
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=True)["input_ids"]
        if list(upto[: len(before)]) != list(before) or list(before[: len(ids)]) != ids:
            raise MedusaError("The chat template does not render conversations prefix by prefix; use `text` rows.")
        mask += [0] * (len(before) - len(ids)) + [1] * (len(upto) - len(before))
        ids = list(upto)
    return Example(ids, mask)


def assistant_spans(example: Example) -> list[list[int]]:
    """The example's assistant turns: each maximal run of tokens with loss_mask 1."""
    spans, current = [], []
    for token, keep in zip(example.input_ids, example.loss_mask):
        if keep:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def load_examples(source: str, tokenizer, max_length: int) -> list[Example]:
    rows = load_rows(source)
    examples, truncated = [], 0
    for row in rows:
        ex = tokenize_row(row, tokenizer)
        if len(ex.input_ids) > max_length:
            truncated += 1
            ex = Example(ex.input_ids[:max_length], ex.loss_mask[:max_length])
        if sum(ex.loss_mask) > 0:
            examples.append(ex)
    if truncated:
        logger.info("truncated %d of %d conversations to max_length=%d tokens", truncated, len(rows), max_length)
    if not examples:
        raise MedusaError(f"Training data `{source}` has no assistant tokens to train on.")
    logger.info("%d conversations, %d tokens, %d assistant tokens", len(examples),
                sum(len(e.input_ids) for e in examples), sum(sum(e.loss_mask) for e in examples))
    return examples
