"""Text of a growing answer, decoded incrementally: streaming and stop strings without re-decoding the whole answer
each step."""

from typing import Sequence

from transformers import PreTrainedTokenizerBase


class TextStream:
    r"""
    The text of token ids that arrive in pieces. Each `add` decodes only a window of recent tokens: the text new
    ids add is what decoding the window with them gives beyond decoding it without them, so a tokenizer's
    handling of word starts stays as in a decode of the whole sequence. A piece that ends inside a multi-byte
    character is held back until the character is complete.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything returned so far
        self._prefix = 0  # the window starts here ...
        self._read = 0  # ... and its text up to here is already in `text`

    @property
    def complete(self) -> int:
        """How many of `ids` have all their text in `text` (the rest wait for a character to complete)."""
        return self._read

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: Sequence[int]) -> str:
        """Append `ids`; returns the text they complete ("" while a character is incomplete)."""
        self.ids.extend(ids)
        known = self._decode(self.ids[self._prefix : self._read])
        window = self._decode(self.ids[self._prefix :])
        if len(window) <= len(known) or window.endswith("\ufffd"):
            return ""
        piece = window[len(known) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end, as the tokenizer decodes it)."""
        piece = self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
        self._prefix = self._read = len(self.ids)
        self.text += piece
        return piece


class StopStrings:
    r"""
    `stop(ids)` for `generate_ids`: called with the new ids so far (each call extends the previous one), returns
    how many of them to keep when one of `strings` appears in their text (the shortest prefix containing it),
    else None. Only the new text is searched, with enough of the old to catch a string spanning both.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: Sequence[str]):
        self.strings = [s for s in strings if s]
        self.text = TextStream(tokenizer)
        self.longest = max((len(s) for s in self.strings), default=0)

    def __call__(self, ids: list[int]) -> int | None:
        seen, complete = len(self.text.ids), self.text.complete
        assert ids[:seen] == self.text.ids, "stop strings are checked on a growing sequence"
        start = max(len(self.text.text) - self.longest + 1, 0)
        self.text.add(ids[seen:])
        if not any(s in self.text.text[start:] for s in self.strings):
            return None
        for n in range(complete + 1, len(ids) + 1):  # the text of the first `complete` ids had no stop string
            text = self.text.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if any(s in text for s in self.strings):
                return n
        return len(ids)
