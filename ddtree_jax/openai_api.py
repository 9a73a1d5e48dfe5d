"""The OpenAI-compatible request fields and error answers: every field both endpoints share, checked into
:class:`Options`, and :class:`ApiError`, the ``{"error": {"message", "type", "param", "code"}}`` body with its HTTP
status (400 for a bad request, 429 when the engine's queue is full, 503 when the engine is closed).

Beyond OpenAI's fields it takes vLLM's ``top_k``, ``stop_token_ids``, ``ignore_eos`` and ``return_token_ids``;
fields it cannot honour (``n`` > 1, logprobs, penalties, ...) get 400 rather than being ignored.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ddtree_jax.requests import SEED_LIMIT, EngineClosed, QueueFull, RequestError, SamplingParams

MAX_STOP_STRINGS = 16
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


# ---------------------------------------------------------------------------------------------- errors
class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming the field (``param``) at fault."""
    return ApiError(400, message, param=param, code=code)


def from_engine(e: Exception) -> ApiError:
    """The engine's refusal of a request (bad request, full queue, closed engine) as its API error; any other
    exception is raised again."""
    if isinstance(e, RequestError):
        return bad_request(str(e), e.param, e.code)
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, EngineClosed):
        return ApiError(503, str(e), type="server_error", code="unavailable", headers={"Retry-After": "5"})
    raise e


# ---------------------------------------------------------------------------------------------- fields
def is_int(v: Any) -> bool:
    """An integer JSON value (true and false are not)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {rng}, got {v}", name)
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or v != v:
        raise bad_request(f"'{name}' must be a number, got {json.dumps(v)}", name)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad_request(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def bool_field(body: dict, name: str, default: bool = False) -> bool:
    """``body[name]`` as a bool, ``default`` when absent or null; 400 for anything but true or false."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def _unsupported(body: dict, name: str, default: Any = None, what: str | None = None) -> None:
    v = body.get(name)
    if v is None or v == default or (isinstance(v, (dict, list)) and not v and not default):
        return
    raise bad_request(f"'{name}' {what or 'is not supported by this server'}", name)


@dataclasses.dataclass
class Options:
    """The request fields both endpoints share, checked."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids)


def parse_options(body: dict, *, chat: bool) -> Options:
    """The shared fields of a /v1/completions (or, with ``chat``, /v1/chat/completions) body, checked; 400 for a
    field out of range or one this server does not support."""
    for name in ("n", "best_of"):
        if _int(body, name, 1) != 1:
            raise bad_request(f"'{name}' must be 1: one choice per prompt is supported", name)
    _unsupported(body, "logprobs", False if chat else None, "(log probabilities) is not supported")
    _unsupported(body, "top_logprobs", None, "(log probabilities) is not supported")
    _unsupported(body, "echo", False)
    _unsupported(body, "suffix", None)
    _unsupported(body, "logit_bias", None)
    _unsupported(body, "tools", None)
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, 0.0, -2.0, 2.0)
        _unsupported(body, name, 0, "must be 0: penalties are not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")

    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or any(not is_int(t) for t in stop_ids):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    top_k = _int(body, "top_k", 0, -1)
    stream = bool_field(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if so and not stream:
        raise bad_request("'stream_options' is only allowed with stream: true", "stream_options")
    return Options(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),
        seed=_int(body, "seed", None, 0, SEED_LIMIT - 1),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool_field(body, "ignore_eos"),
        stream=stream,
        include_usage=bool(so and bool_field(so, "include_usage")),
        return_token_ids=bool_field(body, "return_token_ids"),
    )
