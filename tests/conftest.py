import pytest
import torch

from medusa_heads import EMBEDDED_MODEL, MedusaModel, load_backbone, load_tokenizer
from medusa_heads.model import load_heads, shipped_heads, untrained_heads

torch.set_num_threads(max(torch.get_num_threads(), 1))

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
    heads = load_heads(folder) if folder else untrained_heads(backbone, EMBEDDED_MODEL)
    return MedusaModel(backbone, heads)


@pytest.fixture(scope="session")
def untrained_model(backbone):
    return MedusaModel(backbone, untrained_heads(backbone, EMBEDDED_MODEL))
