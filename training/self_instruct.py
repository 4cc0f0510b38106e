"""Prompts the backbone writes itself (self-instruct) and second turns, for data beyond the shipped templates.

The shipped prompt set (`prompt_set.py`) is templates crossed with topics, and drafters trained on its answers
guess worse on other prompts. `medusa-heads self-instruct` shows the backbone, as plain text to continue (a
135M chat model does not follow "write a new request" instructions, but it continues a numbered list well),
four requests of different categories drawn from the shipped set and keeps the new items it adds. An item is
kept when it is one line of 5 to 60 words, when fewer than half of its 4-word sequences were already seen in
the shipped prompts or in items kept before (near copies out), and when it shares no 4-word sequence with the
prompts of `exclude` (the benchmark, as the shipped set). It appends as it goes and resumes.

`medusa-heads follow-ups ANSWERS.jsonl --out PROMPTS.jsonl` turns distilled one-turn answers into two-turn
conversations ending in a follow-up request, for `distill` to answer.
"""

import json
import logging
import random
import re
from pathlib import Path

import torch
from tqdm import tqdm

from medusa_heads.backbone import EMBEDDED_MODEL
from medusa_heads.errors import MedusaError, read_jsonl
from medusa_heads.training.distill import Writer, append_rows, done_ids
from medusa_heads.training.prompt_set import SHIPPED, shingles

logger = logging.getLogger(__name__)

LIST_HEAD = "A list of varied questions and requests that people sent to an AI assistant:\n"
SHOWN = 4  # requests shown per list; the backbone continues from item SHOWN + 1
PATIENCE = 20  # batches in a row that add nothing before giving up

# Second turns: what people ask after a first answer (written for this project, checked against the benchmark
# prompts like everything else).
FOLLOW_UPS = [
    "Can you make that shorter?", "Please explain that in simpler words.", "Give me a concrete example.",
    "Can you turn that into a bulleted list?", "What is the most important point, and why?",
    "Rewrite it in a more formal tone.", "Rewrite it so that a child could understand it.",
    "Can you add a short summary at the end?", "What would a critic say about this?", "Thanks! Can you say more about the first point?",
    "Is there anything you left out?", "How would you explain this to a beginner?", "Make it funnier.",
    "Can you give three alternatives?", "Now write the same thing as a short poem.",
    "What are the common mistakes people make here?", "Can you check your answer and correct any errors?",
    "Translate the main idea into one sentence.", "Why does that work?", "What should I do first?",
    "Give me a step by step version.", "Can you write that as a table?", "That is too long. Keep only the key ideas.",
    "What is a good next step after this?", "Can you give me a real world use for this?",
]


class Novelty:
    """The 4-word sequences seen so far and the banned ones; `admit` keeps a text under half of whose were seen."""

    def __init__(self, seen_texts: list[str], banned_texts: list[str]):
        self.seen = set().union(*(shingles(t) for t in seen_texts)) if seen_texts else set()
        self.banned = set().union(*(shingles(t) for t in banned_texts)) if banned_texts else set()

    def admit(self, text: str) -> bool:
        """True (and remember its sequences) when `text` is new and shares nothing with the banned texts."""
        own = shingles(text)
        if not own or own & self.banned or len(own & self.seen) * 2 >= len(own):
            return False
        self.seen |= own
        return True


def listed_items(continuation: str) -> list[str]:
    """The complete numbered items of a continuation (the first is the one the list left open)."""
    lines = continuation.split("\n")[:-1]  # the last line may be cut off
    items = [lines[0]] + [re.sub(r"^\d+\.", "", line, count=1) for line in lines[1:] if re.match(r"^\d+\. ", line)] \
        if lines else []
    return [item.strip() for item in items if 5 <= len(item.split()) <= 60]


def self_instruct(out: Path, count: int, model: str = EMBEDDED_MODEL, exclude: Path | None = None,
                  seeds: Path = SHIPPED, batch_size: int = 32, max_new_tokens: int = 96, temperature: float = 1.0,
                  top_p: float = 0.95, seed: int = 0, dtype: str = "auto", device: str = "cpu") -> int:
    """Append prompts to `out` until it holds `count`; returns how many were added."""
    seed_rows = [row for _, row in read_jsonl(seeds, "Seed prompt file", "prompt", str)]
    banned = [row["prompt"] for _, row in read_jsonl(exclude, "Excluded prompt file", "prompt", str)] \
        if exclude else []
    kept = [row["prompt"] for _, row in read_jsonl(out, "Prompt file", "prompt", str, partial_last_line=True)] \
        if out.exists() else []
    done_ids(out)  # drops a line cut short by a kill
    novelty = Novelty([r["prompt"] for r in seed_rows] + kept, banned)
    if len(kept) >= count:
        return 0
    by_category: dict[str, list[str]] = {}
    for row in seed_rows:
        by_category.setdefault(row.get("category", "any"), []).append(row["prompt"])
    categories = sorted(by_category)
    rng = random.Random(f"{seed}-{len(kept)}")  # a resumed run draws other lists
    torch.manual_seed(seed + len(kept))
    writer = Writer(model, dtype, device)
    added, tried, barren = 0, 0, 0
    bar = tqdm(total=count, initial=len(kept), desc="self-instruct", unit="prompt")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        while len(kept) < count:
            texts = []
            for _ in range(batch_size):
                shown = [rng.choice(by_category[c]) for c in rng.sample(categories, min(SHOWN, len(categories)))]
                texts.append(LIST_HEAD + "".join(f"{i + 1}. {p}\n" for i, p in enumerate(shown)) + f"{len(shown) + 1}.")
            rows = []
            for ids in writer.continue_texts(texts, max_new_tokens, temperature, top_p):
                tried += 1
                for item in listed_items(writer.tokenizer.decode(ids, skip_special_tokens=True)):
                    if len(kept) < count and novelty.admit(item):
                        kept.append(item)
                        rows.append({"id": f"self-{len(kept) - 1}", "category": "self-instruct", "prompt": item})
            append_rows(f, rows)
            added += len(rows)
            barren = 0 if rows else barren + 1
            if barren == PATIENCE:
                raise MedusaError(f"The backbone wrote no new usable prompt in {PATIENCE * batch_size} lists; "
                                  f"{out} holds {len(kept)}.")
            bar.update(len(rows))
            bar.set_postfix(per_list=f"{added / tried:.2f}")
    bar.close()
    logger.info("added %d prompts to %s (%d lists continued)", added, out, tried)
    return added


def follow_ups(answers: Path, out: Path, share: float = 1.0, seed: int = 0) -> int:
    """Write two-turn conversations (first turn and its answer, then a follow-up) for `share` of the answers."""
    rows = [row for _, row in read_jsonl(answers, "Answer file", "messages", list)]
    if not 0 < share <= 1:
        raise MedusaError(f"`share` must be in (0, 1], got {share}.")
    rng = random.Random(seed)
    picked = [row for row in rows if len(row["messages"]) == 2 and rng.random() < share]
    conversations = [{"id": f"{row['id']}-turn2", "messages": row["messages"] + [
        {"role": "user", "content": rng.choice(FOLLOW_UPS)}]} for row in picked]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    logger.info("wrote %d two-turn conversations to %s", len(conversations), out)
    return len(conversations)
