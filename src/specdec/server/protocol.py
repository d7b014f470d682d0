"""The OpenAI-compatible wire format `specdec serve` accepts and returns.

Requests are validated strictly (a string where a number belongs is a 400, not a silent
coercion); fields OpenAI defines but specdec does not implement are refused with a message that
names them, and fields nobody defines are ignored, as vLLM does. `ignore_eos` is the vLLM
extension benchmarks use to generate exactly `max_tokens` tokens.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

INT64 = (-(2**63), 2**63 - 1)  # vLLM's bounds for seed (torch.Generator.manual_seed takes 64 bits)
MAX_STOP_CHARS = 1000


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _content(self):
        # Only an assistant turn may come without content (one that called tools, in OpenAI's API).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class _SamplingFields(_Request):
    model: str | None = None  # None = the served model
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension

    @field_validator("model", mode="before")
    @classmethod
    def _model(cls, v):
        # Leaving the field out means the served model (as vLLM); an explicit null is a mistake.
        if v is None:
            raise ValueError("model is null: name the served model (GET /v1/models) or leave the field out")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        for s in [v] if isinstance(v, str) else v or []:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string of {len(s)} characters; at most {MAX_STOP_CHARS}")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a request asking for something specdec does not do."""
        if self.n != 1:
            return "n", f"n={self.n}: specdec serve generates one sequence per request (n=1)"
        if isinstance(self.stop, list) and len(self.stop) > 4:
            return "stop", f"{len(self.stop)} stop sequences given; at most 4 are allowed"
        return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    tools: list[dict] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs:
            return "logprobs", "logprobs are not supported by specdec serve"
        if self.tools:
            return "tools", "tool calling is not supported by specdec serve"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported by specdec serve"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported by specdec serve"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported by specdec serve"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by specdec serve"
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) != 1:
            return "prompt", f"{len(p)} prompts given; specdec serve takes one prompt per request"
        return super().unsupported()

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# -- responses -----------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
