"""Continuous batching over the on-device round loop: a fixed set of slots, a queue, an engine thread.

The engine owns one batch :class:`round.State` of ``max_batch`` slots, each sized for ``max_len``
tokens (prompt + generated), and compiled groups of rounds (``programs.py``: one per form, slot batch and sampling
variant) that return what the host needs. Its thread loops::

    cancel   requests whose client went away end; their slots are marked done on device
    admit    waiting requests enter free slots: those of one prompt bucket prefilled together (decode.prefill,
             queued beside the step in flight, unless that step times its program), each row slots.insert_row'ed
             into its slot (by the step thread, before the next step, while a step is in flight)
    time     a newly compiled program whose cost is unknown runs a few rounds on free slots (autorun.rewind)
    step     the chosen program (policy.Policy: the most expected tokens per second among the compiled ones) runs
             its rounds for the live slots (``rounds_per_step``, more at small slot batches while the step stays
             within ``step_ms``: programs.Programs.rounds; done slots are skipped on device), then one small
             device->host copy (:class:`decode.Snapshot`: each slot's new tokens, lengths, done flags, statistics)
    deliver  each slot's new tokens -> text (stop strings cut here) -> its request's sink; a request that
             ended frees its slot before its last event is sent

so new requests join between device calls, while the others keep decoding; background threads compile the programs
meanwhile. The steps run on a step thread: while no request ends on the host (a cancel, a stop string), the next
step is queued before the last one is delivered, so the device waits neither for the delivery nor for admissions (on
a GPU a call returns only once its rounds have run: XLA reads the round loop's predicate on the host).

Everything per request (temperature, top_p, top_k, seed, max_tokens, stop token ids) lives in the slot's own arrays,
set by ``decode.init_state`` at admission; sampling keys depend only on a request's own seed and positions
(``accept.node_keys``), so a seeded request gives the same tokens whatever else is in the batch and whatever forms
its rounds take (AR's tokens for that seed). Stop strings are matched on the host, on the decoded
text: the text is cut before the stop string and the slot is cancelled.

Shapes are static: every prompt is padded to a bucket (64, 128, 256, ... up to the longest allowed
prompt), so the engine compiles one prefill per bucket and number of rows prefilled together (1, 2, 4) and one
insert per number of rows. On a mesh (``sharding.make_mesh``) the slots
split over the data axis and the model over the model axis; decode's jitted functions take the mesh from the Spec.

Requests talk to the engine through a *sink*: a callable that receives :class:`Event` objects, from the engine
thread (the request types: ``requests.py``). ``http_server.py`` turns them into asyncio queue items;
:meth:`Engine.generate` collects them for blocking use. Every accepted request ends with exactly one event whose
``finish_reason`` is set (``stop``, ``length``, ``cancelled`` or ``error``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import autorun, decode, metrics, policy, programs, sharding, slots
from ddtree_jax.programs import Program, Programs
from ddtree_jax.requests import (SEED_LIMIT, Completion, EngineClosed, Event, Job, QueueFull, RequestError,
                                 SamplingParams)
from ddtree_jax.round import State
from ddtree_jax.slots import MIN_BUCKET, Layout, check_batch_buckets, default_buckets
from ddtree_jax.spec import DEFAULT_TREE_BUDGET, MAX_STOP_IDS, GenerateOptions, Spec, make_spec, run_forms
from ddtree_jax.tuning import Tuning
from ddtree_jax.weight_layout import device_layout, layout_method

Array = jax.Array
log = logging.getLogger("ddtree_jax.engine")

IDLE_S = 0.5  # an engine idle this long times programs on free slots, compiles prefills (Engine._idle_due)
# Requests admitted a pass while a step is in flight, at most (Engine._admit): each holds its prefilled state (a max_len
# cache row) until the step thread inserts it, beside the step's own memory; under load one to three join a step
JOIN_AHEAD = 4
# Requests of one prompt bucket prefilled in one call, at most (Engine._prefill): rows padded to a power of two, so
# each bucket compiles a prefill of 1, 2 and 4 rows. A prefill of the default pair's launch-bound target costs about
# what one of a single row does, and a large target's reads its weights once for them all: under load the requests
# joining a step were prefilled one by one (10-14% of the time at 16-32 requests on an H100, the device busy with them).
PREFILL_TOGETHER = 4
# Seconds the engine thread waits, at most, for the step queued after the one it just read to reach the device before
# it works on the one read (Engine._run): their Python would otherwise share the GIL with that step's launch (its
# joiners' inserts, its call) while the device has nothing to run
LAUNCH_WAIT_S = 0.005


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    method: str = "ddtree"  # ar | dflash | ddtree
    tree_budget: int | str = DEFAULT_TREE_BUDGET  # "auto": each step's form chosen by policy.Policy
    max_batch: int = 8  # slots decoded together
    max_len: int = 2048  # prompt + generated tokens per sequence
    rounds_per_step: int = 4  # rounds per device call at least: streaming granularity vs. host round trips
    # a step at a small slot batch runs more rounds (up to programs.MAX_STEP_ROUNDS at slot batch 1) while it stays
    # within step_ms by its cost: each call's fixed cost spread over more rounds. 0: every step runs rounds_per_step
    step_ms: float = 20.0
    max_queue: int = 256  # requests that may wait while every slot is busy; more get QueueFull
    attention: str = "auto"
    # smaller slot batches besides max_batch: a step runs on one that holds the live requests (gathered from and
    # scattered back into the slot batch), so few live requests do not pay for max_batch x (nodes + 1) verify rows.
    # None: powers of two below max_batch (default_buckets); () none
    batch_buckets: tuple[int, ...] | None = None
    forms: tuple[str, ...] = ()  # under auto, the forms to choose among (default: policy.candidates)
    tuning: Tuning = Tuning()  # how the rounds run on the device (ddtree_jax.tuning)
    compile_threads: int | None = None  # background compilation threads while idle, one while serving (None:
    # programs.COMPILE_THREADS)
    step_log: str | None = None  # a file: one JSON line per device step (Engine._log_step), for performance analysis


# ----------------------------------------------------------------------------------------- device


@functools.partial(decode.donating_jit, static_argnums=(0,), donate_argnums=(3,), compiler_options=decode.XLA_OPTIONS)
def prefill(spec: Spec, target, drafter, state: State, tokens: Array) -> State:
    """decode.prefill compiled with decode.XLA_OPTIONS."""
    return decode.prefill(spec, target, drafter, state, tokens)


# ----------------------------------------------------------------------------------------- engine


@dataclasses.dataclass(frozen=True)
class Stepped:
    """A step the step thread ran (:meth:`Engine._device_step`), for the engine thread to count and deliver
    (:meth:`Engine._finish`)."""

    program: Program
    jobs: list  # (slot, Job) of the live slots when it was chosen
    reason: str  # why its program ran: policy, probe or timing
    quiet: bool  # no compilation ran meanwhile (its time counts as the program's cost; _finish's shared: admissions)
    starts: np.ndarray  # [B] each slot's first undelivered index: where its Snapshot window starts
    snap: decode.Snapshot  # [B], on the host
    elapsed: float  # seconds from its dispatch to its Snapshot read
    started: float  # time.time() of its dispatch
    failed: list = dataclasses.field(default_factory=list)  # (Job, error) of joiners whose admission failed
    waited: float = 0.0  # seconds the step thread waited before it for the state changes queued since the last step
    launch: float = 0.0  # seconds of ``elapsed`` until its program's call returned (a GPU's: once its loop has run)


class Engine:
    """Continuous batching of requests into ``config.max_batch`` slots. Thread-safe ``submit``/``cancel``.

    target: (ModelConfig, TargetParams); draft: (DraftConfig, DraftParams) or None (method ar).
    tokenizer: a :class:`ddtree_jax.tokenizer.Tokenizer` or None (text = token ids, space-separated).
    eos_token_ids: stop tokens added to every request unless it asks ``ignore_eos``.
    mesh: a ``sharding.make_mesh`` mesh (data x model), or None for one device. With a mesh the weights
    are placed on it (``sharding.shard_model``, a no-op when they already are), the slot batch is split
    over the data axis (max_batch must be a multiple of it) and the heads/MLP/vocabulary over the model axis.
    persist_costs: keep the programs' seconds per round in the cache directory's cost table (costs.py), so that the
    next start knows them; otherwise they are timed here and kept in memory.

    Programs: one per (form, slot batch, sampling variant): the forms of ``config.tree_budget`` ("auto": those of
    policy.allowed at each slot batch; a fixed budget: its one form), the slot batches ``config.batch_buckets`` and
    max_batch, the variants greedy-only, sampling and sampling with top-k / top-p. :meth:`warmup` compiles the first
    (the full batch's AR step, or the fixed form, in the most general variant: it serves any request); a background
    thread compiles the others (greedy ones first, a sampling variant once a request needs it), never stalling the
    engine thread, which runs the best ready program: the (form, slot batch) :class:`policy.Policy` picks from the
    rounds' statistics and the programs' costs, timed on free slots (or, under load, by one real step), and again once
    no compilation runs if they were timed beside one or loaded from disk.
    """

    def __init__(self, target, draft, config: EngineConfig, *, tokenizer=None,
                 eos_token_ids: Sequence[int] = (), mesh=None, persist_costs: bool = False):
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
        if config.max_batch < 1 or config.rounds_per_step < 1 or config.max_queue < 0 or not config.step_ms >= 0:
            raise ValueError("max_batch and rounds_per_step must be at least 1, max_queue and step_ms at least 0")
        if config.max_len < 2:
            raise ValueError(f"max_len must be at least 2, got {config.max_len}")
        data = sharding.padded_batch(1, mesh)
        buckets = default_buckets(config.max_batch, data) if config.batch_buckets is None else config.batch_buckets
        check_batch_buckets(buckets, config.max_batch, data)
        self.sizes = sorted(set(buckets) | {config.max_batch})  # slot batches a step may run
        options = GenerateOptions(method=config.method, max_new_tokens=config.max_len,
                                  tree_budget=config.tree_budget, attention=config.attention,
                                  forms=config.forms)
        # requests choose: the prefill and the slots take any request; the State's layout fits every program
        self.spec = make_spec(self.tcfg, dcfg, options, config.tuning, mesh=mesh, sampling=True,
                              filtering=True, batch=self.sizes[0])
        self.forms = run_forms(options, moe=bool(self.tcfg.num_experts))
        table, first = programs.table(self.spec, self.forms, self.sizes, dcfg, config.max_batch)
        layout = config.tuning.layout
        self.dparams = device_layout(dparams, layout=layout) if config.method != "ar" else None
        self.tparams = device_layout(self.tparams, layout=layout, method=layout_method(options))
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
        self.costs = autorun.cost_table_for(self.spec, self.dtype, persist=persist_costs)
        self.policy = policy.Policy(self.forms, self.spec.predict)
        self.metrics = metrics.Metrics(self)

        b = config.max_batch
        # the numbers of requests prefilled together (each compiles its prefill); an admission's fresh state of
        # ``rows`` rows in one device call
        self._together = [1 << k for k in range(PREFILL_TOGETHER.bit_length()) if 1 << k <= min(PREFILL_TOGETHER, b)]
        self._fresh = functools.cache(lambda rows: decode.fresh_state(self.spec, rows, self.layout.capacity,
                                                                      self.layout.out_len, self.dtype, mesh))
        empty = functools.partial(slots.empty_slots, self.spec, b, self.layout.capacity, self.layout.out_len,
                                  self.dtype)
        # copies: the steps donate every leaf, so none may share a buffer with another (a guard, once at start)
        self.state = jax.tree.map(jnp.copy, sharding.create(empty, mesh))
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        self.slots: list[Job | None] = [None] * b
        self.step_sizes: collections.Counter[int] = collections.Counter()  # steps run per slot-batch size
        self.step_programs: collections.Counter[tuple] = collections.Counter()  # steps per (form, size, variant)
        self._ended: list[int] = []  # slots of jobs that ended on the host since the last device update
        # (prompt bucket, requests prefilled together) whose prefill no admission has compiled (Engine._idle_work)
        self._cold = [(bucket, n) for bucket in self.layout.buckets() for n in self._together]
        self._joining: list[tuple] = []  # (Job, prefilled state, row, slot) joining the next step
        self._in_flight: dict[int, Job] = {}  # slot -> Job of the live slots of the last step dispatched
        self._in_flight_rounds = config.rounds_per_step  # the rounds of the last step dispatched
        self._starts = np.zeros(b, np.int32)  # per slot, where the next step's window starts (the step thread's)
        self._steps = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddtree-step")
        # from start to stop: autorun.quick_handoffs (the steps beside the host's work), the step log
        self._running = contextlib.ExitStack()
        self._busy = 0.0  # time.monotonic() of the last step (idle timings wait IDLE_S after it)
        self._timing_ahead = False  # the last step dispatched times its program: no admission beside it
        self._launched = threading.Event()  # the last step dispatched's: set as the step thread hands it to the device
        self.waiting: collections.deque[Job] = collections.deque()
        self._cancels: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.programs = Programs(table, first, weights=(self.tparams, self.dparams), shapes=shapes, batch=b,
                                 rounds_per_step=config.rounds_per_step, max_len=config.max_len,
                                 path_len=self.spec.path_len, cost_table=self.costs, lock=self._lock, wake=self._wake,
                                 step_s=config.step_ms / 1e3)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None  # set when the loop died
        self.ready = False
        self._step_log = None  # the open EngineConfig.step_log, from start to stop

    # ------------------------------------------------------------------ public API
    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def active_slots(self) -> int:
        return sum(j is not None for j in self.slots)

    @property
    def first(self) -> Program:
        """The program compiled before start (:meth:`warmup`): it serves any request."""
        return self.programs.first

    @property
    def programs_ready(self) -> int:
        return self.programs.ready

    @property
    def programs_timed(self) -> int:
        """Compiled programs with nothing left to time (:attr:`programs.Programs.timed`)."""
        return self.programs.timed

    @property
    def programs_wanted(self) -> int:
        """Programs compiled or to be compiled: the first and the variants requests have needed so far."""
        return self.programs.wanted

    @property
    def prefills_to_compile(self) -> int:
        """Prefills (prompt bucket x requests prefilled together) no admission has compiled yet (the idle engine
        compiles them: :meth:`_idle_work`)."""
        return len(self._cold)

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
        if len(stop_ids) > MAX_STOP_IDS:
            raise RequestError(f"at most {MAX_STOP_IDS} stop token ids (eos included) are supported, "
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
        """Start the engine thread and the background compiler (after :meth:`warmup`, unless warmup=False: then the
        first request compiles the first program and the prefill)."""
        if warmup:
            self.warmup()
        if self.config.step_log:
            self._step_log = self._running.enter_context(open(self.config.step_log, "a", buffering=1))
        self._running.enter_context(autorun.quick_handoffs())
        self._thread = threading.Thread(target=self._run, name="ddtree-engine", daemon=True)
        self._thread.start()
        self.programs.start(self.config.compile_threads)
        programs.freeze()  # the weights, the warm-up's programs: out of the garbage collector's scans
        self.ready = True
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; every request still waiting or running gets an 'error' event."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self.programs.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self.programs.join(timeout)
        self._steps.shutdown(wait=True)
        self._running.close()
        self.ready = False
        self.costs.save()
        programs.thaw()  # this engine, a reference cycle, can be collected

    def warmup(self, buckets: Sequence[int] | None = None) -> None:
        """Compile the prefills of the given prompt buckets (each for every number of requests prefilled together;
        default: the shortest bucket, one request) and the slot insertion by admitting dummy requests (:meth:`_warm`),
        then the first program (:attr:`first`), and time it. Call before :meth:`start`."""
        t0 = time.perf_counter()
        for bucket in buckets or [self.layout.bucket(1)]:
            for n in self._together if buckets else [1]:
                self._warm(bucket, n)
        self.programs.compile(self.first)
        self._measure_ready(most=None)
        log.info("engine warm in %.1fs", time.perf_counter() - t0)

    def _warm(self, bucket: int, n: int) -> None:
        """Compile the prefill of ``n`` requests of prompt ``bucket`` together and the slot insertion, by admitting
        ``n`` requests of that length into slots 0..n-1 (free) and marking them done."""
        jobs = [Job(id="warmup", prompt_ids=[0] * min(bucket, self.layout.max_prompt),
                    params=SamplingParams(max_tokens=1), sink=lambda ev: None, stop_ids=(), seed=0) for _ in range(n)]
        try:
            one = self._prefill(jobs)
            for row, job in enumerate(jobs):
                self._insert(job, one, row, row)
        finally:  # done on the device, whatever was inserted
            self._ended.extend(range(n))
            self._mark_ended()

    # ------------------------------------------------------------------ programs
    def _idle_work(self) -> None:
        """One piece of the idle engine's work, one a pass of its loop (arriving requests are admitted between):
        time a program that needs it (:meth:`_measure_ready`), else compile a prefill no admission has used yet (the
        shortest prompt bucket first; :meth:`_warm`): compiled on demand, a prompt of a new length held every running
        request up while it compiled. A prefill that fails here (e.g. out of device memory) is left to its first
        admission, whose requests alone would fail."""
        if self._untimed():
            self._measure_ready()
        elif self._cold:
            bucket, n = self._cold.pop(0)  # tried once
            try:
                self._warm(bucket, n)
            except Exception:  # noqa: BLE001 - not the server's failure
                log.exception("compiling the prefill of %d requests of %d tokens failed", n, bucket)

    def _measure_ready(self, most: int | None = 1) -> None:
        """Time ``most`` of the programs that need it (:meth:`programs.Programs.to_time`) on the free slots of an
        engine idle for ``IDLE_S``: one a pass of the loop, so that arriving requests are admitted between timings.
        Under load the steps time the programs they need instead (:meth:`programs.Programs.choose`): timing every
        program on free slots held a lone request for as long as 30 s on 2 CPU cores."""
        free = [s for s, j in enumerate(self.slots) if j is None]
        self.state = self.programs.measure(self.state, free, self._context(), most)

    def _context(self) -> int:
        """Committed tokens per live sequence, on average (the shortest bucket when none is live)."""
        live = [j.emitted for j in self.slots if j is not None]
        return int(np.mean(live)) if live else MIN_BUCKET

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        inflight = None  # the Future of the step on the step thread, not yet delivered
        waited = 0.0  # seconds of this pass spent waiting for the device (a step's result, timings on free slots)

        def result(future: concurrent.futures.Future, handoff: bool = False) -> Stepped:
            """The step of ``future``; with ``handoff`` (a step is queued after it) once that one is launched too."""
            nonlocal waited
            t = time.perf_counter()
            step = future.result()
            if handoff:
                self._launched.wait(LAUNCH_WAIT_S)
            waited += time.perf_counter() - t
            return step

        try:
            while True:
                with self._lock:
                    while (inflight is None and not self._stopping and not self._cancels and not self.active_slots
                           and not self.waiting):
                        self.programs.serving(False)  # idle: every compile thread works
                        due = self._idle_due()
                        if due == 0.0:
                            break
                        self._wake.wait(due)
                    if self._stopping:
                        break
                    cancels, self._cancels = self._cancels, set()
                    self.programs.serving(bool(self.active_slots or self.waiting))
                t0, waited, later, shared = time.perf_counter(), 0.0, None, False
                if inflight is not None and (cancels or self._ended or not self._stepping(in_flight=True)):
                    later = self._finish(result(inflight), defer=True)  # the state changes below need it back
                    inflight = None
                if inflight is None:
                    self._cancel(cancels)
                    self._mark_ended()  # before admission, which may reuse the freed slots
                if self.waiting and not (inflight is not None and self._timing_ahead):  # a timing step runs alone
                    shared = self._admit(ahead=inflight is not None)
                if inflight is None and not self.active_slots and self._idle_due() == 0.0:
                    t = time.perf_counter()
                    self._idle_work()
                    waited += time.perf_counter() - t  # timings and compilations while idle: not the steps' host work
                if self._stepping(in_flight=inflight is not None):
                    queued = self._dispatch()
                    if inflight is not None:  # the step before it, delivered while this one runs
                        self._finish(result(inflight, handoff=True), shared=shared)
                    inflight = queued
                    self._busy = time.monotonic()
                if later is not None:  # the live slots' tokens of the step finished above, the next one queued
                    later()
                # the host's own work this pass (choice, statistics, deliveries, admissions): when it exceeds the
                # device's step, the host paces the server
                self.metrics.host_seconds.inc(max(0.0, time.perf_counter() - t0 - waited))
        except BaseException as e:  # noqa: BLE001 - every request must hear about it
            self.failure = f"engine failed: {type(e).__name__}: {e}"
            log.exception("engine loop failed")
        finally:
            if inflight is not None:
                inflight.cancel()
                concurrent.futures.wait([inflight])
            reason = self.failure or "the server is shutting down"
            with self._lock:
                self._stopping = True
                left = [j for j in self.slots if j is not None] + list(self.waiting)
                self.waiting.clear()
            self.programs.stop()
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
        self.state = slots.mark_done(self.state, mask)

    def _admit(self, ahead: bool) -> bool:
        """Waiting requests into the free slots (at most JOIN_AHEAD with ``ahead``): those of one prompt bucket
        prefilled together, PREFILL_TOGETHER at most a call (:meth:`_prefill`: queued on the device, not waited for),
        each seated in its slot on the host and its row inserted there at once, or, with ``ahead`` (a step in
        flight, which owns the state), by the step thread before the next step (:meth:`_device_step`): the device
        waits for no admission. Returns whether a prefill was queued beside the step in flight (its kernels run
        between that step's rounds, so its time is not its program's cost alone)."""
        free = [s for s, job in enumerate(self.slots) if job is None]
        room = min(len(free), JOIN_AHEAD) if ahead else len(free)
        with self._lock:
            jobs = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        buckets: dict[int, list[Job]] = {}  # in order of arrival
        for job in jobs:
            buckets.setdefault(self.layout.bucket(len(job.prompt_ids)), []).append(job)
        most = self._together[-1]
        for same in buckets.values():
            for chunk in (same[i:i + most] for i in range(0, len(same), most)):
                t0 = time.perf_counter()
                try:
                    one = self._prefill(chunk)
                except Exception as e:  # noqa: BLE001 - these requests' failure is not the server's
                    log.exception("admission of %s failed", ", ".join(job.id for job in chunk))
                    for job in chunk:
                        self._end(job, "error", error=f"admission failed: {type(e).__name__}: {e}")
                    continue
                for row, job in enumerate(chunk):
                    slot = free.pop(0)
                    try:
                        self._seat(job, slot)
                        if ahead:
                            self._joining.append((job, one, row, slot))
                        else:
                            self._insert(job, one, row, slot)
                        self.metrics.admission.observe((time.perf_counter() - t0) / len(chunk))
                        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
                    except Exception as e:  # noqa: BLE001 - one request's failure is not the server's
                        log.exception("admission of %s failed", job.id)
                        self._end(job, "error", error=f"admission failed: {type(e).__name__}: {e}")
        return ahead and bool(jobs)

    def _prefill(self, jobs: Sequence[Job]):
        """The prompts of ``jobs`` (of one bucket) prefilled together, as a fresh state of their own: rows for each
        in order, their number rounded up to a power of two and to a multiple of a mesh's data axis with one-token
        dummies. Queued on the device, not waited for: the host builds the next admission (or dispatches the next
        step, whose thread waits for the inserts) while the device prefills."""
        lens = [len(job.prompt_ids) for job in jobs]
        p_pad = self.layout.bucket(max(lens))  # prefill cuts its chunk to it
        together = 1 << (len(jobs) - 1).bit_length()
        rows = sharding.padded_batch(together, self.mesh)
        opts = [GenerateOptions(method=self.spec.method, max_new_tokens=job.params.max_tokens,
                                temperature=job.params.temperature, top_p=job.params.top_p, top_k=job.params.top_k,
                                stop_token_ids=job.stop_ids, seed=job.seed) for job in jobs]
        pad = GenerateOptions(method=self.spec.method, max_new_tokens=1)
        tokens = np.zeros((rows, p_pad), np.int32)
        for row, job in enumerate(jobs):
            tokens[row, : lens[row]] = job.prompt_ids
        dummies = rows - len(jobs)
        one = self._fresh(rows)(decode.row_settings(self.spec, lens + [1] * dummies, opts + [pad] * dummies))
        toks = tokens if self.mesh is None else jax.device_put(tokens, sharding.batch_sharding(self.mesh, 2))
        one = prefill(self.spec, self.tparams, self.dparams, one, toks)
        if (p_pad, together) in self._cold:  # compiled (the call returns once it is queued)
            self._cold.remove((p_pad, together))
        return one

    def _insert(self, job: Job, one: State, row: int, slot: int) -> None:
        """Put row ``row`` of the prefilled state holding ``job`` (:meth:`_prefill`) into ``slot`` of the device
        state (whose old content is dead), its window starting after the prompt: on the thread that owns the state
        (the engine thread with no step in flight, else the step thread)."""
        self.state = slots.insert_row(self.state, np.int32(slot), one, np.int32(row))
        self._starts[slot] = len(job.prompt_ids)

    def _seat(self, job: Job, slot: int) -> None:
        """``job`` holds ``slot`` from now on, on the host (the next step runs it)."""
        job.slot, job.emitted = slot, len(job.prompt_ids)
        if self.tokenizer is not None:
            job.decoder = self.tokenizer.incremental_decoder()
        self.slots[slot] = job
        self.policy.start(slot)

    def _untimed(self) -> bool:
        """Whether :meth:`_measure_ready` has a program to time (the engine thread wakes for it when idle)."""
        return bool(self.programs.to_time(sum(j is None for j in self.slots)))

    def _idle_due(self) -> float | None:
        """Seconds until the idle engine times a program on free slots or compiles a prefill (:meth:`_idle_work`;
        0.0: now; None: nothing to do): ``IDLE_S`` after its last step, so that a client's next request (closed loop:
        a few ms later) does not wait for it."""
        if not self._untimed() and not self._cold:
            return None
        return max(0.0, self._busy + IDLE_S - time.monotonic())

    def _stepping(self, in_flight: bool) -> bool:
        """Whether a live slot may still have rounds to run once the step in flight has run (``in_flight``; with none
        in flight, whether a slot is live). A sequence ends once its cache holds its limit (Job.limit) and every round
        commits a token at least; when that step was chosen its cache held its delivered output less one token or
        more, so it surely ends in the step when that plus the step's rounds reaches its limit. A step queued for
        such sequences alone would run no round (a device call and a Snapshot read for nothing, after each lone
        request)."""
        k = self._in_flight_rounds
        ending = self._in_flight if in_flight else {}
        return any(job is not None and not (ending.get(s) is job and job.emitted - 1 + k >= job.limit)
                   for s, job in enumerate(self.slots))

    def _dispatch(self) -> concurrent.futures.Future:
        """Choose the next step's program (:meth:`programs.Programs.choose`) for the live slots and queue it on the
        step thread (:meth:`_device_step`); its result goes to :meth:`_finish`."""
        live = [s for s, j in enumerate(self.slots) if j is not None]
        probes, choices = self.policy.probes, self.policy.choices
        program = self.programs.choose(live, [self.slots[s].params for s in live], self.policy)
        if self.policy.choices != choices:
            self.metrics.chose(self.policy.last)
        reason = "timing" if program.timing else "probe" if self.policy.probes != probes else "policy"
        self._timing_ahead = program.timing
        # the whole batch in slot order, or for a smaller one the live slots padded with free ones (distinct rows:
        # the scatter back stays exact)
        rows = np.array((live + [s for s, j in enumerate(self.slots) if j is None])[: program.size], np.int32)
        if program.size == len(self.slots):
            rows = np.arange(len(self.slots), dtype=np.int32)
        jobs = [(s, self.slots[s]) for s in live]
        self._in_flight = dict(jobs)
        rounds = self.programs.rounds(program)
        if any(job.emitted == len(job.prompt_ids) for _, job in jobs):  # a request's first step: its first token soon
            rounds = min(rounds, self.config.rounds_per_step)
        self._in_flight_rounds = rounds
        joining, self._joining = self._joining, []
        self._launched = launched = threading.Event()
        return self._steps.submit(self._device_step, program, rows, rounds, jobs, reason, self.programs.quiet(),
                                  joining, launched)

    def _device_step(self, program: Program, rows: np.ndarray, rounds: int, jobs, reason: str, quiet: bool,
                     joining: Sequence[tuple] = (), launched: threading.Event | None = None) -> Stepped:
        """On the step thread: insert the requests admitted beside the step before (``joining``: (Job, prefilled
        state, row, slot)), run ``rounds`` rounds of ``program`` on ``rows`` and read its Snapshot (every
        slot's, in slot order). Its windows start at :attr:`_starts`, which it then moves to their ends. A joiner whose
        prefill or insert fails is left out (its slot keeps its dead content, done on the device), for
        :meth:`_finish` to end with an error: one request's failure is not the server's. Sets ``launched`` as it
        calls the program (or as it fails before), for the engine thread, which waits for it before its work on the
        step before."""
        failed, t_wait = [], time.perf_counter()
        try:
            for job, one, row, slot in joining:
                try:
                    jax.block_until_ready(one)  # its prefill's error is its own, before it reaches the shared state
                    self._insert(job, one, row, slot)
                except Exception as e:  # noqa: BLE001
                    log.exception("admission of %s failed", job.id)
                    failed.append((job, f"admission failed: {type(e).__name__}: {e}"))
            starts = self._starts.copy()
            jax.block_until_ready(self.state)  # the admissions' prefills and inserts: not this step's time
        finally:
            if launched is not None:
                launched.set()
        t0, started = time.perf_counter(), time.time()
        waited = t0 - t_wait
        self.state, part = self.programs.call(program, self.state, rows, starts[rows], rounds)
        launch = time.perf_counter() - t0
        part = jax.device_get(part)
        elapsed = time.perf_counter() - t0
        if program.size == len(self.slots):
            snap = part
        else:
            snap = jax.tree.map(lambda x: np.zeros((len(self.slots),) + x.shape[1:], x.dtype), part)
            for full, x in zip(jax.tree.leaves(snap), jax.tree.leaves(part)):
                full[rows] = x
        self._starts[rows] = np.maximum(starts[rows], part.end)
        return Stepped(program, jobs, reason, quiet and self.programs.quiet(), starts, snap, elapsed, started, failed,
                       waited, launch)

    def _finish(self, step: Stepped, defer: bool = False, shared: bool = False) -> Callable[[], None] | None:
        """Count a step that ran (metrics, its program's cost unless admissions' prefills ran beside it (``shared``),
        the policy's statistics of the slots whose jobs it ran for and that still hold them), then deliver its tokens
        (:meth:`_deliver`). With ``defer``, only those of the sequences that ended on the device (their slots free
        for admissions), the others' returned as a callable to run once the next step is queued: a request that ends
        on the host then costs the device no delivery's wait."""
        program, snap = step.program, step.snap
        for job, error in step.failed:  # before anything reads their slots: never inserted, done on the device
            self._end(job, "error", error=error, on_device=True)
        live = [s for s, job in step.jobs if self.slots[s] is job]
        self.step_sizes[program.size] += 1
        self.step_programs[program.form, program.size, program.variant] += 1
        rounds = int(snap.new_rounds.max()) if snap.new_rounds.size else 0
        if rounds:
            self.programs.stepped(program, step.elapsed, rounds, self._context(), step.quiet, shared)
        if snap.new_stats is not None:
            for s in live:
                self.policy.observe(s, program.form, snap.new_stats[s])
        self.metrics.stepped(self, program, live, snap, step.reason, step.elapsed, step.waited)
        if self._step_log is not None:
            self._log_step(step, len(live), rounds, shared)
        if not defer:
            self._deliver(step.starts, snap, step.jobs)
            return None
        self._deliver(step.starts, snap, [(s, job) for s, job in step.jobs if snap.done[s]])
        return functools.partial(self._deliver, step.starts, snap, [(s, j) for s, j in step.jobs if not snap.done[s]])

    def _log_step(self, step: Stepped, live: int, rounds: int, shared: bool) -> None:
        """A line of EngineConfig.step_log: when the step was dispatched (``t``, Unix seconds) and its seconds from
        dispatch to Snapshot read (``elapsed``), its program (form, slot batch, variant) and why it ran, its rounds
        (the most any sequence ran), the live sequences and the tokens they committed, whether joining requests'
        prefills were queued beside it (``shared``: not its program's time alone) or a compilation ran (``quiet``
        false), the seconds the step thread waited for admissions before it, and the seconds of ``elapsed`` its
        program's call took to return (``launch``: the host's share on a CPU; on a GPU the call returns once its round
        loop has run)."""
        snap = step.snap
        self._step_log.write(json.dumps({
            "t": round(step.started, 6), "elapsed": round(step.elapsed, 6), "form": step.program.form,
            "batch": step.program.size, "variant": step.program.variant, "reason": step.reason, "rounds": rounds,
            "live": live, "tokens": int(snap.new_tokens.sum()), "shared": shared, "quiet": step.quiet,
            "waited": round(step.waited, 6), "launch": round(step.launch, 6)}) + "\n")

    def _deliver(self, starts: np.ndarray, snap: decode.Snapshot, jobs: list) -> None:
        """Each of ``jobs`` ((slot, Job) a step ran for) still in its slot: its new tokens from ``snap``."""
        for s, job in jobs:
            if self.slots[s] is not job:  # ended meanwhile (cancelled; its slot may hold a new request by now)
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
        on_device = final  # the device ended the sequence (its length, a stop token): its slot is done there
        taken, hit = job.push(new, final=final)
        if hit:
            final, reason = True, "stop"
        piece = job.unsent(final=final)
        self.metrics.delivered(len(taken))
        event = Event(tuple(taken), piece, reason if final else None, None, len(job.prompt_ids), len(job.tokens))
        if final:
            self._end(job, reason, event=event, on_device=on_device)
        elif taken or piece:
            self._emit(job, event)

    def _emit(self, job: Job, ev: Event) -> None:
        try:
            job.sink(ev)
        except Exception:  # noqa: BLE001 - a broken sink (closed event loop) cancels its request only
            log.exception("sink of %s failed; cancelling it", job.id)
            if ev.finish_reason is None:
                self.cancel(job)

    def _end(self, job: Job, reason: str, *, error: str | None = None, event: Event | None = None,
             on_device: bool = False) -> None:
        """The one way a job ends: free its slot (marked done on the device by _mark_ended, unless ``on_device``: the
        device ended it, so no state change has to wait for the step in flight), count it, then send its last event,
        so that whoever sees the event sees the slot free and the metrics updated."""
        if job.finished:
            return
        job.finished = True
        if job.slot is not None and self.slots[job.slot] is job:
            self.slots[job.slot] = None
            if not on_device:
                self._ended.append(job.slot)
            self.policy.end(job.slot)
        self.metrics.requests.labels(reason).inc()
        self.metrics.latency.observe(time.perf_counter() - job.submitted)
        self._emit(job, event or Event((), "", reason, error, len(job.prompt_ids), len(job.tokens)))
