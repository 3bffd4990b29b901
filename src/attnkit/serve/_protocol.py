"""The OpenAI request bodies the server takes, checked field by field, and its error JSON.

A bad field is an :class:`ApiError` (HTTP 400, OpenAI's ``{"error": {"message", "type", "param", "code"}}``)
naming the field, the value and what it should be.  Fields are typed as OpenAI documents them; the sampling
fields beyond OpenAI's (``top_k``, ``min_p``, ``repetition_penalty``) are vLLM's.  Unknown fields are refused
(OpenAI: "Unrecognized request argument supplied"), and so are OpenAI features attnkit does not have (tools,
JSON modes, ``echo``, ``suffix``, ``best_of``) when set to anything but their default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["ApiError", "GenerationRequest", "parse_completion", "parse_chat", "error_body"]

MAX_N = 16  # choices per request
MAX_TOP_LOGPROBS = 20
MAX_STOPS = 8


class ApiError(Exception):
    """An error answered as OpenAI's error JSON with HTTP ``status``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class GenerationRequest:
    """One checked request: its prompts (token ids, one per prompt), the Engine sampling arguments, and how
    to answer (``stream``, ``n`` choices per prompt, stop strings, log-probabilities)."""

    model: str
    prompts: list[list[int]]
    max_tokens: int | None
    sampling: dict = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no log-probabilities
    chat: bool = False
    max_tokens_field: str = "max_tokens"  # the field that set max_tokens (chat: or max_completion_tokens)


# ------------------------------------------------------------------------------ field checks


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _int(body: dict, name: str, *, low: int | None = None, high: int | None = None, default=None):
    x = body.get(name)
    if x is None:
        return default
    if not _is_int(x):
        raise ApiError(f"{name}={x!r} must be an integer", name)
    if (low is not None and x < low) or (high is not None and x > high):
        span = f">= {low}" if high is None else f"between {low} and {high}"
        raise ApiError(f"{name}={x} must be {span}", name)
    return x


def _number(
    body: dict,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    default=None,
    why: str = "",
):
    x = body.get(name)
    if x is None:
        return default
    if not _is_number(x):
        raise ApiError(f"{name}={x!r} must be a finite number", name)
    if low is not None and (x < low or (low_open and x == low)):
        raise ApiError(f"{name}={x} must be {'>' if low_open else '>='} {low}{why}", name)
    if high is not None and x > high:
        raise ApiError(f"{name}={x} must be <= {high}{why}", name)
    return float(x)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    x = body.get(name)
    if x is None:
        return default
    if not isinstance(x, bool):
        raise ApiError(f"{name}={x!r} must be true or false", name)
    return x


def _stop(body: dict) -> list[str]:
    x = body.get("stop")
    if x is None:
        return []
    stops = [x] if isinstance(x, str) else x
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(f"stop={x!r:.80} must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(f"stop holds {len(stops)} strings: at most {MAX_STOPS}", "stop")
    if any(not s for s in stops):
        raise ApiError("stop holds an empty string: each stop string needs at least one character", "stop")
    return list(stops)


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float] | None:
    x = body.get("logit_bias")
    if x is None:
        return None
    if not isinstance(x, dict):
        raise ApiError(f"logit_bias={x!r:.80} must be an object mapping token ids to a bias", "logit_bias")
    out = {}
    for k, v in x.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise ApiError(f"logit_bias key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= t < vocab_size:
            raise ApiError(f"logit_bias key {t} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not _is_number(v) or not -100 <= v <= 100:
            raise ApiError(f"logit_bias[{k!r}]={v!r} must be a number between -100 and 100", "logit_bias")
        out[t] = float(v)
    return out


_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop",
    "seed",
    "n",
    "stream",
    "stream_options",
    "user",
    "logprobs",
}
_UNSUPPORTED = {  # field -> the value it may have here (its default)
    "echo": False,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "parallel_tool_calls": None,
    "audio": None,
    "modalities": None,
    "prediction": None,
    "web_search_options": None,
}


def _refuse_unknown(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in _UNSUPPORTED:
            if value not in (_UNSUPPORTED[name], None):
                raise ApiError(
                    f"{name}={value!r:.80} is not supported by this server (attnkit generates plain text)", name
                )
        elif name not in allowed:
            raise ApiError(f"Unrecognized request argument supplied: {name}", name)


def _common(body: dict, ctx, allowed: set[str], chat: bool) -> GenerationRequest:
    """The fields completions and chat share; ``ctx`` knows the model (``name``, ``vocab_size``)."""
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_unknown(body, allowed)
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(f"model={model!r:.80} must be a string naming the model (GET /v1/models lists it)", "model")
    if model != ctx.name:
        raise ApiError(
            f"The model {model!r} does not exist: this server serves {ctx.name!r}",
            "model",
            status=404,
            code="model_not_found",
        )
    limit_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, limit_field, low=1)
    sampling = {
        "temperature": _number(body, "temperature", low=0.0, default=1.0, why=" (0 is greedy)"),
        "top_p": _number(body, "top_p", low=0.0, high=1.0, low_open=True),
        "min_p": _number(body, "min_p", low=0.0, high=1.0),
        "presence_penalty": _number(
            body,
            "presence_penalty",
            low=-2.0,
            high=2.0,
            default=0.0,
            why=" (OpenAI's range; below 0 rewards repeating a token)",
        ),
        "frequency_penalty": _number(
            body,
            "frequency_penalty",
            low=-2.0,
            high=2.0,
            default=0.0,
            why=" (OpenAI's range; below 0 rewards repeating a token)",
        ),
        "repetition_penalty": _number(
            body, "repetition_penalty", low=0.0, low_open=True, default=1.0, why=" (1 is no penalty)"
        ),
        "logit_bias": _logit_bias(body, ctx.vocab_size),
        "seed": _int(body, "seed"),
    }
    top_k = _int(body, "top_k", low=-1)
    sampling["top_k"] = None if top_k in (None, -1, 0) else top_k  # (vLLM: -1 or 0 means no top-k)
    n = _int(body, "n", low=1, high=MAX_N, default=1)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise ApiError(
                f'stream_options={options!r:.80} must be an object like {{"include_usage": true}}', "stream_options"
            )
        if not stream:
            raise ApiError("stream_options is only allowed with stream=true", "stream_options")
        include_usage = _bool(options, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(f"user={user!r:.80} must be a string", "user")
    return GenerationRequest(
        model, [], max_tokens, sampling, _stop(body), n, stream, include_usage, chat=chat, max_tokens_field=limit_field
    )


def parse_completion(body, ctx) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a list of
    such lists; ``logprobs`` an integer (the alternatives per token)."""
    req = _common(body, ctx, _COMMON | {"prompt", "best_of"}, chat=False)
    best_of = _int(body, "best_of", low=1)
    if best_of is not None and best_of != req.n:
        raise ApiError(f"best_of={best_of} is not supported here (only best_of = n)", "best_of")
    req.logprobs = _int(body, "logprobs", low=0, high=MAX_TOP_LOGPROBS)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        prompts = [list(p) for p in prompt]
    else:
        raise ApiError(
            f"prompt={prompt!r:.80} must be a non-empty string, a list of strings, a list of token ids "
            f"or a list of such lists",
            "prompt",
        )
    out = []
    for p in prompts:
        ids = ctx.encode(p) if isinstance(p, str) else p
        if not ids:
            raise ApiError(f"prompt {p!r:.40} encodes to no tokens", "prompt")
        bad = [t for t in ids if not 0 <= t < ctx.vocab_size]
        if bad:
            raise ApiError(f"prompt holds token ids {bad[:5]} outside the vocabulary [0, {ctx.vocab_size})", "prompt")
        out.append(ids)
    req.prompts = out
    return req


def _message_text(i: int, m) -> tuple[str, str]:
    if not isinstance(m, dict):
        raise ApiError(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "developer", "user", "assistant"):
        raise ApiError(
            f"messages[{i}].role={role!r:.40} must be 'system', 'developer', 'user' or 'assistant'", "messages"
        )
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(
                    f'messages[{i}].content[{j}] must be {{"type": "text", "text": ...}} (this server takes text only)',
                    "messages",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return role, content


def parse_chat(body, ctx) -> GenerationRequest:
    """``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template; ``logprobs``
    true or false with ``top_logprobs`` alternatives."""
    req = _common(
        body, ctx, _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format"}, chat=True
    )
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(
            f'response_format={fmt!r:.80} is not supported by this server (only {{"type": "text"}})', "response_format"
        )
    wants = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if top is not None and not wants:
        raise ApiError("top_logprobs needs logprobs=true", "top_logprobs")
    req.logprobs = (top or 0) if wants else None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(f"messages={messages!r:.80} must be a non-empty list of messages", "messages")
    ids = ctx.chat_encode([dict(zip(("role", "content"), _message_text(i, m))) for i, m in enumerate(messages)])
    if not ids:
        raise ApiError("the messages render to no tokens", "messages")
    req.prompts = [ids]
    return req
