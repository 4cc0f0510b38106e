"""What a reduced draft vocabulary costs in coverage and saves in time, side by side in one process.

    python benchmarks/draft_vocab.py --heads runs/smollm2-135m-hydra/heads --answers held_out.jsonl

Coverage: the share of the backbone's own answer tokens (a jsonl of OpenAI `messages`, conversations the heads
did not train on) that the heads' draft vocabulary contains; a token outside it can never be drafted.
Time: filling the tree's candidates with the same heads projecting onto the full vocabulary or onto the draft
vocabulary, interleaved, medians; and one plain decoding step of the backbone for scale.
"""

import argparse
import json
import statistics
import time

import torch

from medusa_heads import MedusaModel
from medusa_heads.backbone import load_tokenizer
from medusa_heads.inference import DecodeState, MedusaDrafter
from medusa_heads.inference.cache import TreeCache
from medusa_heads.inference.generate import prefill, verify
from medusa_heads.model import load_heads
from medusa_heads.tree import build_tree, canonical_tree, load_tree


def coverage(vocab: torch.Tensor, vocab_size: int, answers: list[list[int]]) -> float:
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab] = True
    return float(inside[torch.tensor([t for a in answers for t in a])].float().mean())


def full_vocab_copy(heads):
    """The same heads projecting onto the whole vocabulary (shared LM head, no draft vocabulary)."""
    config = heads.config.to_dict() | {"draft_vocab_size": None}
    config.pop("transformers_version", None)
    full = type(heads)(type(heads.config)(**config))
    full.load_state_dict({k: v for k, v in heads.state_dict().items() if k != "draft_vocab"})
    return full.to(dtype=heads.dtype).eval()


def time_fill(drafter, state, tree, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        drafter.fill(state, tree)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="heads saved with a draft vocabulary")
    parser.add_argument("--answers", required=True, help="jsonl of conversations the heads did not train on")
    parser.add_argument("--tree", default="cpu-16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    heads = load_heads(args.heads)
    if heads.draft_vocab is None:
        parser.error(f"{args.heads} has no draft vocabulary")
    reduced = MedusaModel.from_pretrained(args.heads, dtype=args.dtype)
    full = MedusaModel(reduced.backbone, full_vocab_copy(reduced.heads))
    tokenizer = load_tokenizer(reduced.config.base_model_name_or_path)
    answers = [tokenizer(json.loads(line)["messages"][-1]["content"])["input_ids"] for line in open(args.answers)]

    tree = build_tree(load_tree(args.tree))
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 20, return_tensors="pt")["input_ids"]
    cache = TreeCache(reduced.backbone, 1, prompt.shape[1] + 1)
    logits, hidden = (x[0] for x in prefill(reduced, prompt.tolist(), cache))
    state = DecodeState(prompt[0].tolist() + [int(logits.argmax())], int(logits.argmax()), hidden[-1])
    drafters = {"full": MedusaDrafter(full, tree), "draft": MedusaDrafter(reduced, tree)}
    times = {name: [] for name in drafters}
    for _ in range(3):  # interleaved rounds after a warm-up
        for name, drafter in drafters.items():
            time_fill(drafter, state, tree, 3)
            times[name] += time_fill(drafter, state, tree, args.repeats)
    step = []
    with torch.no_grad():
        for _ in range(args.repeats):
            start = time.perf_counter()
            verify(reduced, canonical_tree(()), torch.tensor([[state.root]]), cache)  # written, never committed
            step.append(time.perf_counter() - start)
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    report = {
        "heads": args.heads, "tree": args.tree, "tree_nodes": tree.size, "dtype": args.dtype,
        "draft_vocab_size": int(heads.draft_vocab.numel()), "vocab_size": heads.config.vocab_size,
        "answer_tokens": sum(map(len, answers)), "coverage": coverage(heads.draft_vocab, heads.config.vocab_size, answers),
        "fill_ms_full_vocab": ms["full"], "fill_ms_draft_vocab": ms["draft"],
        "plain_step_ms": 1000 * statistics.median(step),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
