"""What a request to the engine is and what it gets back: its sampling parameters, the events its sink receives, the
finished completion, the host-side job the engine thread keeps for it, and the errors a submission may raise (the
HTTP server maps them to 400, 429 and 503)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

SEED_LIMIT = 2**32  # jax.random.key takes a uint32 seed

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class RequestError(ValueError):
    """A request the engine cannot run (bad parameter, prompt too long): HTTP 400. ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFull(RuntimeError):
    """The waiting queue is at --max-queue: HTTP 429, try again later."""


class EngineClosed(RuntimeError):
    """The engine is stopping or has failed: HTTP 503."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: a random seed
    stop: tuple[str, ...] = ()  # stop strings, cut from the text (need a tokenizer)
    stop_token_ids: tuple[int, ...] = ()  # stop tokens, kept in the output like eos


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's sink receives: the tokens and text gained since the last event."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # set on the last event only
    error: str | None = None  # with finish_reason "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far


@dataclasses.dataclass
class Completion:
    """A finished request, as :meth:`Engine.generate` returns it."""

    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """One request on the host side. Only the engine thread changes it after submission."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    stop_ids: tuple[int, ...]
    seed: int
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    slot: int | None = None
    emitted: int = 0  # index in the slot's output buffer of the next token to deliver
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""  # decoded text so far (cut at a stop string)
    sent: int = 0  # characters of ``text`` already delivered
    decoder: object | None = None
    first_token_at: float | None = None
    finished: bool = False
