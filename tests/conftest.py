import json
import os
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from medusa_heads import EMBEDDED_MODEL, MedusaModel, load_backbone, load_tokenizer
from medusa_heads.apps.cli import main
from medusa_heads.inference.generate import encode_prompt
from medusa_heads.model import SHIPPED_HEADS, load_heads, shipped_heads, untrained_heads

from oracle import hf_greedy  # noqa: E402  (pytest puts tests/ on sys.path)

MEDUSA_HEADS = SHIPPED_HEADS[EMBEDDED_MODEL].parent / "smollm2-135m-embedded-medusa"

torch.set_num_threads(max(torch.get_num_threads(), 1))
# The CLI's tests decode eagerly: compiling costs about 40 s a step size (tests/test_compiled_llama.py tests it)
os.environ.setdefault("MEDUSA_HEADS_COMPILE", "off")

# Fixtures of this file that load the real SmolLM2 model: a test using one (directly or through another fixture)
# is `slow`, as are training runs of half a minute or more. `pytest -m "not slow"` is the quick tier; `.ci/run` runs
# everything.
REAL_MODEL_FIXTURES = {"backbone", "model", "medusa_model", "untrained_model", "references", "random_hydra_model"}


def pytest_collection_modifyitems(items):
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name in REAL_MODEL_FIXTURES & set(item.fixturenames):
            definitions = info.name2fixturedefs.get(name, ())
            if definitions and definitions[-1].func.__module__ == __name__:  # not a test file's own fixture
                item.add_marker(pytest.mark.slow)
                break

# Chat prompts written for the tests (not the benchmark set).
CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "What is the capital of Japan, and what is it known for?",
    "Write a Python function that checks whether a number is even.",
    "Describe a sunset over the mountains.",
    "List four fruits that are rich in vitamin C.",
    "How do I make a cup of green tea?",
    "Summarize the plot of a heist movie in one paragraph.",
    "Why do cats purr?",
]


@pytest.fixture
def cli(capsys):
    """`main(args)` in this process (no interpreter start-up per call): its exit code and stderr."""

    def run(*args):
        capsys.readouterr()
        code = main(list(args))
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)

    return run


@pytest.fixture(scope="session")
def chat_prompts():
    return CHAT_PROMPTS


@pytest.fixture(scope="session")
def backbone():
    return load_backbone(EMBEDDED_MODEL, dtype=torch.float32)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture(scope="session")
def model(backbone):
    """The shipped heads when there are any, else untrained ones: exactness must hold for both."""
    folder = shipped_heads(EMBEDDED_MODEL)
    heads = load_heads(folder, dtype=torch.float32) if folder else untrained_heads(backbone, EMBEDDED_MODEL)
    return MedusaModel(backbone, heads)


@pytest.fixture(scope="session")
def medusa_model(backbone):
    """The shipped heads of the other type: Medusa heads, each reading only the last hidden state."""
    heads = load_heads(MEDUSA_HEADS, dtype=torch.float32)
    assert not heads.reads_tokens
    return MedusaModel(backbone, heads)


@pytest.fixture(scope="session")
def untrained_model(backbone):
    return MedusaModel(backbone, untrained_heads(backbone, EMBEDDED_MODEL))


@pytest.fixture(scope="session")
def references(backbone, tokenizer, chat_prompts):
    """(prompt ids, HF greedy continuation) for the first 6 chat prompts, computed once for all exactness tests."""
    return [(ids, hf_greedy(backbone, ids)) for ids in (encode_prompt(tokenizer, p) for p in chat_prompts[:6])]


@pytest.fixture(scope="session")
def random_hydra_model(backbone):
    """Hydra heads whose guesses depend on the path (random token mixers), over a random draft vocabulary."""
    torch.manual_seed(0)
    heads = untrained_heads(backbone, EMBEDDED_MODEL, head_type="hydra", draft_vocab=torch.randperm(49152)[:4096])
    for mixer in heads.mixers:
        mixer.weight.data.normal_(std=0.02)
    return MedusaModel(backbone, heads)


@pytest.fixture(scope="session")
def tiny_backbone(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
                         initializer_range=0.5)  # large logits, so that heads on 32 dims can move them
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def counting_data(tmp_path_factory):
    """Answers that count upwards: what comes 2-5 tokens later is predictable from the hidden state."""
    rng = random.Random(0)
    rows = []
    for i in range(96):
        start = rng.randrange(1, 50)
        answer = " ".join(str(n) for n in range(start, start + 24))
        rows.append({"messages": [{"role": "user", "content": f"Count from {start}."},
                                  {"role": "assistant", "content": answer}]})
    path = tmp_path_factory.mktemp("data") / "count.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
