"""The serving engine's compiled programs: which exist, compiling them in the background, timing them, choosing one.

A :class:`Program` is one compiled (form, slot batch, sampling variant) group of rounds, up to ``most`` a step
(:func:`table` lists them). :class:`Programs` holds them as a mapping from (form, size, variant) and:

    compile  background threads compile the wanted ones in :func:`_rank`'s order (:meth:`Programs.start`)
    time     the engine thread times a newly compiled one on free slots (:meth:`Programs.measure`), and under load
             the next step times one whose cost is missing, doubtful or older than ``COST_TTL_S``
    choose   the engine thread picks the next step's program (:meth:`Programs.choose`) and runs it
             (:meth:`Programs.call`)

The engine gives it once its weights, the slot batch's shapes, the cost table, its lock (under which this object's
own fields are read and written) and the engine thread's condition (notified when a compilation ends); and with each
call what changes: the slot state, the free slots, the live requests' sampling parameters, the policy.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import gc
import logging
import os
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import accept, autorun, costs, decode, policy, slots
from ddtree_jax.requests import SamplingParams
from ddtree_jax.round import State
from ddtree_jax.spec import Spec

log = logging.getLogger("ddtree_jax.engine")

VARIANTS = ("greedy", "sampling", "filtering")  # a program's sampling support, least general first (spec.Spec)
# Seconds of steps (the engine's busy time: Programs.busy) a cost is trusted without a new timing, times its ratio to
# the cheapest program's at its slot batch. Under load the steps move only the offset all costs share (costs.py): a
# program timed once in a slower phase (2-4x on 2 CPU cores: the HTTP stack, the load generator, the machine itself)
# would stay out for good. Past this, the next step that may run it times it (Programs.choose). A program
# k times the cheapest's cost is timed once in k x COST_TTL_S, so each form's timings add at most one cheapest step's
# time in COST_TTL_S (0.1-0.2 s on 2 CPU cores: about 1% a form; a few ms on a GPU). Idle time does not age a cost:
# aged by the wall clock, every form was timed again at once when requests came after a pause (a quarter of the
# rounds of a short load level on 2 CPU cores).
COST_TTL_S = 20.0


@dataclasses.dataclass(eq=False)
class Program:
    """One compiled (form, slot batch, variant) of the engine: a group of up to ``most`` rounds (a step runs
    :meth:`Programs.rounds` of them)."""

    form: str
    size: int  # slot batch: the whole batch, or the rows gathered for a smaller one
    variant: str  # VARIANTS
    spec: Spec
    fn: Callable | None = None  # the executable, once compiled
    tried: bool = False  # timed (or run unmeasured) once
    clean: bool = False  # its cost was timed with no compilation in flight (else, or loaded from disk: timed again)
    checked: bool = False  # timed again once because its cost exceeded the same form's at a larger slot batch
    timing: bool = False  # chosen for a step that times it (Programs.stepped)
    timed_at: float = -float("inf")  # Programs.busy at its cost's last timing (COST_TTL_S)
    most: int = 1  # the rounds a step of it may run, compiled in (set by Programs: MAX_STEP_ROUNDS)

    @property
    def cost_key(self) -> str:
        return costs.program_key(self.form, self.size, self.variant)


def freeze() -> None:
    """Take every object Python's cyclic garbage collector tracks now out of its scans for good (``gc.freeze``): a
    compiled program keeps 20-30 thousand Python objects alive (its traced program, in jax's caches; the default
    pair's shape), auto's 33 programs about a million, and each collection of the oldest generation scanned them all
    while every thread stood still (0.30 s for 340 thousand on 2 CPU cores: benchmarks/results/gc_pause_cpu.json).
    Called once a program is compiled and once the engine has started: what is alive then is mostly what the engine
    keeps (weights, programs, caches). An object frozen is still freed when its last reference goes; only a reference
    cycle among frozen objects is never collected: :func:`thaw` when the engine stops."""
    gc.freeze()


def thaw() -> None:
    """Give the frozen objects back to the collector (``gc.unfreeze``), when an engine stops: a stopped engine is a
    reference cycle (its threads, its loop), which the collector alone frees, with its weights and slot state; frozen,
    it was never freed. The engines still running freeze theirs again at their next compilation."""
    gc.unfreeze()


def _rank(program: Program) -> tuple:
    """The background compiler's order: greedy first; AR steps at every slot batch (the fallback that never loses),
    then the speculative forms, small slot batches first, the chain and small trees first."""
    form = -1 if program.form == policy.CHAIN else policy.tree_budget(program.form) or 0
    return VARIANTS.index(program.variant) > 0, program.form != policy.AR, program.size, form


def table(spec: Spec, forms: Sequence[str], sizes: Sequence[int], dcfg, max_batch: int
          ) -> tuple[dict[tuple[str, int, str], Program], Program]:
    """The engine's programs, one per (form, slot batch, variant): ``forms`` ("auto": those of policy.allowed at each
    slot batch of ``sizes``), and the first, compiled before start: AR (or the first form that fits) at the full
    batch, in the variant that serves any request. Raises ValueError when no form fits a slot batch."""
    programs: dict[tuple[str, int, str], Program] = {}
    for size in sizes:
        fits = policy.allowed(forms, size, dcfg.block_size) if spec.auto else forms
        if not fits:
            raise ValueError(f"none of the forms {','.join(forms)} fits a verify of {policy.ROW_CAP} rows at "
                             f"slot batch {size}; add ar or smaller trees")
        for form in fits:
            base = spec.with_form(form, size) if spec.auto else spec
            for v in VARIANTS:
                variant_spec = dataclasses.replace(base, sampling=v != "greedy", filtering=v == "filtering")
                programs[form, size, v] = Program(form, size, v, variant_spec)
    first = next(f for f in (policy.AR, *forms) if (f, max_batch, "filtering") in programs)
    return programs, programs[first, max_batch, "filtering"]


# Background compilation threads while the engine is idle: XLA compiles mostly outside Python's lock, so a few in
# parallel shorten the time until every program is ready; one on small machines, whose cores the engine thread needs.
# While it serves requests one thread compiles: on an H100 (16 cores) the default pair's shape ran its AR steps 2-6x
# slower beside 4 compiling threads (2.9 ms median where no compilation ended, against 1.6-1.7 steady), at the steady
# speed beside one, but for the second in which a compilation ends (XLA's autotuning and the load of the executable),
# which compiled 0.6x as many programs meanwhile (benchmarks/results/compile_stall_h100.json).
COMPILE_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))

# The most rounds a step runs, at slot batch 1 (at slot batch n, MAX_STEP_ROUNDS // n, at least rounds_per_step): a
# device call has a fixed cost (launch, Snapshot read): on an H100 a served step of 4 AR rounds of the default pair's
# shape took 4.70 ms against 3.22 for 4 of bench's one-call rounds, and steps of up to 16 served 1.45x the tokens/s at
# one request (benchmarks/results/step_rounds_h100.json). A step runs as many as fit in the engine's step_s by its
# cost (Programs.rounds): more rounds a step spread that cost, and delay a joining request's insert (and a step's
# tokens) by up to a step. The cap falls with the slot batch: its rounds cost more, and an AR step's hand-over to
# the drafter projects ``most`` rows a sequence whatever the step runs (decode.group, Spec.per_call).
MAX_STEP_ROUNDS = 16


class Programs(collections.abc.Mapping):
    """The engine's programs by (form, slot batch, variant) (:func:`table`), their compilation, timing and choice.

    weights: (target params, draft params or None) as the engine holds them on the device; shapes: the slot batch
    State's shapes and shardings (what a program is compiled for); batch: the slot batch's size (max_batch);
    max_len: tokens per slot; path_len: the most tokens a round commits; rounds_per_step: the rounds of a step at
    least; step_s: the seconds a step of more rounds may last (:meth:`rounds`; 0: every step runs rounds_per_step);
    cost_table: the engine's seconds per round (costs.CostTable); lock: the engine's lock; wake: the engine thread's
    condition on it, notified when a compilation ends (the engine thread may time the new program).
    """

    def __init__(self, programs: dict[tuple[str, int, str], Program], first: Program, *, weights: tuple,
                 shapes: State, batch: int, rounds_per_step: int, max_len: int, path_len: int,
                 cost_table: costs.CostTable, lock: threading.Lock, wake: threading.Condition, step_s: float = 0.0):
        self._programs = programs
        self.first = first
        self.tparams, self.dparams = weights
        self._shapes = shapes
        self.batch, self.rounds_per_step, self.max_len, self.path_len = batch, rounds_per_step, max_len, path_len
        self.step_s = step_s
        for p in programs.values():
            p.most = max(rounds_per_step, MAX_STEP_ROUNDS // p.size) if step_s > 0 else rounds_per_step
        self.costs = cost_table
        self._lock = lock
        self._wake = wake
        self._compile_wake = threading.Condition(lock)
        self._wanted = {"greedy"}  # variants the background compiler works on (a request needed the others)
        self._compilers: list[threading.Thread] = []
        self._compiling: set[Program] = set()  # taken by a compile thread
        self._in_flight = 0  # compilations running now
        self._stopping = False
        self._serving = False  # requests are live or waiting: one compile thread works, else all (serving)
        self.busy = 0.0  # seconds of steps run so far: the clock that ages costs (COST_TTL_S)

    def __getitem__(self, key: tuple[str, int, str]) -> Program:
        return self._programs[key]

    def __iter__(self) -> Iterator[tuple[str, int, str]]:
        return iter(self._programs)

    def __len__(self) -> int:
        return len(self._programs)

    @property
    def ready(self) -> int:
        return sum(p.fn is not None for p in self._programs.values())

    @property
    def timed(self) -> int:
        """Compiled programs with nothing left to time: their cost timed with no compilation running and not to be
        timed again (:meth:`needing_timing`: e.g. above the same form's at a larger slot batch)."""
        compiled = [p for p in self._programs.values() if p.fn is not None]
        again = set(self.needing_timing(compiled))
        return sum(p.clean and p not in again for p in compiled)

    @property
    def wanted(self) -> int:
        """Programs compiled or to be compiled: the first and the variants requests have needed so far."""
        return sum(p.variant in self._wanted or p is self.first for p in self._programs.values())

    # ------------------------------------------------------------------ compilation
    def start(self, threads: int | None = None) -> None:
        """Start the background compiler's threads (default COMPILE_THREADS): all of them work while the engine is
        idle, the first alone while it serves (:meth:`serving`)."""
        self._compilers = [threading.Thread(target=self._compile_loop, args=(i,), name=f"ddtree-compile-{i}",
                                            daemon=True) for i in range(threads or COMPILE_THREADS)]
        for t in self._compilers:
            t.start()

    def stop(self) -> None:
        """Let the compile threads end (each after the compilation it is in, which cannot be interrupted)."""
        with self._lock:
            self._stopping = True
            self._compile_wake.notify_all()  # every idle compile thread, each waiting on it

    def join(self, timeout: float) -> None:
        for t in self._compilers:  # a compilation in progress cannot be interrupted: let it end
            t.join(timeout)

    def compile(self, program: Program) -> None:
        """Compile ``program`` ahead of time (any thread: only shapes are read)."""
        spec, b = program.spec, self.batch
        args = (self.tparams, self.dparams, self._shapes)
        starts, count = jax.ShapeDtypeStruct((program.size,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)
        if program.size == b:
            lowered = decode.run_group.lower(spec, *args, starts, count, program.most)
        else:
            rows = jax.ShapeDtypeStruct((program.size,), jnp.int32)
            lowered = slots.run_group_rows.lower(spec, *args, rows, starts, count, program.most)
        t0 = time.perf_counter()
        program.fn = lowered.compile(decode.XLA_OPTIONS)
        freeze()
        log.info("compiled %s in %.1fs", program.cost_key, time.perf_counter() - t0)

    def serving(self, serving: bool) -> None:
        """The engine thread, holding the lock: whether requests are live or waiting (then compile threads past the
        first wait before their next program, to spare the steps the host's and the GPU's time)."""
        if serving != self._serving:
            self._serving = serving
            if not serving:
                self._compile_wake.notify_all()

    def _compile_loop(self, index: int) -> None:
        """Background compiler ``index``: the pending program first in :func:`_rank` of the wanted variants, until none
        (past the first, only while the engine is idle). A program that fails to compile is left out (logged); the
        engine goes on with the others."""
        while True:
            with self._lock:
                while not self._stopping and (not (todo := self._pending()) or (index and self._serving)):
                    self._compile_wake.wait()
                if self._stopping:
                    return
                program = min(todo, key=_rank)
                self._compiling.add(program)
                self._in_flight += 1
            try:
                self.compile(program)
            except Exception:  # noqa: BLE001 - e.g. out of device memory for one large program
                log.exception("compiling %s failed; going on without it", program.cost_key)
            with self._lock:
                self._in_flight -= 1
                self._wake.notify()  # the engine thread may time it

    def _pending(self) -> list[Program]:
        return [p for p in self._programs.values() if p.fn is None and p.variant in self._wanted
                and p not in self._compiling]

    def quiet(self) -> bool:
        """No compilation running or waiting: a timing now is not slowed by the compiler's threads. Read without the
        lock (the engine thread calls it holding it): counters and membership tests only."""
        return self._in_flight == 0 and not self._pending()

    # ------------------------------------------------------------------ timing
    def needing_timing(self, programs: Iterable[Program]) -> list[Program]:
        """Those of ``programs`` compiled and never timed, or (no compilation running) timed beside one or loaded from
        disk, where their cost may have been inflated, or whose cost exceeds the same form's at a larger slot batch (a
        subset of that work: likely a slowed timing, and a program never chosen is never corrected; timed again
        once)."""
        quiet, cost = self.quiet(), self.costs.seconds()
        cheapest: dict[tuple[str, str], list[tuple[int, float]]] = collections.defaultdict(list)
        for q in self._programs.values():
            if q.cost_key in cost:
                cheapest[q.form, q.variant].append((q.size, cost[q.cost_key]))

        def needs(p: Program) -> bool:
            if p.fn is None:
                return False
            if p.cost_key not in cost:
                return not p.tried
            return quiet and (not p.clean or (not p.checked and any(
                size > p.size and c < cost[p.cost_key] for size, c in cheapest[p.form, p.variant])))

        return [p for p in programs if needs(p)]

    def to_time(self, free: int) -> list[Program]:
        """Compiled programs that ``free`` slots can hold and that need timing (:meth:`needing_timing`)."""
        return self.needing_timing(p for p in self._programs.values() if p.size <= free)

    def measure(self, state: State, free: list[int], context: int, most: int | None = None) -> State:
        """Time, on the ``free`` slots of ``state`` turned into dummies (:func:`autorun.rewind`) at ``context`` tokens,
        each program of :meth:`to_time` whose slot batch the free slots fill (the whole batch only when every slot is
        free), at most ``most`` of them (never-timed ones first); return the state, those slots marked done."""
        todo = sorted(self.to_time(len(free)), key=lambda p: self.costs.get(p.cost_key) is not None)[:most]
        for program in todo:
            program.checked |= program.clean  # a clean cost timed again: for exceeding a larger slot batch's
            program.tried = True
            quiet = self.quiet()
            rows = np.asarray(free[: program.size], np.int32)
            mask = np.zeros(self.batch, bool)
            mask[rows] = True
            rounds = self.rounds(program)  # as its steps run it: a timing of other calls would carry other call costs
            # rounds of at most path_len tokens from there stay within max_len
            length = max(1, min(context, self.max_len - rounds * self.path_len - 1))
            args = (jnp.asarray(mask), jnp.full((self.batch,), length, jnp.int32),
                    jnp.full((self.batch,), self.max_len, jnp.int32))
            sec, state = autorun.measure(
                lambda st: self.call(program, st, rows, np.zeros(len(rows), np.int32), rounds), state,
                lambda st: autorun.rewind(st, *args))
            state = slots.mark_done(state, jnp.asarray(mask))
            if sec is not None:
                self.costs.measured(program.cost_key, sec, length)
                program.timed_at = self.busy
                log.info("timed %s: %.2f ms a round", program.cost_key, 1e3 * sec)
            program.clean = quiet and self.quiet()
        if todo:
            self.costs.save()  # for the next start (no-op without a cost table on disk)
        return state

    def stepped(self, program: Program, elapsed: float, rounds: int, context: int, quiet: bool,
                shared: bool = False) -> None:
        """A step of ``program`` took ``elapsed`` seconds for ``rounds`` rounds at ``context`` tokens (``quiet``: no
        compilation ran meanwhile): its seconds a round, less the table's offset, become its timing when
        :meth:`choose` picked it to be timed, else move the offset (``costs.CostTable.observe``: every program's
        cost). A step beside a compilation (2x slower on 2 CPU cores) leaves the table alone and marks the program to
        be timed again. A step beside admissions' prefills (``shared``: on a GPU their kernels run between its rounds)
        does not move the offset (the engine runs a step chosen to time its program with no admission beside it)."""
        self.busy += elapsed
        seconds = elapsed / rounds
        timing, program.timing = program.timing, False
        if not quiet:
            program.clean = False
        elif timing or self.costs.get(program.cost_key) is None:
            self.costs.measured(program.cost_key, seconds, context, step=True)
            program.clean, program.timed_at = True, self.busy
        elif not shared:
            self.costs.observe(program.cost_key, seconds, context)

    # ------------------------------------------------------------------ choosing and running
    def rounds(self, program: Program) -> int:
        """The rounds a step of ``program`` runs: as many as fit in ``step_s`` by its cost, between rounds_per_step
        and its ``most`` (rounds_per_step while its cost is unknown)."""
        cost = self.costs.get(program.cost_key) if self.step_s > 0 else None
        if not cost:
            return self.rounds_per_step
        return int(min(program.most, max(self.rounds_per_step, self.step_s // cost)))

    def call(self, program: Program, state, rows: np.ndarray, starts: np.ndarray, rounds: int):
        """Run ``rounds`` (at most its ``most``) rounds of ``program`` on ``rows`` of the slot batch (all of them at
        max_batch): (state, its Snapshot)."""
        rounds = np.int32(rounds)  # host values, not jnp's: no eager device op a step
        if program.size == self.batch:
            return program.fn(self.tparams, self.dparams, state, np.asarray(starts, np.int32), rounds)
        return program.fn(self.tparams, self.dparams, state, np.asarray(rows, np.int32), np.asarray(starts, np.int32),
                          rounds)

    def choose(self, live: list[int], params: Sequence[SamplingParams], chooser: policy.Policy) -> Program:
        """The program of the next step for the ``live`` slots, whose requests' sampling ``params`` they are: among
        the compiled ones holding them in a variant their requests allow, one that needs timing at the smallest such
        slot batch (:meth:`needing_timing`; or, no compilation running, the cheapest variant of a form whose cost is
        older than ``COST_TTL_S`` of busy time times its ratio to the cheapest's there: its step times it,
        :meth:`stepped`), else ``chooser``'s choice among each form's smallest slot batch holding the live slots and
        the whole batch."""
        hot = [p for p in params if p.temperature > 0]
        need = "filtering" if any(accept.filters(p.top_p, p.top_k) for p in hot) else "sampling" if hot else "greedy"
        if need not in self._wanted:
            with self._lock:
                self._wanted.add(need)
                self._compile_wake.notify_all()  # the variant's programs: one for each compile thread
        if self.first.fn is None:  # started without warm-up: the first program serves any request
            self.compile(self.first)
        ok = [p for p in self._programs.values() if p.fn is not None and p.size >= len(live)
              and VARIANTS.index(p.variant) >= VARIANTS.index(need)]
        smallest = min(p.size for p in ok)
        untimed = self.needing_timing(p for p in ok if p.size == smallest)
        if untimed:
            program = min(untimed, key=lambda p: (self.costs.get(p.cost_key) is not None, _rank(p)))
            program.checked |= program.clean
            program.tried = program.timing = True
            return program
        best: dict[tuple[str, int], tuple[float, Program]] = {}
        for p in ok:
            c = self.costs.get(p.cost_key)
            if c is not None and ((p.form, p.size) not in best or c < best[p.form, p.size][0]):
                best[p.form, p.size] = (c, p)
        # of each form, its smallest slot batch holding the live slots and the whole batch (which runs in place, with
        # no gather): a larger gathered one does the same work on more rows, whatever its timing says (a timing lower
        # than the smallest's is noise, and the argmax over noisy costs goes to it: a lone request on an H200 ran 42%
        # of its steps at slot batches 2-8)
        least: dict[str, int] = {}
        for form, size in best:
            least[form] = min(least.get(form, size), size)
        best = {k: v for k, v in best.items() if k[1] in (least[k[0]], self.batch)}
        if not best:  # nothing timed yet at these sizes (steps that ran no round)
            return min(ok, key=lambda p: (p.size, _rank(p)))
        here = [cp for (_, size), cp in best.items() if size == smallest]
        cheapest = min((c for c, _ in here), default=0.0)
        stale = [p for c, p in here if self.busy - p.timed_at > COST_TTL_S * c / cheapest]
        if stale and self.quiet():
            program = min(stale, key=lambda p: p.timed_at)
            program.timing = True
            return program
        return best[chooser.choose(live, {k: c for k, (c, _) in best.items()})][1]
