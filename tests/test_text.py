"""Incremental detokenization against decoding the whole sequence, on text with multi-byte characters, special
tokens and word starts, cut into pieces at random."""

import random

import pytest

from medusa_heads.inference.text import StopStrings, TextStream

TEXTS = [
    "Hello world! Les élèves ont mangé des crêpes — très bien. 日本の首都は東京です。 Emoji: 🙂🚀 done.",
    "def f(x):\n    return x ** 2  # squares\n\n\n<|im_end|> after the end token",
    "  leading spaces, tabs\tand ünïcödé; 1,234.5 ... ok",
]


def random_pieces(ids: list[int], rng: random.Random) -> list[list[int]]:
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        pieces.append(ids[i : i + n])
        i += n
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_the_pieces_add_up_to_the_whole_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(0)
    for _ in range(20):
        stream = TextStream(tokenizer)
        pieces = [stream.add(chunk) for chunk in random_pieces(ids, rng)] + [stream.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any("\ufffd" in p for p in pieces[:-1])


@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_keep_the_shortest_prefix_that_contains_one(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    rng = random.Random(1)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    for _ in range(10):
        start = rng.randrange(len(whole) - 4)
        strings = ["never there", whole[start : start + rng.randint(1, 4)]]
        expected = next(n for n in range(1, len(ids) + 1)
                        if any(s in tokenizer.decode(ids[:n], skip_special_tokens=True) for s in strings))
        stop, seen, kept = StopStrings(tokenizer, strings), [], None
        for chunk in random_pieces(ids, rng):
            seen += chunk
            if (kept := stop(seen)) is not None:
                break
        assert kept == expected, (strings, kept, expected)
    assert StopStrings(tokenizer, ["zzz-not-in-text"])(ids) is None


class WordStartTokenizer:
    """A SentencePiece-like decoder: `▁` marks a word start and decodes to a space, except at the start of the
    decoded text. Decoding is then not concatenative: a piece decoded alone loses its leading space."""

    words = ["▁Hello", ",", "▁wor", "ld", "▁and", "▁good", "bye", "."]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_word_starts_survive_the_cut_between_pieces():
    tokenizer, ids = WordStartTokenizer(), [0, 1, 2, 3, 4, 5, 6, 7]
    for cut in range(1, len(ids)):
        stream = TextStream(tokenizer)
        pieces = [stream.add(ids[:cut]), stream.add(ids[cut:]), stream.flush()]
        assert "".join(pieces) == "Hello, world and goodbye."
