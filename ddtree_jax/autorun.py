"""generate's loops of groups on the host (auto's, and a fixed budget's when streaming); timing compiled programs.

Each form a run may take (policy.allowed at its slot batch) is one compiled group of rounds (``decode.run_group``).
A program whose seconds per round the cost table (costs.py) does not know is timed here, on dummy sequences
(:func:`rewind`, :func:`measure`); the engine times its programs with the same two functions. :class:`AutoRun` is
``decode.generate``'s loop under auto: groups run one after another on a worker thread (:meth:`Chain.groups`), each
of the form a :class:`policy.Policy` picks from the statistics read so far; :func:`stream` is the fixed budget's loop
on the same worker when ``on_tokens`` streams the output.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import math
import sys
import threading
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import costs, policy
from ddtree_jax.decode import compiled, donating_jit, run_group
from ddtree_jax.results import fault_message
from ddtree_jax.round import State
from ddtree_jax.spec import NEVER, GenerateOptions, Spec, run_forms

Array = jax.Array

GROUP_ROUNDS = 8  # rounds per device call of an auto run (generate's; the engine's are --rounds-per-step)
FIRST_GROUP = 4  # ... except its first, whose statistics choose the second (nothing is queued behind it)
MAX_GROUP_ROUNDS = 64  # ... and a group of the speculative form the group before ran doubles, up to this (not
# when streaming): group_rounds
MEASURE_CALLS = 3  # timed calls of a new program (the median counts)
HANDOFF_S = 1e-4  # CPython's switch interval while a worker thread runs device calls: quick_handoffs


def cost_table_for(spec: Spec, dtype, persist: bool = True) -> costs.CostTable:
    """The cost table of this run's model shapes, dtype, device kind, attention and mesh; with ``persist``, the
    cache directory's (costs.default_path), else in memory."""
    mesh = None if spec.mesh is None else tuple(spec.mesh.shape.values())
    sig = costs.signature(spec.target, spec.draft, jnp.dtype(dtype).name, jax.devices()[0].device_kind,
                          spec.attention, mesh)
    return costs.CostTable(sig, costs.default_path() if persist else None)


def variant(spec: Spec) -> str:
    """The sampling variant of a program, as cost keys name it: "greedy", "sampling" or "filtering"."""
    return "filtering" if spec.filtering else "sampling" if spec.sampling else "greedy"


def measure(fn: Callable, state: State, rewind: Callable[[State], State], calls: int = MEASURE_CALLS,
            first: Callable | None = None):
    """Seconds per round of a compiled group ``fn`` (state -> (state, Snapshot)): the median of ``calls`` timed calls
    after an untimed one (``first``, default ``fn``: e.g. the same program for fewer rounds), each from
    ``rewind(state)`` and waited for; (seconds, or None when no round ran; the state it left)."""
    per_round = []
    for i in range(calls + 1):
        state = jax.block_until_ready(rewind(state))
        t0 = time.perf_counter()
        state, snap = (fn if i or first is None else first)(state)
        ran = int(np.max(jax.device_get(snap.new_rounds)))
        if i and ran:
            per_round.append((time.perf_counter() - t0) / ran)
    return (float(np.median(per_round)) if per_round else None), state


@functools.partial(donating_jit, donate_argnums=(0,))
def rewind(state: State, mask: Array, length: Array, limit: Array) -> State:
    """The sequences where ``mask`` [B] is set turned into runnable dummies for timing a program: not done, both
    caches at ``length`` [B] tokens, no stop token, the output cut at ``limit`` [B]. Their contents are dead."""

    def at(x, v):
        return jnp.where(mask, v, x)

    cache = dataclasses.replace(state.cache, length=at(state.cache.length, length))
    dcache = state.dcache if state.dcache is None else dataclasses.replace(
        state.dcache, length=at(state.dcache.length, length))
    return dataclasses.replace(state, cache=cache, dcache=dcache, n_out=at(state.n_out, length + 1),
                               limit=at(state.limit, limit), stop_at=at(state.stop_at, NEVER),
                               stop_ids=jnp.where(mask[:, None], -1, state.stop_ids), done=state.done & ~mask)


class _Handoffs:
    """How many :func:`quick_handoffs` are open, and the switch interval before the first (restored after the last,
    in whatever order they close: an engine may stop while another still runs)."""
    lock, users, saved = threading.Lock(), 0, 0.0


@contextlib.contextmanager
def quick_handoffs():
    """Lower CPython's switch interval to HANDOFF_S (sys.setswitchinterval) while a worker thread runs the device
    calls and the host's thread reads, chooses and delivers between them: a thread that wants the GIL may wait up to
    that interval (5 ms by default) before its holder must drop it, and each such wait between a group's end and the
    next dispatch leaves the device idle. On an H100 (benchmarks/call_cost.py, call_cost_h100.json) a call of 8
    rounds of the default pair's shape took 31 ms from a worker thread beside a reading host, 20 ms from the main
    thread alone, and 20 ms from the worker at 0.1 ms."""
    with _Handoffs.lock:
        if _Handoffs.users == 0:
            _Handoffs.saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_Handoffs.saved, HANDOFF_S))
        _Handoffs.users += 1
    try:
        yield
    finally:
        with _Handoffs.lock:
            _Handoffs.users -= 1
            if _Handoffs.users == 0:
                sys.setswitchinterval(_Handoffs.saved)


def group_rounds(form: str, previous: str | None, rounds: int, base: int, largest: int) -> int:
    """Rounds of the next group of ``form`` after a group of ``rounds`` rounds of ``previous``: twice as many while
    speculative forms follow one another, up to ``largest``, ``base`` otherwise. Each group is a device call, and on a
    GPU a call costs about as much as a round or two of a small model (docs/ADAPTIVE.md#the-default-pair-on-a-gpu-
    batch-1), so a switch between trees, which the policy makes on any small difference of cost or acceptance, keeps
    the groups long: every tree round's statistics inform every tree form, whichever ran. AR steps record no
    statistics, so their groups stay short: the probes' wait counts groups (policy.Policy.choose)."""
    if policy.AR not in (form, previous) and previous is not None:
        return min(2 * rounds, largest)
    return base


class Chain:
    """The decode state and the next group's first undelivered indices, advanced by one group after another on one
    worker thread (:meth:`groups`; each :meth:`run` takes the state the last one left)."""

    def __init__(self, tparams, dparams, state: State, starts: Array):
        self.tparams, self.dparams, self.state, self.starts = tparams, dparams, state, starts

    def run(self, fn: Callable, rounds: int):
        """Run ``rounds`` rounds of the compiled group ``fn`` and wait for them: (Snapshot, seconds from the dispatch
        to the group's end)."""
        called = time.perf_counter()
        self.state, snap = fn(self.tparams, self.dparams, self.state, self.starts, np.int32(rounds))  # not jnp's:
        # an eager device op a call (40 us on a CPU host)
        self.starts = snap.end
        jax.block_until_ready(snap)
        return snap, time.perf_counter() - called

    def groups(self, plan: Callable[[], tuple | None]) -> Iterator[tuple]:
        """Groups one after another on a worker thread, one queued behind the one running: ``plan()`` gives the next
        group's (tag, compiled ``run_group``, rounds) when it is queued, on the caller's thread, so it may use all
        that was read so far, or None to queue nothing before the running group is read (while one runs: when it is
        expected to finish the decode, a group queued behind it would be a device call of no round); yields each
        group's (tag, rounds asked, Snapshot read on the host, seconds it ran) in order while the next one runs, so the
        device runs group after group without waiting for the host. (On a GPU a dispatch returns only once its group
        has run, XLA's runtime reading the round loop's predicate on the host: dispatched from the host's own thread,
        every group would wait for the host's reading and choosing.) Closing the generator waits for the group queued
        behind the last one read: only then is :attr:`state` the last."""
        with quick_handoffs(), concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ddtree-groups") as worker:
            queued: collections.deque = collections.deque()  # (tag, rounds, Future of run) of the groups not yet read
            while True:
                nxt = plan()
                if nxt is not None:
                    tag, fn, rounds = nxt
                    queued.append((tag, rounds, worker.submit(self.run, fn, rounds)))
                elif not queued:
                    raise RuntimeError("Chain.groups: plan() gave no group while none runs")
                if len(queued) > 1 or nxt is None:
                    tag, rounds, future = queued.popleft()
                    snap, seconds = future.result()
                    yield tag, rounds, jax.device_get(snap), seconds


def deliver(host, emitted: np.ndarray, n: int, on_tokens) -> np.ndarray:
    """Hand ``on_tokens`` (when given) the tokens of a read Snapshot ``host`` each of the first ``n`` sequences
    gained past ``emitted`` [B] (its first undelivered indices); the new ``emitted``."""
    if on_tokens is not None:
        on_tokens([host.window[i, : max(int(host.end[i]) - int(emitted[i]), 0)].tolist() for i in range(n)])
    return np.maximum(emitted, host.end)


def stream(spec: Spec, fn: Callable, chain: Chain, rounds: int, n: int, on_tokens) -> State:
    """generate's streamed decode at a fixed budget: groups of ``rounds`` rounds of ``fn`` (``run_group`` compiled
    for ``spec``, :meth:`Chain.groups`), each read and its tokens delivered to the first ``n`` sequences while the next
    one runs, until every sequence is done; the final state."""
    emitted = np.asarray(chain.starts)
    with contextlib.closing(chain.groups(lambda: (None, fn, rounds))) as groups:
        for _, _, host, _ in itertools.islice(groups, -(-spec.max_rounds // rounds)):  # every round commits a token
            emitted = deliver(host, emitted, n, on_tokens)
            if host.done.all():
                break
        else:
            raise RuntimeError(fault_message(spec, f"unfinished after {spec.max_rounds} rounds"))
    return chain.state


class AutoRun:
    """generate's loop of groups under ``tree_budget="auto"``: one compiled group per form allowed at the batch
    (policy.allowed), each run and timed before the decode on a fresh state of the batch's shape (``fresh()``, its
    caches at the prompt lengths); ``cost_table`` keeps the timings. A group runs ``rounds`` rounds, or up to
    ``max_group`` while the policy keeps to speculative forms (:func:`group_rounds`; the first FIRST_GROUP)."""

    def __init__(self, spec: Spec, options: GenerateOptions, tparams, dparams, fresh: Callable[[], State],
                 n_prompts: int, rounds: int, cost_table, chooser, max_group: int):
        template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), fresh())
        self.batch = template.bonus.shape[0]
        forms = policy.allowed(run_forms(options, moe=bool(spec.target.num_experts)), self.batch,
                               spec.draft.block_size)
        self.spec, self.tparams, self.dparams, self.fresh = spec, tparams, dparams, fresh
        self.n, self.rounds, self.max_group = n_prompts, rounds, max(rounds, max_group)
        self.max_new_tokens = options.max_new_tokens
        self.costs = cost_table
        self.policy = chooser or policy.Policy(forms, spec.predict)
        starts = jax.ShapeDtypeStruct((self.batch,), jnp.int32)
        count = jax.ShapeDtypeStruct((), jnp.int32)
        self.fns, self.keys = {}, {}
        for f in forms:
            sp = spec.with_form(f, self.batch)
            self.fns[f] = compiled(run_group, sp, tparams, dparams, template, starts, count, self.max_group)
            self.keys[f] = costs.program_key(f, self.batch, variant(sp))
        self.measure_s = 0.0
        self.groups: list[int] = []  # the rounds each group of the last decode ran (a device call each)
        self.timed: dict[str, float] = {}  # form -> seconds a round as _warm timed it

    def _warm(self, lens: list[int]) -> None:
        """Run and time every form before decoding, on a fresh state whose caches hold the prompts' lengths: a
        program's first execution in a process loads it onto the device (tens of ms a form on a GPU), which would
        otherwise fall inside the decode. Every form is timed afresh (``MEASURE_CALLS`` calls when the cost table does
        not know it, one when it does; the median counts), so that the costs compared are this moment's: the decode's
        groups move only the offset all forms share (costs.CostTable.observe), and a timing kept from a run in a
        slower phase of a shared machine would keep its form out for good (on 2 CPU cores a tree of 4 kept at 52 ms
        a round, against 33 measured, made later runs take trees of 8 at 1.14-1.30x AR instead of 1.48x). The forms'
        calls are interleaved, in alternating order (A B, B A, ...), so that a drift of the device's speed while they
        are timed (a GPU's clocks rising from idle) falls on every form alike rather than on the ones timed first.
        Before each timed call, an untimed call of one round loads the program."""
        t0 = time.perf_counter()
        dummy = self.fresh()
        everyone, length = jnp.ones((self.batch,), bool), jnp.asarray(lens, jnp.int32)
        limit, rounds = length + self.spec.max_rounds, jnp.int32(self.rounds)
        forms = list(self.fns)
        calls = {f: 1 if self.costs.get(self.keys[f]) is not None else MEASURE_CALLS for f in forms}
        timed: dict[str, list[float]] = {f: [] for f in forms}
        for i in range(max(calls.values(), default=0)):
            for f in forms if i % 2 == 0 else forms[::-1]:
                if i >= calls[f]:
                    continue
                fn = self.fns[f]
                sec, dummy = measure(lambda s: fn(self.tparams, self.dparams, s, length, rounds), dummy,
                                     lambda s: rewind(s, everyone, length, limit), calls=1,
                                     first=lambda s: fn(self.tparams, self.dparams, s, length, jnp.int32(1)))
                if sec is not None:
                    timed[f].append(sec)
        for f, secs in timed.items():
            if secs:
                self.timed[f] = float(np.median(secs))
                self.costs.measured(self.keys[f], self.timed[f], int(np.mean(lens)))
        jax.block_until_ready(dummy)
        del dummy
        self.measure_s += time.perf_counter() - t0

    def _rounds_left(self, seqs: list[int], tokens_left: np.ndarray, form: str) -> float:
        """Rounds of ``form`` the sequences ``seqs`` are expected to need for ``tokens_left`` [B] (what their
        max_new_tokens still allows; a stop token may end them sooner): the most over them of tokens left over the
        tokens a round is expected to commit (policy.Policy.expected); infinite where that is unknown."""
        need = 0.0
        for i in seqs:
            e = self.policy.expected(i, form)  # at least 1: every round commits a token
            if e is None:
                return math.inf
            need = max(need, float(tokens_left[i]) / e)
        return need

    def form_costs_ms(self) -> dict[str, tuple[float, float]]:
        """Per form timed before the decode: (ms a round as timed, as the cost table holds it now)."""
        return {f: (1e3 * s, 1e3 * (self.costs.get(self.keys[f]) or s)) for f, s in self.timed.items()}

    def decode(self, state: State, lens: list[int], on_tokens) -> State:
        """Groups until every sequence is done, run in order on a worker thread (:meth:`Chain.groups`): while it runs
        group g, the host reads group g - 1 and chooses group g + 1 from the statistics read so far. Each group is a
        device call, dearer on a GPU than a round of a small model (docs/ADAPTIVE.md#the-default-pair-on-a-gpu-batch-1),
        so a decode makes few: the first group (FIRST_GROUP rounds) is read before the second is chosen, and a group
        takes every round the policy expects the decode to need, twice over, once they fit in ``max_group`` (128
        tokens of the default pair: two calls)."""
        self._warm(lens)
        self.groups = []
        live = list(range(self.n))
        for i in live:
            self.policy.start(i)
        emitted = np.asarray(lens)
        chain = Chain(self.tparams, self.dparams, state, jnp.asarray(lens, jnp.int32))
        first = min(FIRST_GROUP, self.rounds)
        limits = np.asarray(lens) + self.max_new_tokens
        rounds, previous, queued, read = 0, None, 0, 0  # the last group queued: its rounds and form; rounds queued
        # in all, and of the groups read

        def plan():
            nonlocal rounds, previous, queued
            ahead = queued - read  # rounds queued, not yet read
            if ahead and (not read or self._rounds_left(live, limits - emitted, previous) <= ahead):
                return None  # the first group's statistics choose the second; and nothing is queued behind groups
                # expected to finish the decode (a device call of no round)
            options = {(f, self.batch): c for f, k in self.keys.items() if (c := self.costs.get(k)) is not None}
            form, _ = self.policy.choose(live, options)
            if not queued:
                rounds = first
            else:
                rounds = group_rounds(form, previous, rounds, self.rounds, self.max_group)
                left = self._rounds_left(live, limits - emitted, form) - ahead
                if left <= self.max_group:  # the rest of the decode fits in a group: one, with room to spare
                    rounds = int(min(max(rounds, np.ceil(2 * left)), self.max_group))
            previous, queued = form, queued + rounds
            return form, self.fns[form], rounds

        with contextlib.closing(chain.groups(plan)) as groups:
            for form, planned, host, seconds in groups:
                read += planned
                ran = int(np.max(host.new_rounds))
                self.groups.append(ran)
                if ran:  # the worker's own wait for the group: from its dispatch, after the group before it ran
                    self.costs.observe(self.keys[form], seconds / ran, int(np.mean(emitted)))
                for i in live:
                    self.policy.observe(i, form, host.new_stats[i])
                emitted = deliver(host, emitted, self.n, on_tokens)
                live = [i for i in live if not host.done[i]]
                if not live:
                    break
                if queued >= self.spec.max_rounds + 2 * self.max_group:  # every round commits a token: enough
                    raise RuntimeError(fault_message(self.spec, f"unfinished after {self.spec.max_rounds} rounds"))
        self.costs.save()
        return chain.state
