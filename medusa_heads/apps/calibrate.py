r"""
Calibration: how often each head's guess of each rank is accepted, given that its parent was.

An offline tree-fitting tool (`medusa-heads tree optimize`), not part of the runtime.
The data are the backbone's own answers (self-distilled conversations), never the benchmark prompts. One
backbone forward per conversation gives, at every position, the last hidden state and the greedy token
after it. Each answer position t is then the root of a simulated step (hidden state at t - 1, root token
x_t), and the true path is walked by teacher forcing: the head at depth d + 1 is asked, through
`MedusaModel.head_topk` with the true tokens x_t..x_{t+d} as the path (so path-conditioned heads work too),
for its top-k after x_{t+d}; it is counted only while every ancestor's truth was among its head's top-k.
The heads are asked once per depth for all the walks of a conversation: on a CPU a call costs about one
read of the vocabulary projection, whether it scores one path or hundreds. A drafter over the context (EAGLE,
EAGLE-3) is walked root by root through the runtime's own `EagleDrafter`, its cache grown as decoding grows it.
`p[d][r] = hits[d][r] / positions[d]` is then P(the rank-r child is accepted | its parent was).

Acceptance compares with the backbone's greedy token in the dtype it runs in, so the targets are the
backbone's own argmax, and a walk stops where the data leave that greedy path (data made in another
dtype, or sampled).
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

from medusa_heads.backbone import backbone_forward
from medusa_heads.errors import MedusaError, read_json, read_jsonl
from medusa_heads.inference.draft import DecodeState, Drafter
from medusa_heads.inference.drafters.eagle import EagleDrafter
from medusa_heads.model import MedusaModel
from medusa_heads.tree import chain_tree
from medusa_heads.training.data import Example, assistant_spans, tokenize_row

_BATCH = 256  # paths per head call: bounds the [N, vocabulary] scores in memory


@dataclass
class Calibration:
    top_k: int
    positions: list[int]  # [D] walks that reached depth d + 1: its parent was accepted (the root always is)
    hits: list[list[int]]  # [D][top_k] of those, the rank-r guess was the backbone's token
    conversations: int = 0
    meta: dict = field(default_factory=dict)  # where the data and heads came from, the dtype

    @property
    def p(self) -> list[list[float]]:
        """[D][top_k] P(rank-r child accepted | parent accepted); 0 where no walk reached the depth."""
        return [[h / n if n else 0.0 for h in row] for row, n in zip(self.hits, self.positions)]

    def as_dict(self) -> dict:
        return {**asdict(self), "p": [[round(x, 6) for x in row] for row in self.p]}

    @classmethod
    def from_dict(cls, data: dict, source: str = "calibration") -> "Calibration":
        try:
            top_k, positions, hits = int(data["top_k"]), list(data["positions"]), [list(r) for r in data["hits"]]
        except (KeyError, TypeError, ValueError):
            raise MedusaError(f"`{source}` holds no calibration (top_k, positions, hits).") from None
        if not positions or len(hits) != len(positions) or any(len(r) != top_k for r in hits) or any(
                not isinstance(x, int) or x < 0 for x in positions + [h for r in hits for h in r]) or any(
                sum(r) > n for r, n in zip(hits, positions)):
            raise MedusaError(f"`{source}` has inconsistent calibration counts (positions, hits per depth and rank).")
        return cls(top_k, positions, hits, int(data.get("conversations", 0)), dict(data.get("meta", {})))


def load_calibration(path: str | Path) -> Calibration:
    """Calibration counts from a JSON file: one written by `tree optimize`, a fitted tree (its `calibration`), or
    the trainer's `head_accuracies.json` (teacher-forced on its held-out set)."""
    data = read_json(path, "Calibration file")
    if isinstance(data, dict) and isinstance(data.get("calibration"), dict):
        data = data["calibration"]
    if not isinstance(data, dict):
        raise MedusaError(f"`{path}` holds no calibration (top_k, positions, hits).")
    return Calibration.from_dict(data, str(path))


def parse_rows(spec: str | None) -> slice:
    """`START:END` (Python slice bounds, either may be empty) -> slice; None -> every row."""
    if spec is None:
        return slice(None)
    try:
        start, end = spec.split(":")
        return slice(int(start) if start else None, int(end) if end else None)
    except ValueError:
        raise MedusaError(f"`--rows` must be START:END (e.g. 2592: or -200:), got {spec!r}.") from None


def read_rows(path: Path, rows: slice = slice(None)) -> list[dict]:
    """The selected rows of a jsonl of conversations (OpenAI `messages`). A last line without its newline is
    skipped: the file may be one that a distill run is still appending to."""
    all_rows = read_jsonl(path, "Calibration data", "messages", list, partial_last_line=True)
    selected = [row for _, row in all_rows][rows]
    if not selected:
        bounds = ":".join("" if b is None else str(b) for b in (rows.start, rows.stop))
        raise MedusaError(f"Calibration data `{path}` has no rows in {bounds}.")
    return selected


def to_conversations(rows: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(input ids, answer mask) per row, with the exact `answer_ids` of self-distilled rows when present."""
    conversations = []
    for row in rows:
        example = tokenize_row(row, tokenizer)
        if sum(example.loss_mask) > 1:
            conversations.append((example.input_ids, example.loss_mask))
    if not conversations:
        raise MedusaError("The calibration rows have no assistant answers of 2 tokens or more.")
    return conversations


@torch.no_grad()
def calibrate(model: MedusaModel, conversations: Iterable[tuple[list[int], list[int]]], top_k: int = 10,
              max_length: int | None = None, meta: dict | None = None) -> Calibration:
    r"""
    Count, per depth and rank, how often the heads' guess is the backbone's greedy token along the true path.

    Args:
        conversations: (input ids, mask) pairs, the mask 1 on answer tokens: roots and targets are taken there.
        top_k: ranks asked of each head (the widest tree the result can describe).
        max_length: conversations are cut to this many tokens (default: the model's context).
    """
    if top_k < 1:
        raise MedusaError(f"`top_k` must be at least 1, got {top_k}.")
    depth = model.config.num_heads
    positions, hits = [0] * depth, [[0] * top_k for _ in range(depth)]
    context = getattr(model.backbone.config.get_text_config(), "max_position_embeddings", None)
    max_length = max_length or context
    count = 0
    for input_ids, mask in tqdm(conversations, desc="calibrate", unit="conversation", leave=False):
        ids = torch.tensor(input_ids[:max_length], device=model.device)
        answer = torch.tensor(mask[: len(ids)], dtype=torch.bool, device=model.device)
        logits, hidden = backbone_forward(model.backbone, ids[None], None)
        greedy = logits[0].argmax(dim=-1)  # greedy[i]: the backbone's token after ids[: i + 1]
        hidden = hidden[0]
        count += 1
        # Roots: answer tokens that greedy decoding would have produced.
        walks = torch.nonzero(answer[1:] & (greedy[:-1] == ids[1:])).flatten() + 1
        if model.heads.drafts_over_context:
            _walk_over_context(model, ids, hidden, greedy, answer, walks.tolist(), top_k, positions, hits)
            continue
        for d in range(depth):
            walks = walks[walks + d + 1 < len(ids)]
            walks = walks[answer[walks + d + 1]]  # the target is an answer token
            if not len(walks):
                break
            going_on = []
            for chunk in walks.split(_BATCH):
                counted, goes_on = _walk_step(model, ids, hidden, greedy, chunk, d, top_k)
                positions[d] += len(chunk)
                for r, n in enumerate(counted.tolist()):
                    hits[d][r] += n
                going_on.append(chunk[goes_on])
            walks = torch.cat(going_on)
    if not count:
        raise MedusaError("No conversations to calibrate on.")
    return Calibration(top_k, positions, hits, count, dict(meta or {}))


def _walk_step(model: MedusaModel, ids: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor,
               roots: torch.Tensor, d: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The depth-(d + 1) guesses after the true paths from `roots` [N]: (hits per rank [top_k], [N] whether
    the walk goes on below: the guess was right and the data stay on the greedy path).

    One call for all N roots: `head_topk` gets each path's own hidden state ([N, H]), which its computations
    broadcast against the paths as they do a single one (tested for both kinds of heads).
    """
    paths = ids[roots[:, None] + torch.arange(d + 1, device=ids.device)]  # [N, d + 1], x_t .. x_{t+d}
    guesses, _ = model.head_topk(hidden[roots - 1], paths, top_k)  # [N, top_k]
    targets = greedy[roots + d]  # the backbone's token after x_{t+d}
    match = guesses == targets[:, None]
    found = match.any(dim=1)
    counted = torch.bincount(match.int().argmax(dim=1)[found], minlength=top_k)
    return counted, found & (ids[roots + d + 1] == targets)


def _walk_over_context(model: MedusaModel, ids: torch.Tensor, hidden: torch.Tensor, greedy: torch.Tensor,
                       answer: torch.Tensor, roots: list[int], top_k: int, positions: list[int],
                       hits: list[list[int]]) -> None:
    """The walks of a drafter over the context (EAGLE, EAGLE-3), root by root, added to `positions` and `hits`.
    Its cache takes the positions up to each root as decoding would commit them, and the true path is drafted
    depth by depth as a dynamic tree grows (`begin`, `topk` on a one-node frontier, `end`): the guesses below a
    node are the ones decoding would draft there."""
    drafter = EagleDrafter(model, chain_tree(1, model.device))
    only = torch.zeros(1, dtype=torch.long, device=model.device)  # the frontier's one node, below the last one
    tokens, committed = ids.tolist(), 0
    for root in roots:
        drafter.begin(DecodeState(tokens[: root + 1], tokens[root], hidden[root - 1],
                                  fresh_hidden=hidden[committed:root]))
        committed = root
        for d in range(len(positions)):
            if root + d + 1 >= len(ids) or not answer[root + d + 1]:
                break
            guesses, _ = drafter.topk(ids[None, root : root + d + 1], only, top_k)
            positions[d] += 1
            rank = (guesses[0] == greedy[root + d]).nonzero().flatten().tolist()
            if not rank:
                break
            hits[d][rank[0]] += 1
            if ids[root + d + 1] != greedy[root + d]:  # the data leave the greedy path
                break
        drafter.end()


@torch.no_grad()
def replay(model: MedusaModel, drafter: Drafter, prompt_ids: list[int], answer_ids: list[int]) -> int:
    r"""
    Steps that tree decoding with `drafter` takes to commit `answer_ids` after `prompt_ids` under greedy
    verification, when they are the backbone's own greedy answer.

    With the answer known, a step needs only the drafter: one backbone forward over the whole sequence gives every
    hidden state the decoding loop would hand it, and the step commits the deepest drafted path that spells the
    answer, plus one token. The first answer token comes from the prefill.
    """
    ids = prompt_ids + answer_ids
    _, hidden = backbone_forward(model.backbone, torch.tensor([ids], device=model.device), None)
    hidden = hidden[0]
    t, steps = len(prompt_ids) - 1, 0  # hidden[t] predicted the root ids[t + 1]
    fresh = hidden[: t + 1]
    while t + 2 < len(ids):
        draft = drafter.propose(DecodeState(ids[: t + 2], ids[t + 1], hidden[t], fresh_hidden=fresh))
        tokens, depth, parent = draft.tokens.tolist(), draft.tree.depth.tolist(), draft.tree.parent.tolist()
        accepted, deepest = [True] + [False] * (len(tokens) - 1), 0
        for node in range(1, len(tokens)):  # parents come before their children
            position = t + 1 + depth[node]
            if accepted[parent[node]] and position < len(ids) and tokens[node] == ids[position]:
                accepted[node], deepest = True, max(deepest, depth[node])
        fresh = hidden[t + 1 : t + 2 + deepest]
        t += deepest + 1
        steps += 1
    return steps


def replayed_tokens_per_step(model: MedusaModel, drafter: Drafter,
                             conversations: Iterable[tuple[list[int], list[int]]]) -> float:
    """Tokens per step of tree decoding replayed (`replay`) on each answer of (input ids, answer mask) pairs, each
    answer decoded after everything before it."""
    tokens = steps = 0
    for input_ids, mask in tqdm(conversations, desc="replay", unit="conversation", leave=False):
        start = 0
        for answer in assistant_spans(Example(input_ids, mask)):
            start = mask.index(1, start)
            steps += replay(model, drafter, input_ids[:start], answer)
            tokens += len(answer) - 1
            start += len(answer)
    return tokens / max(steps, 1)
