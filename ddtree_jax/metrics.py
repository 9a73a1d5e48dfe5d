"""The serving engine's Prometheus metrics: requests, tokens, rounds by form, latencies, the policy's view."""

from __future__ import annotations

import collections
import gc
import threading
import time
from typing import TYPE_CHECKING

from ddtree_jax import decode

if TYPE_CHECKING:  # annotations only: the engine imports this module
    from ddtree_jax.engine import Engine
    from ddtree_jax.programs import Program

SUMMARY_S = 0.5  # the policy's gauges (expected acceptance length, ratio) are set at most this often


class Metrics:
    """Prometheus metrics of one engine, in their own registry (http_server.py exposes them on /metrics). Gauges read
    the engine's queue, slots and programs when scraped; the engine thread counts steps, deliveries and requests."""

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
        self.rounds_by_form = Counter("ddtree_form_sequence_rounds", "Rounds run, summed over sequences, by the form "
                                      "they took (ar, chain, or the tree budget)", ["form"], registry=r)
        self.rounds_by_reason = Counter("ddtree_reason_sequence_rounds", "Rounds run, summed over sequences, by why "
                                        "their program ran: policy (its choice), probe (its probe of a speculative "
                                        "form while AR steps win), timing (a program whose cost was missing, doubtful "
                                        "or stale: programs.Programs.choose)", ["reason"], registry=r)
        self.steps_by_batch = Counter("ddtree_slot_batch_steps", "Steps (groups of rounds) run, by the slot batch "
                                      "of their program", ["batch"], registry=r)
        self.expected = Gauge("ddtree_expected_acceptance_length", "The policy's expected tokens a round over the live "
                              "sequences at the form of the last step (1 for ar), set at most every 0.5 s", registry=r)
        self.ratio = Gauge("ddtree_acceptance_ratio", "Mean over the live sequences of accepted / predicted tokens "
                           "beyond the root at the form of the last step (the policy's correction of the drafter), "
                           "set at most every 0.5 s", registry=r)
        self.choices = Counter("ddtree_policy_choices", "Steps whose program the policy chose (not a timing)",
                               registry=r)
        self.expected_by_form = Counter("ddtree_policy_expected_tokens", "The policy's expected tokens a round of each "
                                        "form it could weigh, the mean over the live sequences, summed over its "
                                        "choices: over ddtree_policy_choices, what its choices weighed on average",
                                        ["form"], registry=r)
        Gauge("ddtree_programs_compiled", "Programs compiled (form x slot batch x sampling variant)",
              registry=r).set_function(lambda: engine.programs_ready)
        Gauge("ddtree_programs", "Programs the background compiler works towards", registry=r).set_function(
            lambda: engine.programs_wanted)
        self.step_seconds = Counter("ddtree_step_seconds", "Wall time of the device steps (dispatch to the read of "
                                    "their snapshot), summed", registry=r)
        self.admission_wait = Counter("ddtree_admission_wait_seconds", "The step thread's waits before the steps "
                                      "for the state changes queued since the step before (the prefills and inserts "
                                      "of the requests joining, slots marked done): device work outside the steps, "
                                      "summed", registry=r)
        self.host_seconds = Counter("ddtree_host_seconds", "The engine thread's time at work between device calls "
                                    "(choosing, statistics, deliveries, admissions; not its waits for a step), "
                                    "summed: near the wall time, the host paces the server", registry=r)
        self.batch_rounds = Counter("ddtree_batch_rounds", "Rounds the batch ran (each step's rounds, not summed over "
                                    "sequences): step seconds / batch rounds is the engine's round time", registry=r)
        lat = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
        self.round_latency = Histogram("ddtree_round_latency_seconds", "Wall time of one round of the batch "
                                       "(device step / rounds it ran)", buckets=lat, registry=r)
        self.admission = Histogram("ddtree_admission_seconds", "Host time to admit one request: its state built, "
                                   "its prefill queued on the device and its insert too, or handed to the step thread "
                                   "while a step is in flight (not waited for: the time to first token holds them)",
                                   buckets=lat + (5.0, 10.0), registry=r)
        slow = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
        self.ttft = Histogram("ddtree_time_to_first_token_seconds", "Submission to first delivered token",
                              buckets=slow, registry=r)
        self.latency = Histogram("ddtree_request_latency_seconds", "Submission to finish", buckets=slow, registry=r)
        r.register(_Costs(engine))
        r.register(_GcClock())
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._summarised = -SUMMARY_S  # when the policy's gauges were last set (Metrics.stepped)

    @staticmethod
    def _ratio(num, den) -> float:
        d = den._value.get()
        return num._value.get() / d if d else 0.0

    def stepped(self, engine: "Engine", program: "Program", live: list[int], snap: decode.Snapshot,
                reason: str, elapsed: float, waited: float = 0.0) -> None:
        """Count a step of ``program`` (engine thread) that took ``elapsed`` seconds, chosen for ``reason`` (policy,
        probe or timing), after ``waited`` seconds for the admissions before it."""
        self.admission_wait.inc(waited)
        if (batch_rounds := int(snap.new_rounds.max()) if snap.new_rounds.size else 0):
            self.round_latency.observe(elapsed / batch_rounds)
            self.batch_rounds.inc(batch_rounds)
            self.step_seconds.inc(elapsed)
        rounds = int(snap.new_rounds.sum())
        self.rounds.inc(rounds)
        self.rounds_by_form.labels(program.form).inc(rounds)
        self.rounds_by_reason.labels(reason).inc(rounds)
        self.steps_by_batch.labels(str(program.size)).inc()
        self.committed.inc(int(snap.new_tokens.sum()))
        now = time.perf_counter()
        if now - self._summarised >= SUMMARY_S:  # the policy's view costs ~0.3 ms at 32 slots: not every step's
            self._summarised = now
            expected, ratio = engine.policy.summary(live, program.form)
            self.expected.set(expected)
            self.ratio.set(ratio)

    def chose(self, expected: dict[str, float]) -> None:
        """The policy chose a step's program, expecting ``expected`` (form -> tokens a round per live sequence)."""
        self.choices.inc()
        for form, e in expected.items():
            self.expected_by_form.labels(form).inc(e)

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


class _GcClock:
    """``ddtree_gc_pause_seconds{generation}`` and ``ddtree_gc_collections{generation}``: the time the process spent in
    Python's cyclic garbage collector, which stops every thread (the engine's, the HTTP server's), and its collections,
    since the first engine's metrics (one process-wide ``gc.callbacks`` hook). A collection of the oldest generation
    scans every object it tracks: the objects an engine keeps are frozen out of it (programs.freeze)."""

    seconds = dict.fromkeys(range(3), 0.0)  # by generation
    collections = dict.fromkeys(range(3), 0)
    _started = 0.0

    def __init__(self):
        if _GcClock._hook not in gc.callbacks:
            gc.callbacks.append(_GcClock._hook)

    @staticmethod
    def _hook(phase: str, info: dict) -> None:
        if phase == "start":
            _GcClock._started = time.perf_counter()
        else:
            g = info["generation"]
            _GcClock.seconds[g] = _GcClock.seconds.get(g, 0.0) + time.perf_counter() - _GcClock._started
            _GcClock.collections[g] = _GcClock.collections.get(g, 0) + 1

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        s = CounterMetricFamily("ddtree_gc_pause_seconds", "Seconds in Python's cyclic garbage collector (every thread "
                                "stopped), by generation, summed", labels=["generation"])
        n = CounterMetricFamily("ddtree_gc_collections", "Collections of Python's cyclic garbage collector, by "
                                "generation", labels=["generation"])
        for g in sorted(self.seconds):
            s.add_metric([str(g)], self.seconds[g])
            n.add_metric([str(g)], self.collections[g])
        yield s
        yield n


class _Costs:
    """``ddtree_program_round_seconds{form, batch, variant}``: the cost table the policy weighs, seconds a round of each
    compiled program that has one (its timing, on free slots or by a step, plus the steps' offset:
    ``ddtree_jax.costs``), and ``ddtree_program_timed_round_seconds``, its timing alone; read when scraped."""

    def __init__(self, engine: "Engine"):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        labels = ["form", "batch", "variant"]
        g = GaugeMetricFamily("ddtree_program_round_seconds", "The policy's cost of one round of each compiled "
                              "program (form x slot batch x sampling variant), seconds", labels=labels)
        t = GaugeMetricFamily("ddtree_program_timed_round_seconds", "The timing of one round of each compiled "
                              "program (on free slots, or a step chosen to time it, less the steps' offset), which "
                              "with the offset is ddtree_program_round_seconds, seconds", labels=labels)
        entries = self.engine.costs.entries()  # one read: a timing between two reads showed in one metric only
        for p in list(self.engine.programs.values()):
            if p.fn is not None and p.cost_key in entries:
                cost, timed = entries[p.cost_key]
                g.add_metric([p.form, str(p.size), p.variant], cost)
                t.add_metric([p.form, str(p.size), p.variant], timed)
        yield g
        yield t
