"""Continuous batching over the on-device round loop: a fixed set of slots, a queue, one host thread.

The engine owns one batch :class:`decode.State` of ``max_batch`` slots, each sized for ``max_len``
tokens (prompt + generated), and one compiled :func:`step` that runs a few rounds for the whole batch
and returns what the host needs. Its thread loops::

    cancel   requests whose client went away end; their slots are marked done on device
    admit    waiting requests enter free slots: prefill a batch of one (decode.prefill), decode.insert it
    step     ``rounds_per_step`` rounds for every slot at once (done slots are skipped on device), then
             one small device->host copy (:class:`Snapshot`: each slot's new tokens, lengths, done flags)
    deliver  each slot's new tokens -> text (stop strings cut here) -> its request's sink; a request that
             ended frees its slot before its last event is sent

so new requests join between device calls, while the others keep decoding. Everything per request
(temperature, top_p, top_k, seed, max_tokens, stop token ids) lives in the slot's own arrays, set by
``decode.init_state`` at admission; sampling keys depend only on a request's own seed and positions
(``accept.node_keys``), so a seeded request gives the same tokens whatever else is in the batch.
Stop strings are matched on the host, on the decoded text: the text is cut before the stop string and
the slot is cancelled.

Shapes are static: every prompt is padded to a bucket (64, 128, 256, ... up to the longest allowed
prompt), so the engine compiles one step, one insert and one prefill per bucket. On a mesh
(``sharding.make_mesh``) the slots split over the data axis and the model over the model axis; decode's
jitted functions take the mesh from the Spec.

Requests talk to the engine through a *sink*: a callable that receives :class:`Event` objects, from the
engine thread. ``serve.py`` turns them into asyncio queue items; :meth:`Engine.generate` collects them
for blocking use. Every accepted request ends with exactly one event whose ``finish_reason`` is set
(``stop``, ``length``, ``cancelled`` or ``error``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import os
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import accept, decode, sharding
from ddtree_jax.tuning import Tuning

Array = jax.Array
log = logging.getLogger("ddtree_jax.engine")

MIN_BUCKET = 64  # shortest padded prompt: one prefill compilation covers every short prompt
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
class EngineConfig:
    method: str = "ddtree"  # ar | dflash | ddtree
    tree_budget: int = decode.DEFAULT_TREE_BUDGET
    max_batch: int = 8  # slots decoded together
    max_len: int = 2048  # prompt + generated tokens per sequence
    rounds_per_step: int = 4  # rounds per device call: streaming granularity vs. host round trips
    max_queue: int = 256  # requests that may wait while every slot is busy; more get QueueFull
    attention: str = "auto"
    # smaller slot batches, each compiled besides max_batch: a step runs the smallest one that holds the live
    # requests (gathered from and scattered back into the slot batch), so a ddtree verify with few live
    # requests does not pay for max_batch x (budget + 1) tokens
    batch_buckets: tuple[int, ...] = ()
    tuning: Tuning = Tuning()  # how the rounds run on the device (ddtree_jax.tuning)


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


# ----------------------------------------------------------------------------------------- device


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Snapshot:
    """What the host reads after a step, per slot [B]."""

    end: Array  # [B] final output length (cut at the limit and the first stop token)
    window: Array  # [B, W] out[start : start + W]
    done: Array  # [B] bool
    stopped: Array  # [B] bool: a stop token ended the sequence
    new_tokens: Array  # [B] tokens committed by this step's rounds
    new_rounds: Array  # [B] rounds this step ran for the slot


def device_final_length(state: decode.State) -> Array:
    """decode.final_length on device: [B] int32."""
    cut = jnp.minimum(state.n_out, state.limit)
    return jnp.minimum(cut, jnp.where(state.stop_at < decode.NEVER, state.stop_at + 1, state.n_out))


def _step(spec: decode.Spec, target, drafter, state: decode.State, starts: Array, rounds: int):
    """Run up to ``rounds`` rounds for the batch; return the new state and a :class:`Snapshot` whose
    window holds each slot's output from ``starts`` [B] (the first undelivered index) on."""
    n_out0, rounds0 = state.n_out, state.n_rounds
    state = decode.run_rounds(spec, target, drafter, state, jnp.int32(rounds))
    width = rounds * spec.path_len + 1
    idx = jnp.minimum(starts[:, None] + jnp.arange(width)[None], state.out.shape[1] - 1)
    snap = Snapshot(
        end=device_final_length(state),
        window=jnp.take_along_axis(state.out, idx, axis=1),
        done=state.done,
        stopped=state.stop_at < decode.NEVER,
        new_tokens=state.n_out - n_out0,
        new_rounds=state.n_rounds - rounds0,
    )
    return state, snap


# jax takes compiler options on top-level jits only: step_rows calls _step, and prefill wraps decode.prefill
step = decode.donating_jit(_step, static_argnums=(0, 5), donate_argnums=(3,), compiler_options=decode.XLA_OPTIONS)


@functools.partial(decode.donating_jit, static_argnums=(0,), donate_argnums=(3,), compiler_options=decode.XLA_OPTIONS)
def prefill(spec: decode.Spec, target, drafter, state: decode.State, tokens: Array) -> decode.State:
    """decode.prefill compiled with decode.XLA_OPTIONS."""
    return decode.prefill(spec, target, drafter, state, tokens)


def check_batch_buckets(buckets, max_batch: int, data_parallel: int) -> None:
    """ValueError unless every bucket is a smaller slot batch (1 .. max_batch - 1) and the batch is not split
    over a data axis (``data_parallel`` devices: a bucket's rows are gathered from the whole slot batch)."""
    if any(not 1 <= b < max_batch for b in buckets):
        raise ValueError(f"batch buckets must be between 1 and max_batch - 1 ({max_batch - 1}), "
                         f"got {','.join(map(str, buckets))}")
    if buckets and data_parallel != 1:
        raise ValueError("batch buckets need a mesh without a data axis (DxM with D = 1)")


@functools.partial(decode.donating_jit, static_argnums=(0, 6), donate_argnums=(3,), compiler_options=decode.XLA_OPTIONS)
def step_rows(spec: decode.Spec, target, drafter, state: decode.State, rows: Array, starts: Array, rounds: int):
    """:func:`step` on the slots ``rows`` [n] (distinct) alone: the Snapshot is theirs, in ``rows``' order."""
    sub, snap = _step(spec, target, drafter, decode.take_rows(state, rows), starts, rounds)
    return decode.put_rows(state, rows, sub), snap


@functools.partial(decode.donating_jit, donate_argnums=(0,))
def mark_done(state: decode.State, mask: Array) -> decode.State:
    """Finish the slots where ``mask`` [B] is set (cancelled requests): the round loop skips them."""
    return dataclasses.replace(state, done=state.done | mask)


@functools.partial(decode.donating_jit, donate_argnums=(0,))
def insert_first(batch: decode.State, slot: Array, rows: decode.State) -> decode.State:
    """decode.insert of the first sequence of a prefilled batch ``rows`` (the others are padding for a
    data-parallel mesh, whose batch must split evenly over the data axis)."""
    first = jax.tree.map_with_path(lambda p, x: jax.lax.slice_in_dim(x, 0, 1, axis=decode._batch_axis(p)), rows)
    return decode.insert(batch, slot, first)


# ----------------------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static sizes of the slot batch, derived from --max-len (see decode.layout)."""

    max_len: int
    max_prompt: int  # max_len - 1: at least one new token
    top_bucket: int  # the longest padded prompt
    capacity: int  # KV cache slots per sequence
    out_len: int  # output buffer per sequence

    @classmethod
    def of(cls, spec: decode.Spec, max_len: int) -> "Layout":
        max_prompt = max_len - 1
        top = decode.round_up(max_prompt, 512) if max_prompt > 512 else decode.round_up(max(max_prompt, 1), MIN_BUCKET)
        capacity = decode.round_up(max(top, max_len + spec.scratch_slots), 64)
        return cls(max_len, max_prompt, top, capacity, max(top, max_len + spec.path_len + 1))

    def bucket(self, n: int) -> int:
        """Padded length of an n-token prompt: a power of two >= MIN_BUCKET, at most ``top_bucket``."""
        b = MIN_BUCKET
        while b < n:
            b *= 2
        return min(b, self.top_bucket)

    def buckets(self) -> list[int]:
        return sorted({self.bucket(n) for n in [1] + [2**k for k in range(6, 20) if 2**k <= self.max_prompt]
                       + [self.max_prompt]})


# ----------------------------------------------------------------------------------------- metrics


class Metrics:
    """Prometheus metrics of one engine, in their own registry (serve.py exposes them on /metrics)."""

    def __init__(self, engine: "Engine"):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        prometheus_client.disable_created_metrics()  # no *_created series: they only clutter /metrics
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ddtree_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("ddtree_requests_rejected", "Requests refused at submission", ["reason"], registry=r)
        self.prompt_tokens = Counter("ddtree_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("ddtree_generated_tokens", "Tokens delivered to requests", registry=r)
        self.rounds = Counter("ddtree_sequence_rounds", "Speculative rounds run, summed over sequences", registry=r)
        self.committed = Counter("ddtree_committed_tokens", "Tokens committed by rounds (accepted path + bonus)",
                                 registry=r)
        Gauge("ddtree_mean_acceptance_length", "Committed tokens per sequence round since start (1 for ar)",
              registry=r).set_function(lambda: self._ratio(self.committed, self.rounds))
        Gauge("ddtree_tokens_per_second", "Delivered tokens per second over the last 10 s",
              registry=r).set_function(self.tokens_per_second)
        Gauge("ddtree_queue_length", "Requests waiting for a slot", registry=r).set_function(
            lambda: engine.queue_length)
        Gauge("ddtree_active_slots", "Slots decoding a request", registry=r).set_function(lambda: engine.active_slots)
        Gauge("ddtree_slots", "Slots in the batch (--max-batch)", registry=r).set(engine.config.max_batch)
        lat = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
        self.round_latency = Histogram("ddtree_round_latency_seconds", "Wall time of one round of the batch "
                                       "(device step / rounds it ran)", buckets=lat, registry=r)
        self.prefill_latency = Histogram("ddtree_prefill_latency_seconds", "Admission of one request "
                                         "(prefill + insert)", buckets=lat + (5.0, 10.0), registry=r)
        slow = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Submission to first delivered token",
                              buckets=slow, registry=r)
        self.latency = Histogram("ddtree_request_latency_seconds", "Submission to finish", buckets=slow, registry=r)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._started = time.perf_counter()

    @staticmethod
    def _ratio(num, den) -> float:
        d = den._value.get()
        return num._value.get() / d if d else 0.0

    def delivered(self, n: int) -> None:
        if not n:
            return
        self.generated_tokens.inc(n)
        now = time.perf_counter()
        with self._lock:
            self._recent.append((now, n))
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.perf_counter()
        with self._lock:
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()
            total = sum(n for _, n in self._recent)
        return total / max(min(10.0, now - self._started), 1e-3)


# ----------------------------------------------------------------------------------------- engine


class Engine:
    """Continuous batching of requests into ``config.max_batch`` slots. Thread-safe ``submit``/``cancel``.

    target: (ModelConfig, TargetParams); draft: (DraftConfig, DraftParams) or None (method ar).
    tokenizer: a :class:`ddtree_jax.tokenizer.Tokenizer` or None (text = token ids, space-separated).
    eos_token_ids: stop tokens added to every request unless it asks ``ignore_eos``.
    mesh: a ``sharding.make_mesh`` mesh (data x model), or None for one device. With a mesh the weights
    are placed on it (``sharding.shard_model``, a no-op when they already are), the slot batch is split
    over the data axis (max_batch must be a multiple of it) and the heads/MLP/vocabulary over the model axis.
    """

    def __init__(self, target, draft, config: EngineConfig, *, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), mesh=None):
        self.config = config
        if mesh is not None:
            target = sharding.shard_model(target, mesh)
            if draft is not None and config.method != "ar":
                draft = sharding.shard_model(draft, mesh)
            if sharding.padded_batch(config.max_batch, mesh) != config.max_batch:
                raise ValueError(f"max_batch {config.max_batch} is not a multiple of the mesh's data axis "
                                 f"({sharding.padded_batch(1, mesh)})")
        self.tcfg, self.tparams = target
        dcfg, dparams = draft if draft is not None else (None, None)
        if config.max_batch < 1 or config.rounds_per_step < 1 or config.max_queue < 0:
            raise ValueError("max_batch and rounds_per_step must be at least 1, max_queue at least 0")
        if config.max_len < 2:
            raise ValueError(f"max_len must be at least 2, got {config.max_len}")
        check_batch_buckets(config.batch_buckets, config.max_batch, sharding.padded_batch(1, mesh))
        self.sizes = sorted(set(config.batch_buckets) | {config.max_batch})  # slot batches a step may run
        options = decode.GenerateOptions(method=config.method, max_new_tokens=config.max_len,
                                         tree_budget=config.tree_budget, attention=config.attention)
        # requests choose: the prefill and the slots take any request
        self.spec = decode.make_spec(self.tcfg, dcfg, options, config.tuning, mesh=mesh, sampling=True,
                                     filtering=True)
        # a step runs the least general program its live requests allow (no per-round branch: decode.Spec)
        self.programs = {"greedy": dataclasses.replace(self.spec, sampling=False, filtering=False),
                         "sampling": dataclasses.replace(self.spec, filtering=False), "filtering": self.spec}
        layout = config.tuning.layout
        self.dparams = decode.device_layout(dparams, layout=layout) if config.method != "ar" else None
        self.tparams = decode.device_layout(self.tparams, layout=layout, method=config.method)
        block = self.spec.round_positions
        allowed = self.tcfg.max_position_embeddings
        if config.max_len + block > allowed:
            raise ValueError(f"max_len {config.max_len} + verify block {block} exceeds the model's "
                             f"max_position_embeddings={allowed}; lower --max-len")
        self.layout = Layout.of(self.spec, config.max_len)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.mesh = mesh
        self.dtype = self.tparams.embed.dtype
        self.metrics = Metrics(self)

        b = config.max_batch
        self._prefill_rows = sharding.padded_batch(1, mesh)  # a data-parallel mesh prefills D rows
        empty = functools.partial(decode.empty_slots, self.spec, b, self.layout.capacity, self.layout.out_len,
                                  self.dtype)
        # copies: init_state shares one buffer between n_out and prompt_len, and step donates both
        self.state = jax.tree.map(jnp.copy, sharding.create(empty, mesh))
        self.slots: list[Job | None] = [None] * b
        self.step_sizes: collections.Counter[int] = collections.Counter()  # steps run per slot-batch size
        self.step_programs: collections.Counter[str] = collections.Counter()  # steps run per program (self.programs)
        self._ended: list[int] = []  # slots of jobs that ended since the last device update
        self.waiting: collections.deque[Job] = collections.deque()
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None  # set when the loop died
        self.ready = False

    # ------------------------------------------------------------------ public API
    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def active_slots(self) -> int:
        return sum(j is not None for j in self.slots)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def check(self, prompt_ids: Sequence[int], params: SamplingParams, *, ignore_eos: bool = False) -> tuple[int, ...]:
        """Validate a request; return its stop token ids. Raises RequestError (HTTP 400)."""
        n, vocab, max_len = len(prompt_ids), self.tcfg.vocab_size, self.config.max_len
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        bad = sorted({int(t) for t in prompt_ids if not 0 <= int(t) < vocab})
        if bad:
            raise RequestError(f"prompt token ids {bad[:8]} are outside the vocabulary [0, {vocab})", "prompt")
        if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {params.max_tokens!r}", "max_tokens")
        if n >= max_len or n + params.max_tokens > max_len:
            raise RequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
                f"Please reduce the prompt or the completion length.",
                "max_tokens" if n < max_len else "prompt", "context_length_exceeded")
        if not 0.0 <= params.temperature < float("inf"):
            raise RequestError(f"temperature must be a finite number >= 0, got {params.temperature}", "temperature")
        if not 0.0 < params.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
        if params.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 or -1 = off), got {params.top_k}", "top_k")
        if params.seed is not None and not 0 <= params.seed < SEED_LIMIT:
            raise RequestError(f"seed must be in [0, {SEED_LIMIT}), got {params.seed}", "seed")
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"stop_token_ids {bad[:8]} are outside the vocabulary [0, {vocab})", "stop_token_ids")
        stop_ids = tuple(dict.fromkeys(tuple(params.stop_token_ids) + (() if ignore_eos else self.eos_token_ids)))
        if len(stop_ids) > decode.MAX_STOP_IDS:
            raise RequestError(f"at most {decode.MAX_STOP_IDS} stop token ids (eos included) are supported, "
                               f"got {len(stop_ids)}", "stop_token_ids")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model directory has none; "
                               "use stop_token_ids", "stop")
        if any(not isinstance(s, str) or not s for s in params.stop):
            raise RequestError("stop strings must be non-empty strings", "stop")
        return stop_ids

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Callable[[Event], None], *,
               ignore_eos: bool = False, request_id: str | None = None) -> Job:
        """Queue a request; ``sink`` then receives its events from the engine thread.

        Raises RequestError (bad request), QueueFull (queue at max_queue), EngineClosed (not running).
        """
        try:
            stop_ids = self.check(prompt_ids, params, ignore_eos=ignore_eos)
        except RequestError:
            self.metrics.rejected.labels("invalid").inc()
            raise
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        with self._lock:
            if self._stopping or not self.alive:
                self.metrics.rejected.labels("closed").inc()
                starting = "the engine is starting (compiling); retry shortly"
                raise EngineClosed(self.failure or (starting if not self._stopping else "the engine has stopped"))
            free = len(self.slots) - self.active_slots  # waiting requests that will get a slot at once
            if len(self.waiting) >= self.config.max_queue + free:
                self.metrics.rejected.labels("queue_full").inc()
                raise QueueFull(f"the request queue is full ({self.config.max_queue} waiting); retry later")
            job = Job(id=request_id or f"req-{next(self._ids)}", prompt_ids=[int(t) for t in prompt_ids],
                      params=params, sink=sink, stop_ids=stop_ids, seed=seed)
            self.waiting.append(job)
            self._wake.notify()
        return job

    def cancel(self, job_or_id: Job | str) -> None:
        """Cancel a request (client gone): it gets a final 'cancelled' event and its slot is freed."""
        job_id = job_or_id.id if isinstance(job_or_id, Job) else job_or_id
        with self._lock:
            self._cancels.add(job_id)
            self._wake.notify()

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams, *, ignore_eos: bool = False,
                 timeout: float | None = None) -> Completion:
        """Submit and wait: the blocking form, for scripts and tests."""
        done = threading.Event()
        events: list[Event] = []

        def sink(ev: Event) -> None:
            events.append(ev)
            if ev.finish_reason is not None:
                done.set()

        job = self.submit(prompt_ids, params, sink, ignore_eos=ignore_eos)
        if not done.wait(timeout):
            self.cancel(job)
            raise TimeoutError(f"request {job.id} did not finish in {timeout}s")
        last = events[-1]
        return Completion([t for e in events for t in e.token_ids], "".join(e.text for e in events),
                          last.finish_reason, last.error)

    def start(self, warmup: bool = True) -> "Engine":
        """Start the engine thread (after compiling the step and the shortest prefill, unless warmup=False)."""
        if warmup:
            self.warmup()
        self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
        self._thread.start()
        self.ready = True
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; every request still waiting or running gets an 'error' event."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self.ready = False

    def warmup(self, buckets: Sequence[int] | None = None) -> None:
        """Compile the step (its three programs: greedy-only, sampling, sampling with top-k / top-p), the slot insertion
        and the prefill of the given buckets (default: the shortest) by running a one-token request through slot 0.
        Call before :meth:`start`."""
        t0 = time.perf_counter()
        for bucket in buckets or [self.layout.bucket(1)]:
            n = min(bucket, self.layout.max_prompt)
            job = Job(id="warmup", prompt_ids=[0] * n, params=SamplingParams(max_tokens=1), sink=lambda ev: None,
                      stop_ids=(), seed=0)
            self._prefill_into(job, 0)
            for size in self.sizes:
                for program in self.programs:
                    self._step(record=False, size=size, program=program)
            self.slots[0] = None
        log.info("engine warm in %.1fs", time.perf_counter() - t0)

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._cancels and not self.active_slots and not self.waiting:
                        self._wake.wait()
                    if self._stopping:
                        break
                    cancels, self._cancels = self._cancels, set()
                self._cancel(cancels)
                self._mark_ended()  # before admission, which may reuse the freed slots
                self._admit()
                if self.active_slots:
                    self._deliver(*self._step())
                    self._mark_ended()
        except BaseException as e:  # noqa: BLE001 - every request must hear about it
            self.failure = f"engine failed: {type(e).__name__}: {e}"
            log.exception("engine loop failed")
        finally:
            reason = self.failure or "the server is shutting down"
            with self._lock:
                self._stopping = True
                left = [j for j in self.slots if j is not None] + list(self.waiting)
                self.waiting.clear()
            for job in left:
                self._end(job, "error", error=reason)

    def _cancel(self, ids: set[str]) -> None:
        if not ids:
            return
        with self._lock:
            gone = [j for j in self.waiting if j.id in ids]
            self.waiting = collections.deque(j for j in self.waiting if j.id not in ids)
        gone += [j for j in self.slots if j is not None and j.id in ids]
        for job in gone:
            self._end(job, "cancelled")

    def _mark_ended(self) -> None:
        """Mark the slots of jobs that ended on the host (cancel, stop string) done on device too."""
        if not self._ended:
            return
        mask = np.zeros(len(self.slots), bool)
        mask[self._ended] = True
        self._ended = []
        self.state = mark_done(self.state, jnp.asarray(mask))

    def _admit(self) -> None:
        for s in range(len(self.slots)):
            if self.slots[s] is not None:
                continue
            with self._lock:
                if not self.waiting:
                    return
                job = self.waiting.popleft()
            try:
                t0 = time.perf_counter()
                self._prefill_into(job, s)
                self.metrics.prefill_latency.observe(time.perf_counter() - t0)
                self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            except Exception as e:  # noqa: BLE001 - one request's failure is not the server's
                log.exception("admission of %s failed", job.id)
                self._end(job, "error", error=f"prefill failed: {type(e).__name__}: {e}")

    def _prefill_into(self, job: Job, slot: int) -> None:
        """Prefill ``job`` as a batch of its own and insert it into ``slot`` (whose old content is dead)."""
        n = len(job.prompt_ids)
        p_pad = self.layout.bucket(n)  # prefill cuts its chunk to it
        p = job.params
        opts = decode.GenerateOptions(method=self.spec.method, max_new_tokens=p.max_tokens, temperature=p.temperature,
                                      top_p=p.top_p, top_k=p.top_k, stop_token_ids=job.stop_ids, seed=job.seed)
        rows = self._prefill_rows
        pad = decode.GenerateOptions(method=self.spec.method, max_new_tokens=1)
        tokens = np.zeros((rows, p_pad), np.int32)
        tokens[0, :n] = job.prompt_ids
        make = functools.partial(decode.init_state, self.spec, [n] + [1] * (rows - 1), [opts] + [pad] * (rows - 1),
                                 self.layout.capacity, self.layout.out_len, self.dtype)
        one = sharding.create(make, self.mesh)
        toks = jnp.asarray(tokens) if self.mesh is None else jax.device_put(tokens, sharding.batch_sharding(self.mesh, 2))
        one = prefill(self.spec, self.tparams, self.dparams, one, toks)
        jax.block_until_ready(one.bonus)  # so that the prefill latency metric is the real one
        if rows == 1:
            self.state = decode.insert(self.state, jnp.int32(slot), one)
        else:
            self.state = insert_first(self.state, jnp.int32(slot), one)
        job.slot, job.emitted = slot, n
        if self.tokenizer is not None:
            job.decoder = self.tokenizer.incremental_decoder()
        self.slots[slot] = job

    def _step(self, record: bool = True, size: int | None = None, program: str | None = None):
        """Run ``rounds_per_step`` rounds on the smallest slot batch in ``self.sizes`` that holds the live slots
        (or on ``size``), with the least general of ``self.programs`` that the live requests allow (or
        ``program``); return (starts [B], Snapshot [B]) for every slot."""
        starts = np.array([j.emitted if j is not None else 0 for j in self.slots], np.int32)
        live = [s for s, j in enumerate(self.slots) if j is not None]
        size = size or next(n for n in self.sizes if n >= len(live))
        if program is None:
            hot = [self.slots[s].params for s in live if self.slots[s].params.temperature > 0]
            program = ("filtering" if any(accept.filters(p.top_p, p.top_k) for p in hot) else
                       "sampling" if hot else "greedy")
        spec = self.programs[program]
        t0 = time.perf_counter()
        if size == len(self.slots):
            self.state, snap = step(spec, self.tparams, self.dparams, self.state, jnp.asarray(starts),
                                    self.config.rounds_per_step)
            snap = jax.device_get(snap)
        else:  # the live slots, padded with free ones (distinct rows: the scatter back stays exact)
            rows = np.array((live + [s for s, j in enumerate(self.slots) if j is None])[:size], np.int32)
            self.state, part = step_rows(spec, self.tparams, self.dparams, self.state, jnp.asarray(rows),
                                         jnp.asarray(starts[rows]), self.config.rounds_per_step)
            part = jax.device_get(part)
            snap = jax.tree.map(lambda x: np.zeros((len(self.slots),) + x.shape[1:], x.dtype), part)
            for full, x in zip(jax.tree.leaves(snap), jax.tree.leaves(part)):
                full[rows] = x
        self.step_sizes[size] += 1
        self.step_programs[program] += 1
        elapsed = time.perf_counter() - t0
        if not record:
            return starts, snap
        rounds = int(snap.new_rounds.max()) if snap.new_rounds.size else 0
        if rounds:
            self.metrics.round_latency.observe(elapsed / rounds)
        self.metrics.rounds.inc(int(snap.new_rounds.sum()))
        self.metrics.committed.inc(int(snap.new_tokens.sum()))
        return starts, snap

    def _deliver(self, starts: np.ndarray, snap: Snapshot) -> None:
        for s, job in enumerate(self.slots):
            if job is None:
                continue
            if int(snap.new_tokens[s]) < int(snap.new_rounds[s]):  # every round commits a token at least
                log.error("decode fault in slot %d: %d rounds committed %d tokens", s, int(snap.new_rounds[s]),
                          int(snap.new_tokens[s]))
                self._end(job, "error", error="decode fault: a round committed no token; the output cannot be "
                                               "trusted (see README, Known limits)")
                continue
            end = int(snap.end[s])
            new = [int(t) for t in snap.window[s, : max(end - int(starts[s]), 0)]]
            job.emitted = max(job.emitted, end)
            done = bool(snap.done[s])
            self._advance(job, new, final=done, reason=("stop" if bool(snap.stopped[s]) else "length") if done else None)

    # ------------------------------------------------------------------ text and events
    def _advance(self, job: Job, new: list[int], *, final: bool, reason: str | None) -> None:
        """Append tokens to a job, cut at a stop string, send an event (the last one when it ends)."""
        now = time.perf_counter()
        if new and job.first_token_at is None:
            job.first_token_at = now
            self.metrics.ttft.observe(now - job.submitted)
        stops = job.params.stop
        taken: list[int] = []
        hit = False
        if job.decoder is None:
            taken = new
            job.text += "".join(f"{t} " for t in new)
        elif not stops:
            taken = new
            job.text += job.decoder.push(new)
            if final:
                job.text += job.decoder.flush()
        else:  # token by token, so the output ends at the token that completed the stop string
            for t in new:
                before = len(job.text)
                job.text += job.decoder.push([t])
                taken.append(t)
                if self._cut_at_stop(job, before):
                    hit = True
                    break
            if not hit and final:
                before = len(job.text)
                job.text += job.decoder.flush()
                hit = self._cut_at_stop(job, before)
        job.tokens.extend(taken)
        if hit:
            final, reason = True, "stop"
        hold = 0 if final or not stops else max(len(s) for s in stops) - 1
        visible = max(job.sent, len(job.text) - hold)
        piece = job.text[job.sent:visible]
        job.sent = visible
        self.metrics.delivered(len(taken))
        event = Event(tuple(taken), piece, reason if final else None, None, len(job.prompt_ids), len(job.tokens))
        if final:
            self._end(job, reason, event=event)
        elif taken or piece:
            self._emit(job, event)

    @staticmethod
    def _cut_at_stop(job: Job, before: int) -> bool:
        """Cut job.text before the earliest stop string that ends after ``before``; True when one did."""
        longest = max(len(s) for s in job.params.stop)
        lo = max(0, before - longest + 1)
        found = [i for s in job.params.stop if (i := job.text.find(s, lo)) >= 0]
        if not found:
            return False
        job.text = job.text[: min(found)]
        job.sent = min(job.sent, len(job.text))
        return True

    def _emit(self, job: Job, ev: Event) -> None:
        try:
            job.sink(ev)
        except Exception:  # noqa: BLE001 - a broken sink (closed event loop) cancels its request only
            log.exception("sink of %s failed; cancelling it", job.id)
            if ev.finish_reason is None:
                self.cancel(job)

    def _end(self, job: Job, reason: str, *, error: str | None = None, event: Event | None = None) -> None:
        """The one way a job ends: free its slot (device marking follows in _mark_ended), count it, then
        send its last event, so that whoever sees the event sees the slot free and the metrics updated."""
        if job.finished:
            return
        job.finished = True
        if job.slot is not None and self.slots[job.slot] is job:
            self.slots[job.slot] = None
            self._ended.append(job.slot)
        self.metrics.requests.labels(reason).inc()
        self.metrics.latency.observe(time.perf_counter() - job.submitted)
        self._emit(job, event or Event((), "", reason, error, len(job.prompt_ids), len(job.tokens)))
