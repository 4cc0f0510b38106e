"""Trees fitted to the heads and the hardware: the optimiser against brute force, the budget choice, the tree
file, calibration with oracle heads on a tiny model, the latency profile and the CLI's errors."""

import itertools
import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads import MedusaError, MedusaModel
from medusa_heads.apps.cli import main
from medusa_heads.apps.calibrate import (Calibration, calibrate, load_calibration, parse_rows, read_rows,
                                              to_conversations)
from medusa_heads.apps.profile import LatencyProfile, cached_profile, load_profile, measure_profile, profile_path
from medusa_heads.device import cpu_description
from medusa_heads.inference import GenerationStats, make_drafter
from medusa_heads.model import untrained_heads
from medusa_heads.tree import build_tree, load_tree
from medusa_heads.tree.optimize import (choose_budget, expected_accepted_length, fit_tree, grow_tree,
                                        path_probability, write_tree)

from oracle import decode  # noqa: E402

# --- the optimiser ---------------------------------------------------------------------------------------


def all_trees(depth: int, ranks: int, max_paths: int) -> set[frozenset]:
    """Every prefix-closed set of at most `max_paths` paths, by adding one frontier path at a time."""
    seen, todo = {frozenset()}, [frozenset()]
    while todo:
        tree = todo.pop()
        if len(tree) == max_paths:
            continue
        frontier = [(r,) for r in range(ranks)] + [p + (r,) for p in tree if len(p) < depth for r in range(ranks)]
        for path in frontier:
            bigger = tree | {path}
            if path not in tree and bigger not in seen:
                seen.add(bigger)
                todo.append(bigger)
    return seen


def random_p(rng: random.Random, depth: int, ranks: int) -> list[list[float]]:
    """Per depth, ranks whose probabilities sum to at most 1, not sorted; some ties and zeros."""
    p = []
    for _ in range(depth):
        row = [rng.choice([0.0, 0.25, 0.25, rng.random()]) for _ in range(ranks)]
        total = sum(row)
        p.append([x / total * rng.uniform(0.3, 1.0) if total else 0.0 for x in row])
    return p


@pytest.mark.parametrize("seed", range(6))
def test_greedy_growth_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    depth, ranks, max_paths = 3, 3, 5
    p = random_p(rng, depth, ranks)
    trees = all_trees(depth, ranks, max_paths)
    grown = grow_tree(p, max_paths + 1)
    for m in range(1, max_paths + 1):
        best = max(expected_accepted_length(t, p) for t in trees if len(t) == m)
        assert expected_accepted_length(grown[:m], p) == pytest.approx(best, abs=1e-12)
        assert len(build_tree(grown[:m]).paths) == m  # every prefix of the growth is a valid tree


def exact_mean_accepted_length(paths, p) -> float:
    """Enumerate every outcome of the independence model: at each depth one rank (or none) is the truth."""
    tree = set(map(tuple, paths))
    outcomes = [[(r, q) for r, q in enumerate(row)] + [(None, 1 - sum(row))] for row in p]
    total = 0.0
    for outcome in itertools.product(*outcomes):
        prob, length, path = 1.0, 1, ()
        for _, q in outcome:
            prob *= q
        for r, _ in outcome:
            if r is None or path + (r,) not in tree:
                break
            path += (r,)
            length += 1
        total += prob * length
    return total


def test_expected_length_is_the_mean_accepted_length_of_the_model():
    p = [[0.5, 0.2], [0.4, 0.1]]
    paths = [[0], [1], [0, 0], [0, 1], [1, 0]]
    assert path_probability([0, 1], p) == pytest.approx(0.05)
    assert expected_accepted_length(paths, p) == pytest.approx(1 + 0.5 + 0.2 + 0.2 + 0.05 + 0.08)
    assert expected_accepted_length(paths, p) == pytest.approx(exact_mean_accepted_length(paths, p))
    assert expected_accepted_length([[0], [5], [0, 0, 0]], p) == pytest.approx(1.5)  # beyond p: never accepted


def test_growth_order_and_errors():
    p = [[0.5, 0.3], [0.9, 0.05]]
    assert grow_tree(p, 5) == [(0,), (0, 0), (1,), (1, 0)]
    assert grow_tree(p, 100)[-1:] == [(1, 1)] and len(grow_tree(p, 100)) == 6  # every path there is
    with pytest.raises(MedusaError, match="not in"):
        grow_tree([[0.5, 1.5]], 4)
    with pytest.raises(MedusaError, match="non-empty"):
        grow_tree([], 4)
    with pytest.raises(MedusaError, match="at least 1 node"):
        grow_tree(p, 0)


P_CPU = [[0.40, 0.11, 0.06, 0.04], [0.35, 0.10, 0.05, 0.03], [0.30, 0.08, 0.05], [0.25, 0.07]]


def test_budget_follows_the_cost_curve():
    n_max = 32
    flat = fit_tree(P_CPU, [1.0] * n_max)
    assert flat.budget == len(grow_tree(P_CPU, n_max)) + 1  # free nodes: as many as there are
    steep = fit_tree(P_CPU, [1.0 + 0.5 * (n - 1) for n in range(1, n_max + 1)])
    assert steep.budget == 2 and steep.predicted_speedup < 1
    # A curve like fp32 on a CPU: the choice is the argmax of E(n) / cost(n), checked by hand.
    cost = [1.0 + 0.06 * (n - 1) for n in range(1, n_max + 1)]
    fitted = fit_tree(P_CPU, cost)
    ratios = {n: fitted.expected[n - 1] / cost[n - 1] for n in range(2, n_max + 1)}
    assert fitted.budget == max(ratios, key=ratios.get)
    assert 2 < fitted.budget < n_max
    assert choose_budget([1.0, 1.5, 1.5], [1.0, 1.0, 1.0]) == 2  # ties: the smaller tree
    assert choose_budget([1.0, 1.1], [1.0, 1.2]) == 1
    with pytest.raises(MedusaError):
        fit_tree(P_CPU, [1.0])
    forced = fit_tree(P_CPU, cost, budget=9)
    assert forced.budget == 9 and forced.paths == tuple(sorted(grow_tree(P_CPU, 9), key=lambda p: (len(p), p)))
    with pytest.raises(MedusaError, match="outside 2..32"):
        fit_tree(P_CPU, cost, budget=40)


def test_tree_file_round_trips(tmp_path):
    calibration = Calibration(top_k=4, positions=[100, 40, 12, 3], hits=[[40, 11, 6, 4], [14, 4, 2, 1],
                                                                         [4, 1, 1, 0], [1, 0, 0, 0]])
    profile = LatencyProfile(model="m", heads="medusa-4x1", device="cpu", dtype="float32", threads=1,
                             sizes=[1, 4, 16], contexts=[128], step_ms={"128": [30.0, 36.0, 60.0]}, repeats=3)
    fitted = fit_tree(calibration.p, profile.relative_cost(16))
    out = tmp_path / "fitted.json"
    write_tree(fitted, out, calibration.as_dict(), profile.as_dict())
    data = json.loads(out.read_text())
    assert load_tree(out) == fitted.paths
    assert build_tree(load_tree(out)).size == data["budget"] == fitted.budget
    assert data["expected_accepted_length"] == pytest.approx(expected_accepted_length(fitted.paths, calibration.p),
                                                              abs=1e-4)
    assert load_calibration(out) == calibration
    assert load_profile(out) == profile
    assert profile.relative_cost(16)[3] == pytest.approx(36 / 30) and profile.relative_cost(16)[9] == pytest.approx(1.6)


# --- calibration ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bigram_model():
    """A tiny Llama whose attention and MLPs are switched off: its next token depends on the last token
    only, so a head that runs the backbone on the path's last token is an oracle."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    backbone = LlamaForCausalLM(config).eval().requires_grad_(False)
    for layer in backbone.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    backbone.generation_config.eos_token_id = None
    return MedusaModel(backbone, untrained_heads(backbone, "tiny-bigram", num_heads=3))


class OracleModel(MedusaModel):
    """Guesses with the backbone itself after the path's last token; the truth is put at rank `truth_rank`,
    and from depth `blind_from` on the guesses ignore the path (wrong)."""

    def __init__(self, model: MedusaModel, truth_rank: int = 0, blind_from: int = 99):
        super().__init__(model.backbone, model.heads)
        self.truth_rank, self.blind_from = truth_rank, blind_from

    def head_topk(self, hidden, paths, k):
        depth = paths.shape[1] - 1
        last = paths[:, -1:] if depth < self.blind_from else torch.zeros_like(paths[:, -1:])
        logits = self.backbone(input_ids=last).logits[:, -1].float()
        top = logits.topk(k, dim=-1)
        order = list(range(k))
        order[0], order[self.truth_rank] = order[self.truth_rank], order[0]
        return top.indices[:, order], top.values[:, order]


def greedy_conversations(model: MedusaModel, n: int = 3, prompt_len: int = 6, answer_len: int = 20):
    """Answers made on the fly: the backbone's own greedy continuations of random prompts."""
    rows = []
    for seed in range(n):
        prompt = torch.randint(0, 64, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
        out = model.backbone.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                      max_new_tokens=answer_len, eos_token_id=None)[0].tolist()
        rows.append((out, [0] * prompt_len + [1] * answer_len))
    return rows


def test_an_oracle_is_always_accepted(bigram_model):
    conversations = greedy_conversations(bigram_model)
    for truth_rank in (0, 2):
        calibration = calibrate(OracleModel(bigram_model, truth_rank), conversations, top_k=4)
        assert calibration.conversations == 3
        # A root at every answer token but the last, each walk as deep as the answer allows.
        assert calibration.positions == [3 * 19, 3 * 18, 3 * 17]
        for row in calibration.p:
            assert row == [1.0 if r == truth_rank else 0.0 for r in range(4)]


def test_acceptance_is_conditional_on_the_parent(bigram_model):
    calibration = calibrate(OracleModel(bigram_model, blind_from=1), greedy_conversations(bigram_model), top_k=4)
    assert calibration.p[0] == [1.0, 0.0, 0.0, 0.0]
    assert calibration.positions[1] == 3 * 18
    assert sum(calibration.hits[1]) < calibration.positions[1]  # the blind head is mostly wrong...
    # ...and its misses end the walks: depth 3 is counted only below its hits.
    assert calibration.positions[2] <= sum(calibration.hits[1][:4])


def test_real_heads_give_consistent_counts(bigram_model):
    calibration = calibrate(bigram_model, greedy_conversations(bigram_model), top_k=5)
    assert calibration.positions[0] == 3 * 19
    for d in range(2):
        assert calibration.positions[d + 1] <= sum(calibration.hits[d]) <= calibration.positions[d]
    assert all(0 <= x <= 1 for row in calibration.p for x in row)


@pytest.mark.parametrize("head_type", ["medusa", "hydra"])
def test_head_topk_takes_one_hidden_state_per_path(bigram_model, head_type):
    """Calibration asks for many roots' children in one call; it must equal one call per root."""
    backbone = bigram_model.backbone
    try:
        heads = untrained_heads(backbone, "tiny-bigram", num_heads=3, head_type=head_type)
    except TypeError:
        pytest.skip("these heads have no head_type")
    torch.manual_seed(1)
    for param in heads.parameters():
        param.data.normal_(0, 0.3)
    model = MedusaModel(backbone, heads)
    hidden, paths = torch.randn(5, 32), torch.randint(0, 64, (5, 3))
    tokens, logprobs = model.head_topk(hidden, paths, 4)
    for i in range(5):
        one_tokens, one_logprobs = model.head_topk(hidden[i], paths[i : i + 1], 4)
        assert torch.equal(tokens[i], one_tokens[0])
        torch.testing.assert_close(logprobs[i], one_logprobs[0])


def test_reading_conversations(tmp_path, tokenizer):
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"Say {i}."},
                                        {"role": "assistant", "content": str(i)}], "answer_ids": [28 + i, 2]}
            for i in range(4)]
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "4", "mess')  # a row being written
    conversations = to_conversations(read_rows(data), tokenizer)
    assert len(conversations) == 4
    ids, mask = conversations[1]
    assert ids[-2:] == [29, 2] and mask[-2:] == [1, 1] and mask[0] == 0
    assert [r["id"] for r in read_rows(data, parse_rows("2:"))] == ["2", "3"]
    assert [r["id"] for r in read_rows(data, parse_rows("-1:"))] == ["3"]
    with pytest.raises(MedusaError, match="START:END"):
        parse_rows("5")
    with pytest.raises(MedusaError, match=r"no rows in 10:\."):
        read_rows(data, parse_rows("10:"))
    with pytest.raises(MedusaError, match="no assistant answers"):
        to_conversations([{"messages": [{"role": "user", "content": "hi"}]}], tokenizer)
    (tmp_path / "bad.jsonl").write_text('{"messages": [}\n')
    with pytest.raises(MedusaError, match="bad.jsonl:1 is not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")


def test_calibration_files_are_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"top_k": 2, "positions": [10], "hits": [[8, 5]]}))
    with pytest.raises(MedusaError, match="inconsistent"):
        load_calibration(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(MedusaError, match="no calibration"):
        load_calibration(bad)


# --- the latency profile --------------------------------------------------------------------------------


def test_the_profile_s_steps_gather_the_deepest_path(bigram_model):
    """A timed step accepts the tree's deepest path whatever the tokens, so that it pays for a real cache gather."""
    from medusa_heads.apps.profile import _DeepestPath, synthetic_tree
    from medusa_heads.inference import DecodeState, MedusaDrafter
    from medusa_heads.inference.cache import TreeCache
    from medusa_heads.inference.generate import prefill, tree_decode_step

    tree = synthetic_tree(bigram_model, 8)
    ids = list(range(1, 11))
    cache = TreeCache(bigram_model.backbone, 1, 32)
    _, hidden = prefill(bigram_model, [ids[:-1]], cache)
    state = DecodeState(ids, ids[-1], hidden[0, -1])
    accepted, new, _ = tree_decode_step(bigram_model, MedusaDrafter(bigram_model, tree), _DeepestPath(), cache, state)
    assert tree.max_depth >= 2 and accepted.depth == tree.max_depth and len(new) == tree.max_depth + 1


def _cpuinfo(family: int, flags: str) -> str:
    return "".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 2\n"
                   f"model name\t: AMD EPYC\nflags\t\t: fpu {flags} sse\n\n" for i in range(2))


def test_profiles_of_cpu_generations_named_alike_are_cached_apart(bigram_model, tmp_path, monkeypatch):
    zen4, zen5 = _cpuinfo(25, "avx2 avx512f avx512_bf16"), _cpuinfo(26, "avx512_vnni avx2 avx512f avx512_bf16")
    assert cpu_description(zen4, "x86_64") == ("AMD EPYC (x86_64, family 25 model 2)", ["avx2", "avx512f", "avx512_bf16"])
    assert cpu_description(zen5, "x86_64")[1] == ["avx2", "avx512f", "avx512_bf16", "avx512_vnni"]
    assert cpu_description("", "aarch64")[1] == []
    monkeypatch.setenv("MEDUSA_HEADS_HOME", str(tmp_path))
    paths = []
    for text in (zen4, zen5):
        monkeypatch.setattr("medusa_heads.device._cpuinfo", lambda text=text: text)
        paths.append(profile_path(bigram_model))
    assert paths[0] != paths[1] and "family-25" in paths[0].name


def test_profile_measures_and_is_cached(bigram_model, tmp_path, monkeypatch):
    monkeypatch.setenv("MEDUSA_HEADS_HOME", str(tmp_path))
    profile = measure_profile(bigram_model, sizes=[1, 2, 6], contexts=[8, 32], repeats=2, warmup=1)
    assert profile.sizes == [1, 2, 6] and set(profile.step_ms) == {"8", "32"}
    assert all(len(ms) == 3 and min(ms) > 0 for ms in profile.step_ms.values())
    cost = profile.relative_cost(6)
    assert len(cost) == 6 and cost[0] == 1.0
    with pytest.raises(MedusaError, match="up to 6 nodes"):
        profile.relative_cost(7)

    first, path = cached_profile(bigram_model, 6, contexts=[8], repeats=1, warmup=0)
    assert path == profile_path(bigram_model) and path.is_relative_to(tmp_path / "profiles")
    assert "float32" in path.name and f"{torch.get_num_threads()}threads" in path.name
    assert first.sizes == [1, 2, 4, 6]

    def no_measuring(*args, **kwargs):
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr("medusa_heads.apps.profile.measure_profile", no_measuring)
    assert cached_profile(bigram_model, 4)[0] == first
    with pytest.raises(MedusaError, match="exceeds the model's context"):
        measure_profile(bigram_model, sizes=[1, 64], contexts=[200])


# --- the CLI --------------------------------------------------------------------------------------------


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """The CLI in this process (a subprocess costs seconds of imports per call on this machine)."""
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clean_error(result, needle):
    code, _, err = result
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("medusa-heads: error: ") and needle in lines[0], err


@pytest.fixture
def fitted_inputs(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps(Calibration(3, [100, 40], [[40, 10, 5], [15, 4, 2]]).as_dict()))
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LatencyProfile("m", "medusa-2x1", "cpu", "float32", 1, [1, 8], [128],
                                                 {"128": [30.0, 40.0]}, 3).as_dict()))
    return calibration, profile


def test_cli_fits_a_tree_from_files(tmp_path, fitted_inputs, capsys):
    calibration, profile = fitted_inputs
    out = tmp_path / "tree.json"
    code, stdout, stderr = run_cli(capsys, "tree", "optimize", "--calibration", str(calibration), "--profile",
                                   str(profile), "--max-nodes", "8", "--out", str(out))
    assert code == 0, stderr
    assert "chosen budget:" in stdout
    assert len(load_tree(out)) + 1 == json.loads(out.read_text())["budget"]


def test_cli_bad_inputs(tmp_path, fitted_inputs, capsys):
    calibration, profile = fitted_inputs
    out = str(tmp_path / "tree.json")
    optimize = ["tree", "optimize", "--out", out]
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(tmp_path / "none.jsonl")), "does not exist")
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(tmp_path / "none.json")), "does not exist")
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(profile)), "no calibration")
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(calibration), "--profile", str(calibration)),
                       "not a latency profile")
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(calibration), "--profile", str(profile)),
                       "up to 8 nodes, not 64")
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(calibration), "--max-nodes", "1"), "at least 2")
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(calibration), "--rows", "x"), "START:END")
    assert_clean_error(run_cli(capsys, *optimize, "--calibration", str(calibration), "--budget", "1"), "--budget")
    assert_clean_error(run_cli(capsys, "profile", "--contexts", "128,big"), "comma-separated integers")
    assert_clean_error(run_cli(capsys, "profile", "--dtype", "float8"), "Unknown dtype")


def test_cli_replays_the_fitted_tree_as_decoding_commits(model, tokenizer, chat_prompts, references, tmp_path,
                                                         fitted_inputs, capsys):
    """From answers that are the backbone's own greedy output (fp32), the fitted tree's replayed tokens per step is
    what tree decoding of those prompts with that tree commits per step."""
    _, profile = fitted_inputs
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                     {"role": "assistant", "content": tokenizer.decode(answer)}],
                                        "answer_ids": answer}) + "\n"
                            for prompt, (_, answer) in zip(chat_prompts[:3], references[:3])))
    out = tmp_path / "tree.json"
    code, stdout, stderr = run_cli(capsys, "tree", "optimize", "--calibration", str(data), "--profile", str(profile),
                                   "--max-nodes", "8", "--top-k", "3", "--dtype", "float32", "--out", str(out))
    assert code == 0, stderr
    replayed = json.loads(out.read_text())["replayed_accepted_length"]
    assert f"replayed on the calibration answers: {replayed:.3f} tokens per step" in stdout
    drafter = make_drafter(model, "medusa", tree=str(out))
    tokens = steps = 0
    for ids, answer in references[:3]:
        stats = GenerationStats()
        assert decode(model, ids, drafter, max_new_tokens=len(answer), stats=stats) == answer
        tokens, steps = tokens + len(answer) - 1, steps + stats.steps
    assert tokens / steps > 1.2 and replayed == pytest.approx(tokens / steps, abs=1e-4)
