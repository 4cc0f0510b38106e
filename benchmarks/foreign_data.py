"""A foreign (human-written) chat dataset, to compare heads trained on it with heads trained on the backbone's
own answers (self-distillation) at the same size.

    python benchmarks/foreign_data.py --out runs/foreign/python_docs.jsonl --tokens 120000 \
        --matched-from runs/distill/smollm2_greedy.jsonl --matched-out runs/foreign/self_distilled.jsonl \
        --eval-out runs/foreign/eval.jsonl

No chat dataset can be downloaded here, so the foreign answers are the human-written documentation that ships
with Python itself: each stdlib function, class or module with a docstring of a few sentences becomes a
conversation "What does `name` do in Python?" -> its docstring; the language reference topics
(`pydoc_data.topics`) become "Explain `topic` in Python." -> the topic's text. These answers are fluent English
written by people, in the OpenAI `messages` format the trainer reads; they are not what the backbone would say.
"""

import argparse
import importlib
import inspect
import json
import pkgutil
import random
import sys
import warnings
from pathlib import Path

import pydoc_data.topics

MIN_CHARS, MAX_CHARS = 300, 2400


def _conversation(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def docstring_conversations() -> list[dict]:
    rows = []
    names = sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names
                   and not m.name.startswith("_") and m.name not in ("antigravity", "this", "idlelib", "turtledemo"))
    for module_name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except Exception:  # platform-specific modules that do not import here
                continue
        objects = [(module_name, module)] + [(f"{module_name}.{n}", o) for n, o in vars(module).items()
                                             if not n.startswith("_") and getattr(o, "__module__", None) == module_name]
        for name, obj in objects:
            doc = inspect.getdoc(obj) or ""
            if MIN_CHARS <= len(doc) <= MAX_CHARS:
                rows.append(_conversation(f"What does `{name}` do in Python?", doc))
    return rows


def topic_conversations() -> list[dict]:
    return [_conversation(f"Explain `{name}` in Python.", text.strip()[:MAX_CHARS])
            for name, text in sorted(pydoc_data.topics.topics.items()) if len(text) >= MIN_CHARS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=120_000, help="stop at about this many answer tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--matched-from", help="the backbone's own answers (jsonl): also write their first rows "
                        "holding as many answer tokens, to --matched-out")
    parser.add_argument("--matched-out")
    parser.add_argument("--eval-out", help="and the last --eval-rows of them (shuffled), never in --matched-out")
    parser.add_argument("--eval-rows", type=int, default=160)
    args = parser.parse_args()

    from medusa_heads.backbone import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-embedded")
    rows = docstring_conversations() + topic_conversations()
    random.Random(args.seed).shuffle(rows)
    total = write_prefix(rows, tokenizer, args.tokens, args.out)
    if args.matched_from:
        with open(args.matched_from) as f:
            own = [json.loads(line) for line in f if line.strip()]
        random.Random(args.seed).shuffle(own)  # the file is ordered by how the prompts were answered
        held_out, own = own[-args.eval_rows:], own[: -args.eval_rows]
        write_prefix(own, tokenizer, total, args.matched_out)
        if args.eval_out:
            write_prefix(held_out, tokenizer, float("inf"), args.eval_out)


def write_prefix(rows: list[dict], tokenizer, tokens: float, out: str) -> int:
    """Write the first rows holding about `tokens` answer tokens; -> the answer tokens written."""
    kept, total = [], 0
    for row in rows:
        if total >= tokens:
            break
        kept.append(row)
        total += sum(len(tokenizer(m["content"])["input_ids"]) for m in row["messages"] if m["role"] == "assistant")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    print(f"{len(kept)} conversations ({len(rows)} available), {total} answer tokens -> {out}")
    return total


if __name__ == "__main__":
    main()
