"""The target's own continuations of many prompts, at large batch, with the project's decode loop (method ar).

A fixed batch of ``batch`` rows decodes under ``decode.run_rounds``; every ``rounds_per_sync`` rounds the host reads
which rows are done, takes their outputs, and refills the free rows ``refill`` at a time (one prefill of a batch of
new prompts, scattered into the free rows on the device): finished rows stop costing work within a sync, instead of
decoding padding until the longest sequence of a static batch ends. Every prompt is padded to one length and every
row has one cache capacity, so the whole run compiles one prefill, one loop of rounds and one scatter. The host
handles the requests that finished at a sync while the device runs the next rounds.

Each request carries its own decoding (greedy, or sampled at its temperature with its own seed) and token
limit, so a single run can mix greedy and sampled responses, and short requests (self-instruct user turns) with long
ones. ``on_done`` may answer a finished request with new ones, which go to the front of the queue: self-instruct
writes a user turn, then the same run answers it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Iterable, Sequence

import jax.numpy as jnp
import numpy as np

from ddtree_jax import decode, slots
from ddtree_jax.results import final_length
from ddtree_jax.spec import NEVER, GenerateOptions, make_spec
from ddtree_jax.weight_layout import device_layout


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    tag: object = None  # the caller's (returned with the result)


@dataclasses.dataclass(frozen=True)
class Result:
    request: Request
    tokens: list[int]  # the generated ids (the stop token included when one ended it)
    stopped: bool  # a stop token ended it (else the token limit, or the deadline)


@dataclasses.dataclass
class Stats:
    generated_tokens: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    unfinished: int = 0  # cut by the deadline or a stop request (their partial responses are kept)
    compile_s: float = 0.0
    run_s: float = 0.0  # wall time of the loop, compilation excluded
    syncs: int = 0
    refills: int = 0
    batch: int = 0
    kv_bytes_read: int = 0  # the cache bytes the generated tokens' attention had to read (their contexts' K/V)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.run_s if self.run_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tokens_per_s"] = round(self.tokens_per_s, 1)
        d["kv_read_gb_per_s"] = round(self.kv_bytes_read / self.run_s / 1e9, 1) if self.run_s > 0 else None
        return d


put_rows = decode.donating_jit(slots.put_rows, donate_argnums=(0,))


def generate(target, requests: Iterable[Request], *, batch: int, max_prompt_tokens: int, max_new_tokens: int,
             stop_ids: Sequence[int] = (), refill: int | None = None, rounds_per_sync: int = 32,
             on_done: Callable[[Result], Iterable[Request]] | None = None, deadline: float | None = None,
             should_stop: Callable[[], bool] = lambda: False, progress: Callable[[int], object] | None = None,
             attention: str = "auto") -> tuple[list[Result], Stats]:
    """Decode every request (and those ``on_done`` adds) with the target; returns (results in completion order,
    statistics). Prompts longer than ``max_prompt_tokens`` or requests above ``max_new_tokens`` are a ValueError.

    deadline (``time.perf_counter()`` value) or ``should_stop()``: stop at the next sync; the rows still decoding
    come back cut (``stopped`` False), the queue is dropped. progress(n): called with the tokens generated since
    the last call."""
    tcfg, tparams = target
    tparams = device_layout(tparams, method="ddtree")  # the rounds' layout: a batch of rows is GEMMs
    refill = max(1, min(refill or max(1, batch // 16), batch))
    sampled = GenerateOptions(method="ar", max_new_tokens=max_new_tokens, temperature=1.0, attention=attention)
    spec = make_spec(tcfg, None, sampled)  # one program for greedy and sampled rows (no top-p / top-k)
    p_pad, capacity, out_len = decode.layout(spec, [max_prompt_tokens], max_new_tokens)
    dtype = tparams.embed.dtype
    kv_per_token = 2 * tcfg.num_layers * tcfg.num_kv_heads * tcfg.head_dim * jnp.dtype(dtype).itemsize
    queue = collections.deque(requests)
    stats = Stats(batch=batch)
    results: list[Result] = []
    job: list[Request | None] = [None] * batch
    stop_ids = tuple(stop_ids)

    def options(r: Request) -> GenerateOptions:
        if len(r.prompt) > max_prompt_tokens or not r.prompt:
            raise ValueError(f"prompt of {len(r.prompt)} tokens (1 to {max_prompt_tokens} allowed)")
        if not 1 <= r.max_new_tokens <= max_new_tokens:
            raise ValueError(f"max_new_tokens {r.max_new_tokens} outside 1..{max_new_tokens}")
        return GenerateOptions(method="ar", max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                               seed=r.seed, stop_token_ids=stop_ids)

    def new_rows(reqs: list[Request | None]):
        dummy = GenerateOptions(method="ar", max_new_tokens=1)
        lens = [len(r.prompt) if r else 1 for r in reqs]
        opts = [options(r) if r else dummy for r in reqs]
        tokens = np.zeros((len(reqs), p_pad), np.int32)
        for i, r in enumerate(reqs):
            if r:
                tokens[i, : len(r.prompt)] = r.prompt
        return decode.init_state(spec, lens, opts, capacity, out_len, dtype), jnp.asarray(tokens)

    t0 = time.perf_counter()
    state = slots.empty_slots(spec, batch, capacity, out_len, dtype)
    sub, toks = new_rows([None] * refill)
    prefill = decode.compiled(decode.prefill, spec, tparams, None, sub, toks)
    rounds = decode.compiled(decode.run_rounds, spec, tparams, None, state, jnp.int32(rounds_per_sync))
    put = put_rows.lower(state, jnp.zeros((refill,), jnp.int32), sub).compile()
    stats.compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    stopping = False
    answered: list[Result] = []  # finished at the last sync, for on_done while the device runs the next rounds
    while True:
        free = [i for i in range(batch) if job[i] is None]
        while queue and len(free) >= refill and not stopping:  # the queue's tail: dummies fill the batch
            reqs = [queue.popleft() if queue else None for _ in range(refill)]
            rows, free = free[:refill], free[refill:]
            sub, toks = new_rows(reqs)
            state = put(state, jnp.asarray(rows, jnp.int32), prefill(tparams, None, sub, toks))
            for i, r in zip(rows, reqs):
                job[i] = r
                stats.prompt_tokens += len(r.prompt) if r else 0
            stats.refills += 1
        if any(job):
            state = rounds(tparams, None, state, jnp.int32(rounds_per_sync))  # dispatched: the host goes on
        for res in answered:
            queue.extendleft(reversed(list(on_done(res))))  # follow-ups go first
        answered = []
        if not any(job):
            if queue and not stopping:
                continue
            break
        done, ends = np.asarray(state.done), final_length(state)
        stats.syncs += 1
        stopping = stopping or should_stop() or (deadline is not None and time.perf_counter() > deadline)
        finished = [i for i in range(batch) if job[i] is not None and (done[i] or stopping)]
        if finished:
            out, stop_at = np.asarray(state.out), np.asarray(state.stop_at)
            new = 0
            for i in finished:
                r = job[i]
                toks_i = out[i, len(r.prompt): ends[i]].tolist()
                res = Result(r, toks_i, bool(stop_at[i] < NEVER))
                results.append(res)
                n, p = len(toks_i), len(r.prompt)
                new += n
                stats.kv_bytes_read += kv_per_token * (p * n + n * (n - 1) // 2)
                if done[i]:
                    stats.finished += 1
                    if on_done is not None and not stopping:
                        answered.append(res)
                else:
                    stats.unfinished += 1
                job[i] = None
            stats.generated_tokens += new
            if progress is not None:
                progress(new)
        if stopping:
            queue.clear()
            if not any(job):
                break
    stats.run_s = time.perf_counter() - t0
    return results, stats

