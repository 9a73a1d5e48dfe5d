"""What a request to the engine is and what it gets back: its sampling parameters, the events its sink receives, the
finished completion, the host-side job the engine thread keeps for it (its text, cut at stop strings), and the errors
a submission may raise (the HTTP server maps them to 400, 429 and 503)."""

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

    @property
    def limit(self) -> int:
        """The output buffer's length at which the device ends the sequence: the prompt and max_tokens."""
        return len(self.prompt_ids) + self.params.max_tokens

    def push(self, new: list[int], *, final: bool) -> tuple[list[int], bool]:
        """Append tokens and their text, cut at a stop string; (the tokens taken, whether a stop string was hit)."""
        stops = self.params.stop
        taken: list[int] = []
        hit = False
        if self.decoder is None:
            taken = new
            self.text += "".join(f"{t} " for t in new)
        elif not stops:
            taken = new
            self.text += self.decoder.push(new)
            if final:
                self.text += self.decoder.flush()
        else:  # token by token, so the output ends at the token that completed the stop string
            for t in new:
                before = len(self.text)
                self.text += self.decoder.push([t])
                taken.append(t)
                if self._cut_at_stop(before):
                    hit = True
                    break
            if not hit and final:
                before = len(self.text)
                self.text += self.decoder.flush()
                hit = self._cut_at_stop(before)
        self.tokens.extend(taken)
        return taken, hit

    def unsent(self, *, final: bool) -> str:
        """The text to send now, marked sent: all of it at the end, else all but what may still start a stop string."""
        stops = self.params.stop
        hold = 0 if final or not stops else max(len(s) for s in stops) - 1
        visible = max(self.sent, len(self.text) - hold)
        piece = self.text[self.sent:visible]
        self.sent = visible
        return piece

    def _cut_at_stop(self, before: int) -> bool:
        """Cut self.text before the earliest stop string that ends after ``before``; True when one did."""
        longest = max(len(s) for s in self.params.stop)
        lo = max(0, before - longest + 1)
        found = [i for s in self.params.stop if (i := self.text.find(s, lo)) >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        self.sent = min(self.sent, len(self.text))
        return True
