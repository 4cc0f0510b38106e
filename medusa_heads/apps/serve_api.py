"""The OpenAI wire format the server speaks: request bodies, error bodies, responses and stream chunks.

Fields OpenAI has and the server does not use (`logprobs`, `presence_penalty`, `user`, ...) are ignored; `n` other
than 1 is refused. `top_k` is an extension (as in vLLM). Types are strict: `"16"` is not a `max_tokens`.
"""

import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_MAX_TOKENS = 256


class APIError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    model: str | None = None  # the served model when left out
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: all tokens
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_dict(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    @property
    def new_tokens(self) -> int:
        return self.max_completion_tokens or super().new_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError("give one prompt")
        return prompt

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


@dataclass(frozen=True)
class Format:
    """How one endpoint's responses and stream chunks look: chat (`message` / `delta`) or text completion."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> "Format":
        return cls(chat, model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()))

    def _envelope(self, chunk: bool, choices: list[dict]) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def response(self, text: str, finish_reason: str, usage: dict, speculative: dict) -> dict:
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = {"index": 0, **content, "finish_reason": finish_reason, "logprobs": None}
        return {**self._envelope(False, [choice]), "usage": usage, "speculative": speculative}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        """A stream chunk with new text (None: none, for the last chunk); `role` starts a chat answer."""
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({} if text is None else {"content": text})
            content = {"delta": delta}
        else:
            content = {"text": text or ""}
        return self._envelope(True, [{"index": 0, **content, "finish_reason": finish_reason, "logprobs": None}])

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(True, []), "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
