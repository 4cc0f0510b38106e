"""The EAGLE-3-style drafter: the backbone's layer features it reads, its save/load round trip, its training unroll
against its drafting, the trainer (one and two processes), and decoding with it exactly as HF greedy (a tiny
backbone built from a config; the real one in the slow tier)."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig

from medusa_heads import Eagle3Head, MedusaConfig, MedusaError, MedusaModel, load_backbone
from medusa_heads.apps.calibrate import replayed_tokens_per_step
from medusa_heads.backbone import EMBEDDED_MODEL, backbone_forward, tap_features
from medusa_heads.eagle import decoder_config_for
from medusa_heads.eagle3 import default_feature_layers
from medusa_heads.head_types import head_type_class
from medusa_heads.inference import DecodeState, EagleDrafter, GenerationStats, make_drafter
from medusa_heads.inference.cache import TreeCache
from medusa_heads.inference.drafters.dynamic import DynamicDrafter
from medusa_heads.inference.generate import encode_prompt, prefill
from medusa_heads.model import SHIPPED_HEADS, load_heads, untrained_heads
from medusa_heads.training.data import load_examples, tokenize_row
from medusa_heads.training.draft_vocab import frequent_tokens, repick_draft_vocab
from medusa_heads.training.recipe import TrainConfig
from medusa_heads.training.trainer import train
from medusa_heads.tree import build_tree, load_tree

from oracle import assert_exact, decode, hf_greedy, unrolled_and_drafted
from test_multiprocess import two_processes  # noqa: E402
from test_training import recipe  # noqa: E402

SHIPPED_EAGLE3 = SHIPPED_HEADS[EMBEDDED_MODEL].parent / "smollm2-135m-embedded-eagle3"
CHAIN = build_tree([(0,) * d for d in range(1, 4)])


def three_deep(tree: str, folder: Path) -> str:
    """A shipped tree cut to the drafters' 3 depths, as a file `make_drafter` reads."""
    path = folder / f"{tree}-3.json"
    path.write_text(json.dumps({"paths": [list(p) for p in load_tree(tree) if len(p) <= 3]}))
    return str(path)


def random_eagle3(backbone, name: str, vocab: int, draft: int, std: float = 0.05) -> MedusaModel:
    """A random drafter over a random draft vocabulary (its norms left as they start): its guesses depend on
    features, tokens and context."""
    torch.manual_seed(0)
    heads = untrained_heads(backbone, name, num_heads=3, share_lm_head=False, head_type="eagle3",
                            draft_vocab=torch.randperm(vocab)[:draft])
    for name, p in heads.named_parameters():
        if "norm" not in name:
            p.data.normal_(std=std)
    return MedusaModel(backbone, heads)


@pytest.fixture
def tiny(tiny_backbone):
    """A tiny backbone of its own (`MedusaModel` taps its layers) with a random EAGLE-3 drafter."""
    backbone = load_backbone(str(tiny_backbone))
    return random_eagle3(backbone, str(tiny_backbone), backbone.get_output_embeddings().weight.shape[0], 500, std=1.0)


def test_default_feature_layers_are_low_middle_and_high():
    assert default_feature_layers(30) == [2, 15, 27]  # what vLLM picks for a 30-layer target
    assert default_feature_layers(32) == [2, 16, 29]
    assert default_feature_layers(2) == [0, 1]


def test_a_tapped_backbone_returns_the_inputs_of_its_feature_layers(tiny_backbone):
    backbone = load_backbone(str(tiny_backbone))
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.no_grad():
        hf = backbone(input_ids=ids, output_hidden_states=True).hidden_states  # [i]: layer i's input
        _, last = backbone_forward(backbone, ids, None)
        tap_features(backbone, (0, 1))
        _, features = backbone_forward(backbone, ids, None)
    assert features.shape == (1, 4, 3 * 32)
    torch.testing.assert_close(features, torch.cat([last, hf[0], hf[1]], dim=-1), rtol=0, atol=0)
    tap_features(backbone, ())
    assert backbone_forward(backbone, ids, None)[1].shape == (1, 4, 32)
    for bad in ((1, 0), (0, 2), (1, 1)):
        with pytest.raises(MedusaError, match="increasing layer ids in 0..1"):
            tap_features(backbone, bad)


def test_save_and_load_round_trip(tiny, tmp_path):
    heads = tiny.heads
    heads.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["head_type"] == "eagle3" and config["feature_layers"] == [0, 1] and config["format_version"] == 4
    loaded = load_heads(tmp_path)
    assert isinstance(loaded, Eagle3Head) and loaded.feature_layers == (0, 1)
    assert loaded.state_dict().keys() == heads.state_dict().keys()
    for key, value in heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    features, embeds = torch.randn(1, 6, 96), torch.randn(1, 6, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded.project(0, loaded(features, embeds)), heads.project(0, heads(features, embeds)))


def test_config_errors():
    decoder = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2,
               "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 1}
    with pytest.raises(ValueError, match="LM head of its own: it needs `share_lm_head=False`"):
        Eagle3Head(MedusaConfig(head_type="eagle3", hidden_size=16, vocab_size=40, decoder_config=decoder,
                                feature_layers=[0]))
    with pytest.raises(ValueError, match="needs `feature_layers`"):
        Eagle3Head(MedusaConfig(head_type="eagle3", hidden_size=16, vocab_size=40, share_lm_head=False,
                                decoder_config=decoder))
    heads = Eagle3Head(MedusaConfig(head_type="eagle3", hidden_size=16, vocab_size=40, share_lm_head=False,
                                    decoder_config=decoder, feature_layers=[0, 1]))
    with pytest.raises(ValueError, match="Expected features of 16 or 48 values"):
        heads(torch.zeros(1, 2, 32), torch.zeros(1, 2, 16))
    with pytest.raises(MedusaError, match="`share_lm_head: false`"):
        TrainConfig(head_type="eagle3")


def test_the_drafter_needs_the_backbone_s_features(tiny):
    drafter = EagleDrafter(tiny, CHAIN)
    hidden = torch.zeros(3, 32)  # the last hidden state alone: the backbone was untapped behind its back
    with pytest.raises(MedusaError, match="backbone's features .96 values a position., got 32"):
        drafter.propose(DecodeState([1, 2, 3, 4], 4, hidden[-1], hidden))


def test_a_tapped_backbone_still_serves_the_other_head_types(tiny, tokenizer, tmp_path):
    """Heads of every other type on the backbone an EAGLE-3 drafter tapped (as the bench runs them side by side)
    read the last hidden state, the first H of the widened one, and decode exactly."""
    assert backbone_forward(tiny.backbone, torch.tensor([[1, 2]]), None)[1].shape[-1] == 3 * 32  # tapped
    ids = encode_prompt(tokenizer, "Why do cats purr?")
    reference = hf_greedy(tiny.backbone, ids, 24)
    for head_type, drafter in (("hydra", "medusa"), ("hydra", "dynamic"), ("medusa", "medusa"), ("eagle", "medusa")):
        torch.manual_seed(0)
        heads = untrained_heads(tiny.backbone, "tiny", num_heads=3, head_type=head_type)
        for p in heads.parameters():
            p.data.normal_(std=0.3)
        other = MedusaModel(tiny.backbone, heads)
        tree = {"tree": three_deep("cpu-8", tmp_path)} if drafter == "medusa" else {}
        assert decode(other, ids, make_drafter(other, drafter, **tree), max_new_tokens=24) == reference, head_type


def test_the_decoding_path_computes_the_layer_s_forward(tiny):
    """`Eagle3Head.decode`, the Llama layer written out, against the modules' `forward`: a commit of 20 positions, then
    a tree step of 4 entries under a 4D mask, on caches that start equal; then at the last positions it takes."""
    heads = tiny.heads
    assert heads._short_decode
    torch.manual_seed(1)
    h = heads.config.hidden_size
    feats, embeds = torch.randn(1, 20, 3 * h), torch.randn(1, 20, h)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    steps = [(feats, embeds, torch.arange(20)[None], torch.ones(20, 20, dtype=torch.bool).tril()),
             (torch.randn(1, 4, h), torch.randn(1, 4, h), torch.tensor([[20, 21, 21, 22]]),
              torch.cat([torch.ones(4, 20, dtype=torch.bool), tree], dim=1)),
             (torch.randn(1, 2, 3 * h), torch.randn(1, 2, h), torch.tensor([[510, 511]]),
              torch.ones(2, 26, dtype=torch.bool))]
    caches = DynamicCache(), DynamicCache()
    with torch.no_grad():
        for features, tokens, positions, mask in steps:
            short = heads.decode(features, tokens, positions, mask[None, None], caches[0])
            modules = heads(features, tokens, positions, mask[None, None], caches[1])
            torch.testing.assert_close(short, modules, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0].layers[0].keys, caches[1].layers[0].keys, rtol=1e-5, atol=1e-5)


def test_training_unroll_predicts_what_drafting_drafts(tiny, tokenizer):
    """Level j of the training unroll at the root's position + j - 2 scores the token drafted at depth j: training
    sees exactly what drafting sees (its own outputs fed back, the context's features up to the root)."""
    cfg = TrainConfig(num_heads=3, head_type="eagle3", share_lm_head=False)
    for prompt in ("Why do cats purr?", "Name three rivers in Europe, please."):
        unrolled, drafted = unrolled_and_drafted(tiny, encode_prompt(tokenizer, prompt), CHAIN, cfg)
        assert unrolled == drafted and len(set(drafted)) > 1  # guesses that depend on what the drafter reads


@pytest.mark.parametrize("name, tree", [("medusa", "cpu-16"), ("medusa+ngram", "cpu-8")])
def test_decoding_with_a_random_drafter_is_hf_greedy(tiny, tokenizer, chat_prompts, name, tree, tmp_path):
    """Many steps of trees 3 deep: the drafter's cache follows the context, and the output is the backbone's."""
    for prompt in (encode_prompt(tokenizer, p) for p in chat_prompts[:3]):
        drafter = make_drafter(tiny, name, tree=three_deep(tree, tmp_path))
        assert decode(tiny, prompt, drafter, max_new_tokens=48) == hf_greedy(tiny.backbone, prompt, 48)


def test_the_aligned_evaluation_layout_is_one_drafting_step_per_entry(tiny, tokenizer):
    """`eagle_forward(aligned=True)`, the layout of held-out tree walks and calibration counts: entry 0 of level j
    is the depth-j guess of the step whose root is the token after the prompt."""
    from medusa_heads.training.trainer import eagle_forward

    cfg = TrainConfig(num_heads=3, head_type="eagle3", share_lm_head=False)
    for prompt in ("Why do cats purr?", "Name three rivers in Europe, please."):
        ids = encode_prompt(tokenizer, prompt)
        cache = TreeCache(tiny.backbone, 1, ids.shape[1])
        logits, hidden = (x[0] for x in prefill(tiny, ids.tolist(), cache))
        root = int(logits.argmax())
        drafted = EagleDrafter(tiny, CHAIN).fill(DecodeState(ids[0].tolist() + [root], root, hidden[-1], hidden),
                                                 CHAIN)[1:]
        sequence = torch.cat([ids[0], torch.tensor([root]), drafted])[None]
        n = ids.shape[1]
        features = torch.cat([hidden, torch.zeros(sequence.shape[1] - n, hidden.shape[1])])[None]
        mask = torch.zeros_like(sequence)
        mask[0, n + 1 :] = 1
        with torch.no_grad():
            levels, labels, _ = eagle_forward(tiny.heads, tiny.projection, tiny.backbone.get_input_embeddings(),
                                              features, sequence, mask, cfg, aligned=True)
        assert [int(tiny.heads.token_ids(lg[0].argmax())) for lg in levels] == drafted.tolist()
        assert [int(lb[0]) for lb in labels] == drafted.tolist()  # token ids: no draft vocabulary index given


def test_calibrating_from_data_counts_what_the_trainer_counts_held_out(tiny_backbone, tokenizer):
    """`tree optimize --calibration ANSWERS.jsonl` walks a drafter over the context through the runtime's
    `EagleDrafter`; the trainer counts the same walks with its unrolled forward (`eagle_forward(aligned=True)`,
    `walk_hits_counts`). On the backbone's own greedy answers the two agree, rank by rank: the draft vocabulary holds
    every answer token and top_k is all of it, so each walk goes as deep as its answer allows."""
    from medusa_heads.apps.calibrate import calibrate
    from medusa_heads.training.losses import walk_hits_counts
    from medusa_heads.training.trainer import draft_index, eagle_forward

    backbone = load_backbone(str(tiny_backbone))
    vocab = backbone.get_output_embeddings().weight.shape[0]
    conversations = []
    for prompt in ("Why do cats purr?", "Name three rivers in Europe, please.", "Count to five."):
        ids = encode_prompt(tokenizer, prompt)[0].tolist()
        n = len(ids)
        with torch.no_grad():
            for _ in range(24):  # greedy by full forwards: the argmax calibration reads
                ids.append(int(backbone(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        conversations.append((ids, [0] * n + [1] * 24))
    answered = torch.tensor(sorted({t for ids, _ in conversations for t in ids}))
    draft = 200
    assert answered.numel() < draft
    rest = torch.tensor([t for t in torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).tolist()
                         if t not in set(answered.tolist())][: draft - answered.numel()])
    model = random_eagle3(backbone, str(tiny_backbone), vocab, draft, std=0.3)
    model.heads.set_draft_vocab(torch.cat([answered, rest]))
    counted = calibrate(model, conversations, top_k=draft)

    vocab_index = draft_index(model.heads.draft_vocab, vocab)
    cfg = TrainConfig(num_heads=3, head_type="eagle3", share_lm_head=False)
    hits, counts = torch.zeros(3, draft, dtype=torch.long), torch.zeros(3, dtype=torch.long)
    for ids, mask in conversations:
        ids, first_answer = torch.tensor([ids]), mask.index(1)
        mask = torch.tensor([mask])
        mask[0, first_answer] = 0  # decoding's first root is the first answer token (the prefill commits it)
        with torch.no_grad():
            _, hidden = backbone_forward(model.backbone, ids, None)
            logits, labels, _ = eagle_forward(model.heads, model.projection, model.backbone.get_input_embeddings(),
                                              hidden, ids, mask, cfg, vocab_index, aligned=True)
        h, c = walk_hits_counts(logits, labels, draft)
        hits += h
        counts += c
    assert counted.positions == counts.tolist() == [3 * 23, 3 * 22, 3 * 21]
    assert counted.hits == hits.tolist()
    assert sum(counted.hits[0][:10]) < counted.positions[0]  # a random drafter: the ranks are spread out


@pytest.mark.parametrize("top_k, depth", [(3, None), (1, 6)])
def test_a_dynamic_tree_drafts_what_the_static_fill_drafts_on_that_tree(tiny, tokenizer, top_k, depth):
    """The dynamic tree's drafter entries (each node seeing its ancestors' entries) give, on the tree it grew, the
    tokens `fill` drafts on that same tree as a static one; also below the depths it was trained for (a chain of
    6 from a drafter unrolled 3 deep: it drafts autoregressively)."""
    for prompt in ("Why do cats purr?", "Name three rivers in Europe, please."):
        ids = encode_prompt(tokenizer, prompt)
        cache = TreeCache(tiny.backbone, 1, ids.shape[1])
        logits, hidden = (x[0] for x in prefill(tiny, ids.tolist(), cache))
        root = int(logits.argmax())
        state = DecodeState(ids[0].tolist() + [root], root, hidden[-1], hidden)
        budget = 12 if depth is None else depth
        draft = DynamicDrafter(tiny, budget=budget, top_k=top_k, max_depth=depth).propose(state)
        assert draft.tree.max_depth == (depth or 3) and len(set(draft.tree.paths)) == budget
        assert top_k == 1 or max(map(max, draft.tree.paths)) > 0
        assert torch.equal(draft.tokens, EagleDrafter(tiny, draft.tree, depth).fill(state, draft.tree))
    if depth:
        with pytest.raises(MedusaError, match="trained for 3"):  # a static tree deeper than the training: a mistake
            EagleDrafter(tiny, draft.tree)


@pytest.mark.parametrize("name", ["dynamic", "adaptive", "deeper"])
def test_decoding_with_a_dynamic_tree_is_hf_greedy(tiny, tokenizer, chat_prompts, name):
    """Trees grown each step by the drafter over the context: its cache follows the context, and the output is the
    backbone's; `deeper`: trees up to 6 deep from a drafter unrolled 3 deep in training."""
    for prompt in (encode_prompt(tokenizer, p) for p in chat_prompts[:2]):
        deeper = name == "deeper"
        drafter = make_drafter(tiny, "dynamic" if deeper else name, budget=10, depth=6 if deeper else None)
        stats = GenerationStats()
        assert decode(tiny, prompt, drafter, max_new_tokens=32, stats=stats) == hf_greedy(tiny.backbone, prompt, 32)
        assert stats.steps > 0


@pytest.mark.parametrize("cached", [True, False])
def test_the_trainer_trains_it_and_it_decodes_exactly(tiny_backbone, counting_data, tmp_path, tokenizer, cached):
    """Through the recipe machinery: three layers' states (cached, or computed each step), unrolled 2 deep, saved,
    loaded by `MedusaModel.from_pretrained` and decoding exactly."""
    out = tmp_path / "eagle3"
    result = train(recipe(tiny_backbone, counting_data, out, head_type="eagle3", share_lm_head=False, max_steps=40,
                          draft_vocab_coverage=0.99, cache_hidden_states=cached))
    losses = [h["loss"] for h in result["history"]]
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    files = list((tmp_path / "hidden").glob("*.safetensors"))  # the training and held-out sets'
    assert len(files) == 2 * cached
    assert all(load_file(f)["hidden"].shape[-1] == 3 * 32 for f in files)  # the last hidden state, layers 0 and 1
    accuracies = json.loads((out / "heads" / "head_accuracies.json").read_text())
    assert accuracies["top1"][0] > 0.3, accuracies["top1"]
    model = MedusaModel.from_pretrained(out / "heads")
    assert isinstance(model.heads, Eagle3Head) and model.config.draft_vocab_size < 200
    ids = encode_prompt(tokenizer, "Count from 7.")
    drafter = EagleDrafter(model, build_tree([(0,), (1,), (0, 0), (0, 1), (1, 0)]))
    assert decode(model, ids, drafter, max_new_tokens=40) == hf_greedy(model.backbone, ids, 40)


def test_a_run_continues_saved_heads_with_their_draft_vocabulary(tiny_backbone, counting_data, tmp_path):
    """`init_heads` on a drafter with a draft vocabulary: the continued run keeps that vocabulary, not one counted
    again on its own data. Continued at a vanishing learning rate, it scores the same held-out set exactly as the
    first run did."""
    rows = counting_data.read_text().splitlines()
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[:8]) + "\n")
    above = [r for r in rows if int(json.loads(r)["messages"][0]["content"][len("Count from "):-1]) > 25]
    (tmp_path / "other.jsonl").write_text("\n".join(above) + "\n")  # digits in other proportions: another count
    common = dict(head_type="eagle3", share_lm_head=False, eval_data=str(tmp_path / "eval.jsonl"))
    first = train(recipe(tiny_backbone, counting_data, tmp_path / "first", max_steps=30, draft_vocab_coverage=0.9,
                         **common))
    saved = load_heads(tmp_path / "first" / "heads")
    size = saved.config.draft_vocab_size
    again = train(recipe(tiny_backbone, tmp_path / "other.jsonl", tmp_path / "again", max_steps=1, warmup_steps=1,
                         learning_rate=1e-12, draft_vocab_size=size, init_heads=str(tmp_path / "first" / "heads"),
                         **common))
    assert torch.equal(load_heads(tmp_path / "again" / "heads").draft_vocab, saved.draft_vocab)
    assert again["accuracies"]["hits"] == first["accuracies"]["hits"]
    with pytest.raises(MedusaError, match=f"draft_vocab_size {size} \\(the recipe: {size + 1}\\)"):
        train(recipe(tiny_backbone, counting_data, tmp_path / "bad", draft_vocab_size=size + 1,
                     init_heads=str(tmp_path / "first" / "heads"), **common))
    with pytest.raises(MedusaError, match="drop `draft_vocab_coverage`"):
        recipe(tiny_backbone, counting_data, tmp_path / "bad", draft_vocab_coverage=0.9,
               init_heads=str(tmp_path / "first" / "heads"), **common)


@pytest.mark.parametrize("head_type, share", [("eagle3", False), ("medusa", False), ("hydra", True)])
def test_a_repicked_draft_vocabulary_keeps_trained_rows_and_maps_new_ones(head_type, share, tmp_path):
    """Re-picking the draft vocabulary of trained heads: kept tokens keep their rows; where training moved the
    rows by one linear map, a new token's row is the backbone's row moved by that same map (the least-squares
    fit recovers it); shared heads only change their ids; the re-picked heads save and load whole."""
    torch.manual_seed(0)
    hidden, vocab = 16, 200
    backbone_rows = torch.randn(vocab, hidden)
    fields = {"feature_layers": [0, 1]} if head_type == "eagle3" else {}
    config = MedusaConfig(head_type=head_type, hidden_size=hidden, vocab_size=vocab, share_lm_head=share,
                          num_heads=2, draft_vocab_size=60, **fields,
                          **({"decoder_config": decoder_config_for(LlamaConfig(
                              hidden_size=hidden, intermediate_size=32, num_attention_heads=2,
                              num_key_value_heads=1))} if head_type == "eagle3" else {}))
    heads = head_type_class(head_type)(config)
    old = torch.randperm(vocab)[:60]
    heads.set_draft_vocab(old)
    moves = [torch.randn(hidden, hidden) for _ in heads.owned_projections()]
    for projection, move in zip(heads.owned_projections(), moves):
        projection.weight.data = backbone_rows[old] @ move  # "training" moved every row by one map
    before = [p.weight.detach().clone() for p in heads.owned_projections()]
    picked = torch.cat([old[10:], torch.tensor([t for t in range(vocab) if t not in set(old.tolist())][:30])])
    assert repick_draft_vocab(heads, picked, backbone_rows) == 30
    assert torch.equal(heads.draft_vocab, picked) and heads.config.draft_vocab_size == 80
    assert len(heads.owned_projections()) == (0 if share else config.num_heads if head_type != "eagle3" else 1)
    for projection, move, was in zip(heads.owned_projections(), moves, before):
        assert projection.weight.shape == (80, hidden)
        assert torch.equal(projection.weight[:50], was[10:])
        torch.testing.assert_close(projection.weight[50:], backbone_rows[picked[50:]] @ move, rtol=1e-4, atol=1e-4)
    heads.save_pretrained(tmp_path / "heads")
    loaded = load_heads(tmp_path / "heads", dtype=torch.float32)
    assert torch.equal(loaded.draft_vocab, picked)
    for mine, theirs in zip(heads.owned_projections(), loaded.owned_projections()):
        assert torch.equal(mine.weight, theirs.weight)


def test_a_continued_run_can_repick_its_draft_vocabulary(tiny_backbone, counting_data, tokenizer, tmp_path):
    """`repick_draft_vocab`: a drafter continued on other data guesses among that data's most frequent tokens (as a
    fresh run counts them), the tokens it knew keeping their trained rows."""
    rows = counting_data.read_text().splitlines()
    (tmp_path / "eval.jsonl").write_text("\n".join(rows[:8]) + "\n")
    above = [r for r in rows if int(json.loads(r)["messages"][0]["content"][len("Count from "):-1]) > 25]
    (tmp_path / "other.jsonl").write_text("\n".join(above) + "\n")
    common = dict(head_type="eagle3", share_lm_head=False, eval_data=str(tmp_path / "eval.jsonl"))
    train(recipe(tiny_backbone, counting_data, tmp_path / "first", max_steps=4, warmup_steps=1,
                 draft_vocab_coverage=0.5, **common))
    first = load_heads(tmp_path / "first" / "heads", dtype=torch.float32)
    again = recipe(tiny_backbone, tmp_path / "other.jsonl", tmp_path / "again", max_steps=1, warmup_steps=1,
                   learning_rate=1e-12, draft_vocab_coverage=0.95, repick_draft_vocab=True,
                   init_heads=str(tmp_path / "first" / "heads"), **common)
    train(again)
    wanted, _ = frequent_tokens(load_examples(again.data, tokenizer, again.max_length), len(tokenizer),
                                coverage=0.95)
    continued = load_heads(tmp_path / "again" / "heads", dtype=torch.float32)
    assert torch.equal(continued.draft_vocab, wanted) and continued.config.draft_vocab_size == wanted.numel()
    position = {t: i for i, t in enumerate(first.draft_vocab.tolist())}
    kept = [(i, position[t]) for i, t in enumerate(wanted.tolist()) if t in position]
    assert kept and len(kept) < wanted.numel()  # some tokens kept, some new
    now, was = zip(*kept)
    torch.testing.assert_close(continued.lm_head.weight[list(now)], first.lm_head.weight[list(was)])
    with pytest.raises(MedusaError, match="`repick_draft_vocab` re-counts"):
        recipe(tiny_backbone, counting_data, tmp_path / "bad", repick_draft_vocab=True, draft_vocab_size=10,
               **common)


def test_a_recipe_chooses_the_layers(tiny_backbone, counting_data, tmp_path):
    """`feature_layers` in a recipe reaches the heads' config, the cache's width and the loaded model's taps."""
    out = tmp_path / "eagle3"
    train(recipe(tiny_backbone, counting_data, out, head_type="eagle3", share_lm_head=False, max_steps=2, warmup_steps=1,
                 feature_layers="1"))
    caches = list((tmp_path / "hidden").glob("*.safetensors"))
    assert caches and all(load_file(f)["hidden"].shape[-1] == 2 * 32 for f in caches)  # last hidden, layer 1's input
    model = MedusaModel.from_pretrained(out / "heads")
    assert model.heads.feature_layers == (1,)
    assert backbone_forward(model.backbone, torch.tensor([[1, 2]]), None)[1].shape[-1] == 2 * 32
    with pytest.raises(MedusaError, match="`feature_layers` is for heads that read several layers"):
        TrainConfig(head_type="eagle", feature_layers="1")
    with pytest.raises(MedusaError, match="`feature_layers` must be comma-separated layer ids"):
        TrainConfig(head_type="eagle3", share_lm_head=False, feature_layers="1,x")


@pytest.mark.slow  # three pairs of processes start and train: two minutes
def test_two_processes_train_it_alone_and_under_deepspeed_zero2_and_zero3(tiny_backbone, counting_data, tmp_path):
    """The same 4 steps in two processes, plain and under ZeRO-2 and ZeRO-3 (which gathers the drafter's weights
    wherever its modules are called, its LM head in `project` included): the same losses and trained weights."""
    runs = {}
    for name, deepspeed in (("plain", None), ("zero2", "zero2.json"), ("zero3", "zero3.json")):
        extra = {"deepspeed_config": f"configs/deepspeed/{deepspeed}"} if deepspeed else {}
        run = two_processes(tiny_backbone, counting_data, tmp_path / name, max_steps=4, head_type="eagle3",
                            share_lm_head="false", **extra)
        assert "world size 2 (process 0)" in run.stderr and "world size 2 (process 1)" in run.stderr
        assert (f"DeepSpeed ZeRO-{name[-1]}" in run.stderr) == bool(deepspeed)
        history = [h["loss"] for h in json.loads((tmp_path / name / "history.json").read_text())]
        assert len(history) == 4 and all(math.isfinite(x) for x in history)
        runs[name] = history, load_heads(tmp_path / name / "heads")
    initial = untrained_heads(load_backbone(str(tiny_backbone)), "tiny", num_heads=2, head_type="eagle3",
                              share_lm_head=False).state_dict()
    plain_history, plain = runs.pop("plain")
    assert isinstance(plain, Eagle3Head) and not torch.equal(plain.lm_head.weight, initial["lm_head.weight"])
    for name, (history, heads) in runs.items():
        assert history == pytest.approx(plain_history, rel=1e-4), name
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(heads.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")


@pytest.fixture
def real_eagle3(backbone):
    """A random drafter on the real backbone (30 layers: it reads 2, 15 and 27); the shared backbone is untapped
    afterwards, for the other tests."""
    yield random_eagle3(backbone, EMBEDDED_MODEL, 49152, 4096)
    tap_features(backbone, ())


@pytest.fixture
def shipped_eagle3(backbone):
    """The shipped EAGLE-3 drafter on the real backbone, in fp32; the backbone is untapped afterwards."""
    yield MedusaModel(backbone, load_heads(SHIPPED_EAGLE3, dtype=torch.float32))
    tap_features(backbone, ())


def test_decoding_on_the_real_model_is_exact(real_eagle3, backbone, references, tmp_path):
    assert real_eagle3.heads.feature_layers == (2, 15, 27)
    drafter = make_drafter(real_eagle3, "medusa+ngram", tree=three_deep("cpu-16", tmp_path))
    stats = assert_exact(real_eagle3, backbone, references[:2], drafter, new_tokens=64)
    assert all(s.steps > 0 for s in stats)


@pytest.mark.parametrize("name, options", [("medusa", {"tree": "eagle3-cpu-16"}),
                                           ("dynamic+ngram+store", {"budget": 24})])
def test_the_shipped_eagle3_drafter_is_exact_and_accepts(shipped_eagle3, backbone, references, name, options):
    """On its fitted tree, and on a tree grown each step beside the n-gram chain and its store."""
    assert shipped_eagle3.heads.feature_layers == (2, 15, 27) and shipped_eagle3.ngram_store is not None
    stats = assert_exact(shipped_eagle3, backbone, references[:2], make_drafter(shipped_eagle3, name, **options), 64)
    # A random drafter commits about 1 token per forward; the trained one about 2 on these prompts.
    assert sum(s.mean_accepted_length for s in stats) / len(stats) > 1.5


@pytest.mark.parametrize("head_type", ["medusa", "eagle3"])
def test_the_held_out_accepted_length_is_what_tree_decoding_commits(tiny_backbone, counting_data, tokenizer, tmp_path,
                                                                    head_type):
    """The trainer's `tree_accepted_length` equals the tokens per step of the runtime's own drafter on the same tree,
    replayed on the held-out answers (`replayed_tokens_per_step`: each step drafts through the decoding loop's
    drafter and commits what greedy verification would if the backbone wrote those answers)."""
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(counting_data.read_text().splitlines(keepends=True)[-12:]))
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps([[0], [1], [0, 0], [0, 1], [1, 0]]))
    result = train(recipe(tiny_backbone, counting_data, tmp_path / "run", head_type=head_type, eval_data=str(held_out),
                          tree=str(tree), max_steps=40, share_lm_head=False))
    model = MedusaModel.from_pretrained(tmp_path / "run" / "heads")
    drafter = make_drafter(model, "medusa", tree=str(tree))
    conversations = [(e.input_ids, e.loss_mask) for e in (tokenize_row(json.loads(line), tokenizer)
                                                          for line in held_out.read_text().splitlines())]
    replayed = replayed_tokens_per_step(model, drafter, conversations)
    assert replayed > 1.3  # trained heads accept: not a comparison of two 1.0s
    assert result["accuracies"]["tree_accepted_length"] == pytest.approx(replayed, rel=1e-6)
