"""The OpenAI wire format the server speaks: typed request and response models (pydantic, as FastAPI uses).

Requests follow the OpenAI API's rules where this engine can honour them:

* an argument the API does not have is rejected ("Unrecognized request argument supplied: NAME"), as the
  OpenAI API does, so a misspelt option never silently changes nothing;
* an argument the API has but this engine cannot honour (logprobs, penalties, tools, n > 1, echo, best_of,
  a non-text response format, ...) is accepted only at its neutral value and rejected otherwise, naming it;
* defaults are the API's: temperature 1, top_p 1, n 1; chat ``max_tokens`` defaults to what is left of
  the context after the prompt, completions ``max_tokens`` to 16.

``ApiError`` carries an OpenAI error object (message, type, param, code) and its HTTP status; the app
turns it into the JSON body ``{"error": {...}}``.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_STOP = 4  # the OpenAI API's limit on stop sequences


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the error object's fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> ApiError:
    """The first problem of a pydantic ValidationError as one OpenAI error (400)."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {loc}", param=loc or None)
    if err.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{loc}'.", param=loc or None, code="missing_required_parameter")
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return ApiError(400, f"Invalid value for '{loc}': {msg}" if loc else msg, param=loc or None,
                    code="invalid_value")


# ---- requests ---------------------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


def _neutral(name: str, value: Any, neutral: tuple) -> None:
    if value not in neutral:
        raise ValueError(f"'{name}' is not supported by this server (only {neutral[0]!r})")


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    user: Optional[str] = None  # accepted and ignored, as an end-user id is
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v):
        if v is not None and v < 1:
            raise ValueError(f"max_tokens must be at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        _neutral("presence_penalty", self.presence_penalty, (None, 0, 0.0))
        _neutral("frequency_penalty", self.frequency_penalty, (None, 0, 0.0))
        if self.logit_bias:
            raise ValueError("'logit_bias' is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        return self

    def stop_list(self) -> tuple:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self) -> tuple[float, float]:
        return (1.0 if self.temperature is None else self.temperature, 1.0 if self.top_p is None else self.top_p)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    response_format: Optional[dict] = None
    tools: Optional[list] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None

    @model_validator(mode="after")
    def _chat_unsupported(self):
        _neutral("logprobs", self.logprobs, (None, False))
        _neutral("top_logprobs", self.top_logprobs, (None, 0))
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("'response_format' is not supported by this server (only {'type': 'text'})")
        if self.tools:
            raise ValueError("'tools' are not supported by this server")
        _neutral("tool_choice", self.tool_choice, (None, "none"))
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}")
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("give max_tokens or max_completion_tokens, not two different values")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt must not be empty")
            if isinstance(v[0], (str, list)) and len(v) != 1:
                raise ValueError(f"only one prompt per request is supported (n=1 batching happens in the "
                                 f"server), got {len(v)}")
        return v

    @model_validator(mode="after")
    def _completion_unsupported(self):
        _neutral("echo", self.echo, (None, False))
        _neutral("logprobs", self.logprobs, (None, 0))
        _neutral("suffix", self.suffix, (None, ""))
        _neutral("best_of", self.best_of, (None, 1))
        return self

    def prompt_value(self) -> str | list[int]:
        """The one prompt: text, or token ids."""
        v = self.prompt
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            v = v[0]
        return v


# ---- responses --------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "runmap"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None


class Completion(BaseModel):
    """Both the whole completion and each streamed chunk (the API uses one object type for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


def finish_reason(engine_reason: str) -> str:
    """The engine's finish reasons in the API's words: an end-of-sequence token or a stop string is
    "stop", the token limit is "length"."""
    return "length" if engine_reason == "length" else "stop"
