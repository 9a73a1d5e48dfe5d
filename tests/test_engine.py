"""The continuous-batching engine on the fixture pair (dflash under --tree-budget auto, 3 slots): outputs equal the
reference and do not depend on what else is in the batch; stop strings, stop tokens, cancellation, queue limits;
the forms and slot batches a step may take."""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
import threading
import time
import weakref

import pytest

from ddtree_jax import autorun, costs, decode, engine as engines, programs
from ddtree_jax.tokenizer import load_tokenizer
from tests.conftest import blocking_like_a_gpu, fixture_path

SLOTS = 3
MAX_LEN = 128


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(fixture_path("target"))


@pytest.fixture(scope="module")
def engine(target, drafter, tokenizer):
    # --tree-budget auto (ar steps or the chain), the full slot batch alone: six programs to compile
    cfg = engines.EngineConfig(method="dflash", max_batch=SLOTS, max_len=MAX_LEN, rounds_per_step=3, batch_buckets=())
    eng = engines.Engine(target, drafter, cfg, tokenizer=tokenizer).start()
    yield eng
    eng.stop()


def greedy(max_tokens, **kw):
    return engines.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def decoding(engine, run, max_tokens):
    """Submit ``run``'s prompt, greedy; return once its first tokens arrived (its steps run back to back from there):
    (its events so far, an Event set when it ends)."""
    events, first, done = [], threading.Event(), threading.Event()

    def sink(ev):
        events.append(ev)
        first.set()
        if ev.finish_reason:
            done.set()

    engine.submit(run["prompt"], greedy(max_tokens), sink)
    assert first.wait(120)
    return events, done


def run_concurrently(engine, requests):
    """[(prompt, params)] -> [Completion], all submitted at once from threads."""
    out = [None] * len(requests)

    def go(i):
        out[i] = engine.generate(*requests[i], timeout=120)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_layout_buckets_and_capacity(engine):
    lay = engine.layout
    assert lay.bucket(1) == lay.bucket(64) == 64 and lay.bucket(65) == 128 == lay.top_bucket
    assert lay.buckets() == [64, 128]
    assert lay.capacity >= MAX_LEN + 2 * 8 and lay.out_len >= MAX_LEN + 8
    big = engines.Layout.of(engine.spec, 3000)
    assert big.bucket(600) == 1024 and big.bucket(2999) == big.top_bucket == 3072
    assert big.buckets() == [64, 128, 256, 512, 1024, 2048, 3072]


def test_greedy_equals_reference_alone_and_batched(engine, reference_runs):
    for run in reference_runs:
        n = len(run["prompt"])
        res = engine.generate(run["prompt"], greedy(run["max_new_tokens"]), timeout=120)
        assert res.token_ids == run["ar"][n:] and res.finish_reason == "length"
    # more requests than slots, different lengths: they queue, join between rounds, free slots when done
    reqs = [(r["prompt"], greedy(min(5 + 7 * i, r["max_new_tokens"]))) for i, r in enumerate(reference_runs * 3)]
    for (prompt, params), res in zip(reqs, run_concurrently(engine, reqs)):
        ref = next(r["ar"] for r in reference_runs if r["prompt"] == prompt)
        assert res.token_ids == ref[len(prompt): len(prompt) + params.max_tokens]
    assert engine.active_slots == 0 and engine.queue_length == 0


def test_waiting_requests_of_one_prompt_bucket_are_prefilled_together(engine, reference_runs, monkeypatch):
    """Requests waiting together whose prompts share a bucket are prefilled in one call (rows padded to a power of
    two: 1 or 2 with 3 slots), each row inserted into its own slot; every request keeps AR's tokens."""
    together, prefill_fn, admit_fn = [], engine._prefill, engine._admit

    def prefill(jobs):
        together.append(len(jobs))
        return prefill_fn(jobs)

    def admit(ahead):
        time.sleep(0.2)  # the requests submitted at once all wait by then
        return admit_fn(ahead)

    monkeypatch.setattr(engine, "_prefill", prefill)
    monkeypatch.setattr(engine, "_admit", admit)
    reqs = [(r["prompt"], greedy(12)) for r in reference_runs]
    assert len({engine.layout.bucket(len(p)) for p, _ in reqs}) == 1 and len(reqs) == 3
    for (prompt, params), res in zip(reqs, run_concurrently(engine, reqs)):
        ref = next(r["ar"] for r in reference_runs if r["prompt"] == prompt)
        assert res.token_ids == ref[len(prompt): len(prompt) + 12]
    assert sorted(together) == [1, 2], together


def test_seeded_sampling_does_not_depend_on_the_batch(engine, reference_runs):
    prompt = reference_runs[1]["prompt"]
    params = engines.SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    alone = engine.generate(prompt, params, timeout=120)
    assert engine.generate(prompt, params, timeout=120).token_ids == alone.token_ids
    other = engine.generate(prompt, dataclasses.replace(params, seed=99), timeout=120)
    assert other.token_ids != alone.token_ids
    neighbours = [(r["prompt"], engines.SamplingParams(max_tokens=20 + i, temperature=1.0, top_k=5 * i, seed=i))
                  for i, r in enumerate(reference_runs * 2)]
    results = run_concurrently(engine, neighbours[:3] + [(prompt, params)] + neighbours[3:])
    assert results[3].token_ids == alone.token_ids


def test_events_stream_every_token_once_and_text_decodes(engine, tokenizer, reference_runs):
    run = reference_runs[2]
    events, done = [], threading.Event()

    def sink(ev):
        events.append(ev)
        if ev.finish_reason:
            done.set()

    engine.submit(run["prompt"], greedy(40), sink)
    assert done.wait(120)
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
    assert len(events) > 2  # streamed every few rounds, not at the end only
    tokens = [t for e in events for t in e.token_ids]
    n = len(run["prompt"])
    assert tokens == run["ar"][n: n + 40]
    assert "".join(e.text for e in events) == tokenizer.decode(tokens)
    assert events[-1].completion_tokens == 40 and events[-1].prompt_tokens == n


def queued_spans(dispatch, spans: list):
    """``Engine._dispatch`` that appends each step's span, from its dispatch to its end on the step thread, to
    ``spans``."""

    def queue():
        span = [time.perf_counter(), float("inf")]
        spans.append(span)
        future = dispatch()
        future.add_done_callback(lambda _, span=span: span.__setitem__(1, time.perf_counter()))
        return future
    return queue


def test_a_step_runs_while_the_one_before_it_is_delivered(engine, reference_runs, monkeypatch):
    """On a GPU a step's call returns only once its rounds have run (here every call waits for its step and sleeps
    50 ms on top), so the engine queues the next step on its step thread before delivering the last one: a lone
    request's tokens are delivered while the following step is queued or running (all but the last step's, which
    has none after it; the step thread's start of the next call may come a moment after the delivery, so the span
    is the step's, from its dispatch to its end), and they are still AR's, each once."""
    run = reference_runs[2]
    steps, queued, events, done = [], [], [], threading.Event()  # calls' spans; steps' (dispatch, end); events

    def sink(ev):
        events.append((time.perf_counter(), ev))
        if ev.finish_reason:
            done.set()

    monkeypatch.setattr(engine.programs, "call", blocking_like_a_gpu(engine.programs.call, steps, 0.05))
    monkeypatch.setattr(engine, "_dispatch", queued_spans(engine._dispatch, queued))
    engine.submit(run["prompt"], greedy(40), sink)
    assert done.wait(120)
    streamed = [at for at, ev in events if ev.finish_reason is None]
    assert len(streamed) >= 3
    during = [at for at in streamed if any(a < at < b for a, b in queued)]
    assert len(during) >= len(streamed) - 1, (streamed, queued)  # delivered between the steps, none would be
    n = len(run["prompt"])
    assert [t for _, ev in events for t in ev.token_ids] == run["ar"][n: n + 40]


def test_a_step_is_read_only_once_the_next_one_is_launched(engine, reference_runs, monkeypatch):
    """The engine thread's work on a step it read (statistics, the policy, deliveries: Python, under the GIL) waits
    until the step queued after it has been handed to the device, whose launch on the step thread needs the GIL too:
    here each step's launch takes 30 ms of the step thread's time, and every step but the last is still read only
    as the next one's call begins (without the wait: 30 ms before); the tokens are AR's, each once."""
    run = reference_runs[2]
    calls, finished, events, done = [], [], [], threading.Event()

    def sink(ev):
        events.append(ev)
        if ev.finish_reason:
            done.set()

    def slow_launch(device_step):
        def step(*args):
            time.sleep(0.03)
            return device_step(*args)
        return step

    def finish(fn):
        def read(step, *args, **kw):
            finished.append(time.perf_counter())
            return fn(step, *args, **kw)
        return read

    monkeypatch.setattr(engines, "LAUNCH_WAIT_S", 10.0)
    monkeypatch.setattr(engine.programs, "call", blocking_like_a_gpu(engine.programs.call, calls, 0.02))
    monkeypatch.setattr(engine, "_device_step", slow_launch(engine._device_step))
    monkeypatch.setattr(engine, "_finish", finish(engine._finish))
    engine.submit(run["prompt"], greedy(40), sink)
    assert done.wait(120)
    assert len(calls) >= 4 and len(finished) == len(calls)
    for k in range(len(calls) - 1):  # the last step has none after it; its launch set just before its call
        assert calls[k + 1][0] < finished[k] + 0.01, (k, calls, finished)
    n = len(run["prompt"])
    assert [t for ev in events for t in ev.token_ids] == run["ar"][n: n + 40]


def test_requests_joining_and_ending_do_not_stop_the_steps_for_delivery(engine, reference_runs, monkeypatch):
    """When requests end on the device and others join, the engine keeps a step queued or running: a long request
    streamed beside a queue of two-token requests (two ending and two joining every step) still gets most of its
    tokens while a step is queued or running (calls held as on a GPU, 50 ms on top), each once and AR's. (Once, 7 of
    13: every other step's, the steps after which nothing ended or joined.)"""
    run = reference_runs[2]
    steps, queued, events, done = [], [], [], threading.Event()  # calls' spans; steps' (dispatch, end)

    def sink(ev):
        events.append((time.perf_counter(), ev))
        if ev.finish_reason:
            done.set()

    ended = threading.Semaphore(0)  # one release per short request that finished

    def short(ev):
        if ev.finish_reason:
            ended.release()

    monkeypatch.setattr(engine.programs, "call", blocking_like_a_gpu(engine.programs.call, steps, 0.05))
    monkeypatch.setattr(engine, "_dispatch", queued_spans(engine._dispatch, queued))
    for i in range(42):
        engine.submit(reference_runs[0 if i < 2 else 1]["prompt"], greedy(2), short)
        if i == 1:
            engine.submit(run["prompt"], greedy(40), sink)
    assert done.wait(120) and all(ended.acquire(timeout=120) for _ in range(42))  # the engine idle again after
    streamed = [at for at, ev in events if ev.finish_reason is None]
    assert len(streamed) >= 3
    during = [at for at in streamed if any(a < at < b for a, b in queued)]
    assert 4 * len(during) >= 3 * len(streamed), (len(during), len(streamed))
    n = len(run["prompt"])
    assert [t for _, ev in events for t in ev.token_ids] == run["ar"][n: n + 40]


def test_a_request_joins_without_the_step_in_flight_back(engine, reference_runs, monkeypatch):
    """A request that arrives while steps run is admitted beside the step in flight: prefilled and seated by the
    engine thread, inserted by the step thread once that step's call has ended, so the joiner's earliest step is
    queued while a call still runs (the device waits for no admission; with calls held as on a GPU, 50 ms on top),
    and both requests' tokens are AR's. (Before, the engine took the step in flight back to admit it.)"""
    long_run, short_run = reference_runs[2], reference_runs[0]
    calls, dispatches, inserts = [], [], {}  # the calls' spans; (time, live job ids) a dispatch; job id -> insert
    insert_fn, dispatch_fn = engine._insert, engine._dispatch

    def insert(job, one, row, slot):
        inserts.setdefault(job.id, time.perf_counter())
        return insert_fn(job, one, row, slot)

    def dispatch():
        dispatches.append((time.perf_counter(), {j.id for j in engine.slots if j is not None}))
        return dispatch_fn()

    monkeypatch.setattr(engine.programs, "call", blocking_like_a_gpu(engine.programs.call, calls, 0.05))
    monkeypatch.setattr(engine, "_insert", insert)
    monkeypatch.setattr(engine, "_dispatch", dispatch)
    events = {"long": [], "short": []}
    first, done = threading.Event(), threading.Semaphore(0)

    def sink(name):
        def take(ev):
            events[name].append(ev)
            first.set()
            if ev.finish_reason:
                done.release()
        return take

    engine.submit(long_run["prompt"], greedy(40), sink("long"))
    assert first.wait(120)  # its steps run back to back from here
    job = engine.submit(short_run["prompt"], greedy(6), sink("short"))
    assert done.acquire(timeout=120) and done.acquire(timeout=120)
    queued = next(at for at, ids in dispatches if job.id in ids)
    running = [(a, b) for a, b in calls if a < queued < b]
    assert running, (queued, calls)  # a call ran while the joiner's first step was queued
    assert running[0][1] < inserts[job.id], (running, inserts[job.id])  # and it was inserted after that call
    for name, run, n_new in (("long", long_run, 40), ("short", short_run, 6)):
        n = len(run["prompt"])
        assert [t for ev in events[name] for t in ev.token_ids] == run["ar"][n: n + n_new]


def test_a_step_that_times_its_program_runs_with_no_admission_beside_it(engine, reference_runs, monkeypatch):
    """A step chosen to time its program runs alone: a request arriving meanwhile is prefilled only once no such step
    is in flight (beside one, its prefill's kernels would run between the step's rounds and count as the program's
    cost). Here every step from some point on times its program, so the joiner is prefilled between calls."""
    import jax

    long_run, short_run = reference_runs[2], reference_runs[0]
    spans, prefills = [], {}
    call_fn, prefill_fn, choose_fn = engine.programs.call, engine._prefill, engine.programs.choose
    timing = threading.Event()

    def call(*args):
        began = time.perf_counter()
        out = jax.block_until_ready(call_fn(*args))
        time.sleep(0.05)  # held as on a GPU, where a call returns once its rounds have run
        spans.append((began, time.perf_counter()))
        return out

    def choose(*args):
        program = choose_fn(*args)
        program.timing = program.timing or timing.is_set()
        return program

    def prefill(jobs):
        prefills.update((job.id, time.perf_counter()) for job in jobs)
        return prefill_fn(jobs)

    monkeypatch.setattr(engine.programs, "call", call)
    monkeypatch.setattr(engine.programs, "choose", choose)
    monkeypatch.setattr(engine, "_prefill", prefill)
    events, done = decoding(engine, long_run, 40)
    timing.set()
    time.sleep(0.2)  # a timing step is in flight from here on
    short = engine.generate(short_run["prompt"], greedy(6), timeout=120)
    assert done.wait(120)
    joiner = max(prefills.items(), key=lambda kv: kv[1])
    assert not any(a < joiner[1] < b for a, b in spans), (joiner, spans)
    n, m = len(long_run["prompt"]), len(short_run["prompt"])
    assert [t for ev in events for t in ev.token_ids] == long_run["ar"][n: n + 40]
    assert short.token_ids == short_run["ar"][m: m + 6]


def test_a_joiner_whose_insert_fails_ends_alone(engine, reference_runs, monkeypatch):
    """A request admitted beside a step whose insert fails on the step thread ends with an error; the request already
    decoding keeps AR's tokens and the engine serves on (before, the step's failure stopped the engine)."""
    long_run, short_run = reference_runs[2], reference_runs[0]
    insert_fn = engine._insert

    def insert(job, one, row, slot):
        if job.prompt_ids == list(short_run["prompt"]) and threading.current_thread().name.startswith("ddtree-step"):
            raise RuntimeError("simulated device out of memory")
        return insert_fn(job, one, row, slot)

    monkeypatch.setattr(engine.programs, "call", blocking_like_a_gpu(engine.programs.call, [], 0.05))
    monkeypatch.setattr(engine, "_insert", insert)
    events, done = decoding(engine, long_run, 40)  # the next request joins beside one of its steps
    failed = engine.generate(short_run["prompt"], greedy(6), timeout=120)
    assert failed.finish_reason == "error" and "simulated device out of memory" in failed.error, failed
    assert failed.token_ids == []
    assert done.wait(120) and events[-1].finish_reason == "length"
    n = len(long_run["prompt"])
    assert [t for ev in events for t in ev.token_ids] == long_run["ar"][n: n + 40]
    assert engine.alive  # and it serves the same request once it is admitted with no step in flight
    again = engine.generate(short_run["prompt"], greedy(6), timeout=120)
    assert again.token_ids == short_run["ar"][len(short_run["prompt"]): len(short_run["prompt"]) + 6]


def test_stop_token_ids_and_max_tokens(engine, reference_runs):
    run = reference_runs[2]
    n = len(run["prompt"])
    gen = run["ar"][n:]
    stop = gen[5]
    res = engine.generate(run["prompt"], greedy(40, stop_token_ids=(stop,)), timeout=120)
    assert res.token_ids == gen[: gen.index(stop) + 1] and res.finish_reason == "stop"
    res = engine.generate(run["prompt"], greedy(3), timeout=120)
    assert res.token_ids == gen[:3] and res.finish_reason == "length"
    res = engine.generate(run["prompt"], greedy(40, stop_token_ids=(stop,)), ignore_eos=True, timeout=120)
    assert res.finish_reason == "stop"  # ignore_eos drops the model's eos ids only


def test_stop_strings_cut_the_text(engine, tokenizer, reference_runs):
    run = reference_runs[0]
    full = engine.generate(run["prompt"], greedy(40), timeout=120)
    text = full.text
    # a stop string from the middle of the text (avoiding replacement characters of split bytes)
    start = next(i for i in range(10, len(text) - 3) if "\ufffd" not in text[i: i + 3] and text[i: i + 3].strip())
    stop = text[start: start + 3]
    cut = text.index(stop)
    res = engine.generate(run["prompt"], greedy(40, stop=(stop, "never-in-the-output")), timeout=120)
    assert res.finish_reason == "stop"
    assert res.text == text[:cut]
    # the tokens end at the one that completed the stop string
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert stop in tokenizer.decode(res.token_ids) and stop not in tokenizer.decode(res.token_ids[:-1])
    assert engine.active_slots == 0


def test_only_ends_on_the_host_wait_to_be_marked_on_the_device(engine, tokenizer, reference_runs, monkeypatch):
    """A request the device ended (its length, a stop token) leaves its slot done there: nothing to mark, so its end
    does not make the engine wait for the step in flight before the next (which a state change would); one a stop
    string ended on the host is marked done on the device (the step in flight keeps decoding it)."""
    run = reference_runs[0]
    marked = []  # the slots _mark_ended found, each time it ran
    original = engine._mark_ended

    def mark_ended():
        marked.append(list(engine._ended))
        original()

    engine.generate(run["prompt"], greedy(2), timeout=120)  # marks what earlier tests' ends left
    monkeypatch.setattr(engine, "_mark_ended", mark_ended)
    assert engine.generate(run["prompt"], greedy(12), timeout=120).finish_reason == "length"
    assert engine.generate(run["prompt"], greedy(3), timeout=120).finish_reason == "length"
    assert not any(marked)
    text = engine.generate(run["prompt"], greedy(40), timeout=120).text
    start = next(i for i in range(10, len(text) - 3) if "\ufffd" not in text[i: i + 3] and text[i: i + 3].strip())
    res = engine.generate(run["prompt"], greedy(40, stop=(text[start: start + 3],)), timeout=120)
    assert res.finish_reason == "stop" and engine.active_slots == 0
    engine.generate(run["prompt"], greedy(2), timeout=120)  # the next admission marks it, if nothing did before
    assert [s for m in marked for s in m] == [0]  # the stop string's slot, once


def test_cancel_frees_the_slot(engine, reference_runs):
    run = reference_runs[0]
    events, done = [], threading.Event()

    def sink(ev):  # runs in the engine thread: cancel right after the first delivery, deterministically
        events.append(ev)
        if len(events) == 1:
            engine.cancel(job)
        if ev.finish_reason:
            done.set()

    job = engine.submit(run["prompt"], greedy(100), sink)
    assert done.wait(120)
    assert events[-1].finish_reason == "cancelled"
    assert 0 < sum(len(e.token_ids) for e in events) < 100
    assert engine.active_slots == 0
    # a cancelled request's slot serves the next one normally
    n = len(run["prompt"])
    assert engine.generate(run["prompt"], greedy(10), timeout=120).token_ids == run["ar"][n: n + 10]


def test_cancel_while_waiting_or_running_always_answers(engine, reference_runs):
    finals = []
    jobs = [engine.submit(r["prompt"], greedy(60), lambda ev: ev.finish_reason and finals.append(ev.finish_reason))
            for r in reference_runs * 2]  # 6 requests for 3 slots: some are still waiting
    for job in jobs:
        engine.cancel(job)
    deadline = threading.Event()
    for _ in range(200):
        if len(finals) == len(jobs):
            break
        deadline.wait(0.05)
    assert len(finals) == len(jobs) and set(finals) <= {"cancelled", "length"}
    assert engine.active_slots == 0 and engine.queue_length == 0


def test_bad_requests_and_full_queue(engine):
    with pytest.raises(engines.RequestError, match="maximum context length") as e:
        engine.submit([1] * 120, greedy(20), print)
    assert e.value.param == "max_tokens"
    with pytest.raises(engines.RequestError, match="maximum context length"):
        engine.submit([1] * MAX_LEN, greedy(1), print)
    for params, field in [(greedy(0), "max_tokens"), (engines.SamplingParams(4, top_p=0.0), "top_p"),
                          (engines.SamplingParams(4, temperature=-1.0), "temperature"),
                          (engines.SamplingParams(4, seed=2**32), "seed"), (greedy(4, stop=("",)), "stop"),
                          (greedy(4, stop_token_ids=(300,)), "stop_token_ids"),
                          (greedy(4, stop_token_ids=tuple(range(9))), "stop_token_ids")]:
        with pytest.raises(engines.RequestError) as e:
            engine.submit([1, 2, 3], params, print)
        assert e.value.param == field
    with pytest.raises(engines.RequestError, match="vocabulary"):
        engine.submit([1, 256], greedy(4), print)



def test_full_queue_is_refused_and_the_rest_complete(engine, reference_runs):
    """max_queue 0: requests are taken while slots are free, refused once every slot is spoken for."""
    saved = engine.config
    engine.config = dataclasses.replace(saved, max_queue=0)
    results, refused, done = [], [], threading.Event()

    def collect(ev):
        if ev.finish_reason:
            results.append(ev.finish_reason)
            if len(results) == SLOTS:
                done.set()

    def first(ev):  # in the engine thread, which admits nothing meanwhile: deterministic
        if not refused:
            refused.append(None)
            for _ in range(SLOTS - 1):  # the free slots
                engine.submit([1, 2, 3], greedy(4), collect)
            with pytest.raises(engines.QueueFull):
                engine.submit([1, 2, 3], greedy(4), collect)
            refused[0] = True
        collect(ev)

    try:
        engine.submit(reference_runs[0]["prompt"], greedy(30), first)
        assert done.wait(120)
    finally:
        engine.config = saved
    assert refused == [True] and results == ["length"] * SLOTS


def test_a_broken_sink_cancels_only_its_request(engine, reference_runs):
    def broken(ev):
        raise RuntimeError("client gone")

    engine.submit(reference_runs[0]["prompt"], greedy(50), broken)
    run = reference_runs[1]
    n = len(run["prompt"])
    assert engine.generate(run["prompt"], greedy(20), timeout=120).token_ids == run["ar"][n: n + 20]
    for _ in range(100):
        if engine.active_slots == 0:
            break
        threading.Event().wait(0.05)
    assert engine.active_slots == 0 and engine.alive


def test_stop_answers_every_pending_request(target, drafter, engine, reference_runs):
    # same shapes as the module's engine: everything is compiled already
    eng = engines.Engine(target, drafter, engine.config, tokenizer=engine.tokenizer).start(warmup=False)
    finals = []
    for r in reference_runs * 3:
        eng.submit(r["prompt"], greedy(60), lambda ev: ev.finish_reason and finals.append(ev))
    assert sys.getswitchinterval() <= autorun.HANDOFF_S  # the step threads hand the GIL back quickly
    eng.stop()
    assert sys.getswitchinterval() <= autorun.HANDOFF_S  # ... while the module's engine still runs
    assert len(finals) == 9 and all(f.finish_reason in ("error", "length") for f in finals)
    assert any(f.finish_reason == "error" and "shutting down" in f.error for f in finals)
    with pytest.raises(engines.EngineClosed):
        eng.submit([1, 2], greedy(2), print)


def test_stop_ends_every_idle_compile_thread(target, drafter, engine, monkeypatch):
    """With several background compile threads (EngineConfig.compile_threads, serve's --compile-threads), all idle
    once every wanted program is compiled, stop() wakes and ends each of them (waking one left the others waiting
    until their join timed out)."""
    monkeypatch.setattr(programs, "COMPILE_THREADS", 1)  # the default the config overrides
    cfg = dataclasses.replace(engine.config, compile_threads=3)
    eng = engines.Engine(target, drafter, cfg, tokenizer=engine.tokenizer).start(warmup=False)
    threads = eng.programs._compilers
    assert len(threads) == 3
    wait_until(lambda: not eng.programs._pending() and eng.programs._in_flight == 0, timeout=120)
    time.sleep(0.5)  # every compile thread back to waiting
    t0 = time.monotonic()
    eng.stop(timeout=10)
    assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 10


def wait_until(predicate, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_costs_timed_during_compilation_are_timed_again_when_it_is_done(target, drafter):
    """A cost timed while the compiler's threads ran (or loaded from disk) may be inflated, and a program whose
    cost is too high is never chosen to correct it: once no compilation runs, the idle engine times it again."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=MAX_LEN, batch_buckets=(1,))
    eng = engines.Engine(target, drafter, cfg)
    eng.start()
    try:
        wait_until(lambda: eng.programs_ready == 3 and not eng._untimed())
        assert all(p.clean for p in eng.programs.values() if p.fn is not None)
        p = eng.programs["ar", 1, "greedy"]
        eng.costs.measured(p.cost_key, 100.0, 64)  # as if timed beside a compilation
        with eng._lock:
            p.clean = False
            eng._wake.notify()
        wait_until(lambda: p.clean)
        assert eng.costs.get(p.cost_key) < 10.0
    finally:
        eng.stop()


def test_steps_beside_a_compilation_leave_the_cost_to_a_timing_when_it_is_done(target, drafter):
    """A step slowed by the compiler's threads (2x on 2 CPU cores) does not move its program's cost: once the cost
    of a slot batch of one rose so, a lone request ran on the slot batch of two ever after (never chosen, it was
    never corrected). The program is timed again once no compilation runs."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=MAX_LEN, batch_buckets=(1,))
    eng = engines.Engine(target, drafter, cfg)
    eng.start()
    try:
        wait_until(lambda: eng.programs_ready == 3 and not eng._untimed())
        p = eng.programs["ar", 1, "greedy"]
        before = eng.costs.get(p.cost_key)
        with eng._lock:  # the next steps run "beside a compilation", on the slot batch of one whatever the timings
            eng.programs.quiet = lambda: False  # (on a noisy CPU the slot batch of two was sometimes timed faster:
            for q in eng.programs.values():  # its greedy program, or the first one, of the filtering variant)
                if q.size == 2 and q.fn is not None:
                    eng.costs.measured(q.cost_key, 1e3 * before, MAX_LEN)
        res = eng.generate([1, 2, 3], greedy(12), timeout=120)
        assert len(res.token_ids) == 12 and eng.step_programs["ar", 1, "greedy"] > 0
        assert eng.costs.get(p.cost_key) == before and not p.clean
        with eng._lock:
            del eng.programs.quiet  # the class's again: nothing compiles
            eng._wake.notify()
        wait_until(lambda: p.clean)
        assert eng.costs.get(p.cost_key) != before  # timed anew
    finally:
        eng.stop()


def test_a_compiled_program_is_left_out_of_the_garbage_collectors_scans(target, drafter):
    """A compiled program keeps thousands of Python objects alive (its traced program, in jax's caches: about 18
    thousand for this tiny pair's AR step, 20-30 thousand for the default pair's forms); each collection of Python's
    oldest generation scanned them all with every thread stopped (0.30 s for 340 thousand objects on 2 CPU cores).
    Compiling one leaves the collector's tracked objects no more numerous than before."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=96, batch_buckets=())
    eng = engines.Engine(target, drafter, cfg)  # a shape no other test compiles: its tracing is new
    gc.collect()
    tracked = len(gc.get_objects())
    eng.programs.compile(eng.first)
    assert eng.first.fn is not None
    assert len(gc.get_objects()) < tracked + 1000


def test_the_idle_engine_compiles_every_prompt_buckets_prefill(target, drafter):
    """Start-up compiles the shortest prompt bucket's prefill; the idle engine compiles the others', one a pass of
    its loop: the first prompt of a new length no longer holds every running request up while its prefill
    compiles."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=112, batch_buckets=())
    eng = engines.Engine(target, drafter, cfg)  # shapes no other test compiles: buckets of 64 and 128 tokens
    assert eng.layout.buckets() == [64, 128]
    eng.start()
    try:
        wait_until(lambda: not eng._cold)
        compiled = engines.prefill._cache_size()
        res = eng.generate(list(range(1, 101)), greedy(4), timeout=120)  # a prompt of the 128-token bucket
        assert len(res.token_ids) == 4
        assert engines.prefill._cache_size() == compiled
    finally:
        eng.stop()


def test_a_prefill_that_fails_while_idle_leaves_the_engine_serving(target, drafter, monkeypatch):
    """The idle engine's compilation of a prefill that fails (e.g. out of device memory) is logged and dropped; the
    engine serves on (the idle work runs on its thread, whose failure would end every request)."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=MAX_LEN, batch_buckets=())
    eng = engines.Engine(target, drafter, cfg)
    warm_fn = eng._warm

    def warm(bucket, n):
        if bucket > 64:
            raise RuntimeError("simulated device out of memory")
        return warm_fn(bucket, n)

    monkeypatch.setattr(eng, "_warm", warm)
    eng.start()
    try:
        wait_until(lambda: not eng._cold)
        assert eng.alive
        assert len(eng.generate([1, 2, 3], greedy(4), timeout=120).token_ids) == 4
    finally:
        eng.stop()


def test_a_stopped_engine_is_freed(target, drafter):
    """The engine freezes its objects out of the collector's scans; stopped, it gives them back: an engine is a
    reference cycle (its threads, its loop) that only the collector frees, and with it its weights and slot state (a
    notebook that starts a second engine must not keep the first's memory)."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=MAX_LEN, batch_buckets=())
    eng = engines.Engine(target, drafter, cfg).start()
    assert len(eng.generate([1, 2, 3], greedy(4), timeout=120).token_ids) == 4
    eng.stop()
    gone = weakref.ref(eng)
    del eng
    gc.collect()
    assert gone() is None


def test_the_step_log_has_a_line_per_step(target, drafter, tmp_path):
    """EngineConfig.step_log (serve --step-log): one JSON line per device step, in order, with its program, rounds,
    live requests and committed tokens: the steps' tokens add up to the request's."""
    log = tmp_path / "steps.jsonl"
    cfg = engines.EngineConfig(method="ddtree", forms=("ar", "4"), max_batch=2, max_len=MAX_LEN, batch_buckets=(1,),
                               step_log=str(log))
    eng = engines.Engine(target, drafter, cfg).start()
    try:
        assert len(eng.generate([1, 2, 3], greedy(12), timeout=120).token_ids) == 12
    finally:
        eng.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines and sum(x["tokens"] for x in lines) == 12  # the request's tokens, each committed by a step
    assert all(x["form"] in ("ar", "4") and x["batch"] in (1, 2) and x["variant"] in programs.VARIANTS for x in lines)
    assert all(x["elapsed"] > 0 and x["reason"] in ("policy", "probe", "timing") for x in lines)
    assert all(0 < x["launch"] <= x["elapsed"] for x in lines)  # the program's call returns before its result is read
    # a step queued while the one before ended the request runs no round: logged too
    assert all((x["live"], x["rounds"] > 0) in ((1, True), (0, False)) for x in lines) and lines[0]["live"] == 1
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)
    assert len(lines) == sum(eng.step_programs.values())  # every step the engine counted


def test_no_step_is_queued_behind_one_that_surely_ends_the_requests(target, drafter, tmp_path):
    """AR steps commit one token a round: a lone request of 12 (then one of 10) tokens takes three steps of 4 rounds,
    and the engine, which queues each step before reading the one in flight, queues no step after the third for it:
    the third surely ends it (its cache then holds its limit), so one more would be a device call of no round. (The
    second request reads the first's last step queued, if any.)"""
    log = tmp_path / "steps.jsonl"
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=MAX_LEN, batch_buckets=(1,),
                               rounds_per_step=4, step_ms=0, step_log=str(log))
    eng = engines.Engine(target, drafter, cfg).start()
    try:
        for max_tokens in (12, 10):
            assert len(eng.generate([1, 2, 3], greedy(max_tokens), timeout=120).token_ids) == max_tokens
    finally:
        eng.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["live"], x["rounds"]) for x in lines] == [(1, 4), (1, 4), (1, 4), (1, 4), (1, 4), (1, 2)]


def test_a_lone_request_runs_longer_steps_after_its_first(target, drafter, tmp_path, monkeypatch):
    """With step_ms, a step at slot batch 1 runs as many rounds as fit by its cost, up to MAX_STEP_ROUNDS; the steps
    queued before a request's first tokens are delivered run rounds_per_step, so that they arrive as soon as before.
    Costs set here (1 ms a round at slot batch 1: 16 fit in 20 ms): a lone AR request of 40 tokens takes steps of 4
    and 4 rounds, then 16 and 16."""
    log = tmp_path / "steps.jsonl"
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=MAX_LEN, batch_buckets=(1,),
                               rounds_per_step=4, step_ms=20, step_log=str(log))
    eng = engines.Engine(target, drafter, cfg).start()
    try:
        wait_until(lambda: eng.programs_ready == 3 and not eng._untimed())  # the first and the greedy two
        for p in eng.programs.values():
            eng.costs.measured(p.cost_key, 1e-3 * p.size, 64)  # slot batch 1 the cheaper
        monkeypatch.setattr(eng.costs, "observe", lambda *a: None)
        monkeypatch.setattr(programs, "COST_TTL_S", 1e9)  # no step times its program again
        assert len(eng.generate([1, 2, 3], greedy(40), timeout=120).token_ids) == 40
    finally:
        eng.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(x["batch"], x["rounds"]) for x in lines if x["live"]] == [(1, 4), (1, 4), (1, 16), (1, 16)]


def test_programs_are_timed_one_at_a_time_never_timed_first(target, drafter):
    """The engine times one program a pass of its loop, so requests are admitted and stepped between timings
    (timing all at once held a lone request up to 30 s on 2 CPU cores); programs never timed go first."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar", "4"), max_batch=2, max_len=MAX_LEN, batch_buckets=(1,))
    eng = engines.Engine(target, drafter, cfg)
    eng.warmup()
    progs = eng.programs
    for p in progs.values():
        if p.variant == "greedy":
            progs.compile(p)
    assert progs.quiet()
    known = progs["ar", 1, "greedy"]
    progs.costs.measured(known.cost_key, 1.0, 64)
    known.tried, known.clean = True, False  # its cost known but timed beside a compilation: to be timed again
    todo = progs.to_time(2)
    costed = [p for p in todo if progs.costs.get(p.cost_key) is not None]
    assert known in costed and len(todo) > len(costed)
    timed = []
    measured = progs.costs.measured
    progs.costs.measured = lambda key, *a: (timed.append(key), measured(key, *a))[1]
    for n in range(1, len(todo) + 1):
        eng._measure_ready()
        assert len(timed) == n  # one a pass
    never = {p.cost_key for p in todo if p not in costed}
    assert set(timed[: len(never)]) == never  # the ones never timed first
    assert known.cost_key in timed and progs.costs.get(known.cost_key) != 1.0 and known.clean


def test_a_step_runs_each_forms_smallest_slot_batch_or_the_whole_batch(target, drafter):
    """A gathered program does the same work at a larger slot batch on more rows: of each form the policy weighs the
    smallest slot batch holding the live slots, whatever a larger one's timing says (a lower one is noise), and the
    whole batch, which runs in place with no gather and may be cheaper."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=4, max_len=MAX_LEN, batch_buckets=(1, 2))
    eng = engines.Engine(target, drafter, cfg)
    eng.warmup()
    progs = eng.programs
    by_size = {p.size: p for p in progs.values() if p.variant == "greedy"}
    assert sorted(by_size) == [1, 2, 4]
    for p in by_size.values():
        progs.compile(p)
        p.tried = p.clean = p.checked = True
        p.timed_at = progs.busy
    params = [greedy(8)]

    def chosen(**seconds):
        for size, sec in seconds.items():  # every variant's: the warm-up timed the whole batch's filtering one
            for p in progs.values():
                if p.size == int(size[1:]):
                    progs.costs.measured(p.cost_key, sec, 64)
        return progs.choose([0], params, eng.policy).size

    assert chosen(s1=2e-3, s2=1e-3, s4=3e-3) == 1  # slot batch 2 timed under 1: never chosen for one request
    assert chosen(s1=2e-3, s2=1e-3, s4=1.5e-3) == 4  # the whole batch, in place, timed under 1: chosen
    assert progs.choose([0, 1], params * 2, eng.policy).size == 2  # two live requests: slot batch 2 is the least


def test_under_load_steps_time_the_programs_they_need(target, drafter):
    """With requests live the engine times nothing on free slots (that held them); a program of the live slot batch
    whose cost needs timing runs the next step, whose timing becomes its cost. A cost above the same form's at a
    larger slot batch is timed again once: a slowed timing would otherwise keep a program unchosen for good."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar",), max_batch=2, max_len=MAX_LEN, batch_buckets=(1,))
    eng = engines.Engine(target, drafter, cfg)
    eng.start()
    try:
        wait_until(lambda: eng.programs_ready == 3 and not eng._untimed())
        progs = eng.programs
        p, big = progs["ar", 1, "greedy"], progs["ar", 2, "greedy"]
        timed_live = []
        measure = progs.measure
        progs.measure = lambda *a, **k: (timed_live.append(eng.active_slots), measure(*a, **k))[1]
        with eng._lock:
            eng.costs.measured(p.cost_key, 100.0, 64)  # as if timed beside a compilation
            p.clean = False
        res = eng.generate([1, 2, 3], greedy(12), timeout=120)
        assert len(res.token_ids) == 12 and eng.step_programs["ar", 1, "greedy"] > 0
        assert not any(timed_live) and p.clean and eng.costs.get(p.cost_key) < 10.0

        with eng._lock:  # a clean cost above the slot batch of two's: timed again, once
            eng.costs.measured(p.cost_key, 100.0, 64)
            p.checked = False  # (the idle engine may have checked the step's timing against ar@2's already)
            assert progs.needing_timing([p]) == [p]
            assert eng.programs_timed == eng.programs_ready - 1  # /health: not yet the steady state
            eng._wake.notify()
        wait_until(lambda: eng.costs.get(p.cost_key) < 10.0)
        assert p.checked and eng.programs_timed == eng.programs_ready
        with eng._lock:
            eng.costs.measured(p.cost_key, 100.0, 64)  # as if that timing confirmed it
            assert eng.costs.get(big.cost_key) < 100.0 and not progs.needing_timing([p])
    finally:
        eng.stop()


def test_a_cost_older_than_its_ttl_is_timed_again_by_a_step(target, drafter):
    """Under load the steps move only the offset every cost holds: a program timed once in a slower phase (the
    server's table on 2 CPU cores held AR at 98.6 ms a round, 22-25 alone) would stay out for good. A cost is
    trusted for programs.COST_TTL_S of the engine's busy time times its ratio to the cheapest's; after that the next
    step that may run its program does, and its timing replaces the cost."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar", "chain", "4"), max_batch=1, max_len=MAX_LEN,
                               batch_buckets=())
    eng = engines.Engine(target, drafter, cfg)
    eng.start()
    try:
        wait_until(lambda: eng.programs_ready == 4 and not eng._untimed())
        p = eng.programs["4", 1, "greedy"]
        with eng._lock:  # a slowed timing, fresh: trusted, so the tree of 4 is never chosen
            eng.costs.measured(p.cost_key, 1000.0, 64)
            p.timed_at = eng.programs.busy
        assert len(eng.generate([1, 2, 3], greedy(12), timeout=120).token_ids) == 12
        assert eng.step_programs["4", 1, "greedy"] == 0 and eng.costs.entries()[p.cost_key][1] == 1000.0
        busy = eng.programs.busy
        time.sleep(1.0)  # idle: the clock that ages costs is the steps' time (a pause does not re-time every form)
        assert eng.programs.busy == busy > 0
        with eng._lock:  # the same cost, past its time: busy seconds, its ratio to the cheapest's x COST_TTL_S
            cheapest = min(c for q in eng.programs.values() if (c := eng.costs.get(q.cost_key)) is not None)
            p.timed_at -= 2 * 1000.0 / cheapest * programs.COST_TTL_S
        assert len(eng.generate([1, 2, 3], greedy(12), timeout=120).token_ids) == 12
        assert eng.step_programs["4", 1, "greedy"] >= 1 and eng.costs.get(p.cost_key) < 10.0
        assert eng.metrics.rounds_by_reason.labels("timing")._value.get() >= 1  # /metrics tells such steps apart
    finally:
        eng.stop()


def test_a_step_beside_admissions_leaves_its_cost_alone(engine):
    """Requests join beside the step in flight, their prefills queued while it runs (on a GPU their kernels run
    between its rounds), so that step's time is not its program's alone: it does not move the costs; a step alone does
    (the offset every cost holds, by costs.REFINE of the step's excess, the step clipped to costs.OUTLIER times the
    cost). A step chosen to time its program times it, less the offset (the engine runs such a step with no admission
    beside it: test_a_step_that_times_its_program_runs_with_no_admission_beside_it)."""
    p = engine.first
    with engine._lock:
        offset, engine.costs.offset = engine.costs.offset, 0.0  # the module's steps may have moved it: from none
        cost = engine.costs.get(p.cost_key)
        engine.programs.stepped(p, 100 * cost, 1, 64, quiet=True, shared=True)
        assert engine.costs.get(p.cost_key) == cost
        engine.programs.stepped(p, 100 * cost, 1, 64, quiet=True)
        assert engine.costs.get(p.cost_key) == pytest.approx(cost * (1 + costs.REFINE * (costs.OUTLIER - 1)))
        moved = engine.costs.offset
        p.timing = True
        engine.programs.stepped(p, 2 * cost + moved, 1, 64, quiet=True, shared=True)
        assert engine.costs.entries()[p.cost_key][1] == pytest.approx(2 * cost) and not p.timing
        engine.costs.offset = offset
        engine.costs.measured(p.cost_key, cost, 64)


def test_forms_and_slot_batches_run_only_the_live_slots(target, drafter, tokenizer, reference_runs, monkeypatch):
    """Under --tree-budget auto each step runs the (form, slot batch) the policy picks among the compiled programs:
    the warm-up compiles the full batch's AR step (in the variant that serves any request), the background compiler
    the greedy rest, and a sampling variant once a request needs one. With a slot batch of 1 cheaper than 3 (set
    here: the CPU's timings are noisy), a lone request runs gathered out of the slots and scattered back, three run
    in the full batch: greedy outputs equal the reference either way, and a seeded sample is the same alone and
    batched, and is AR's for its seed (generate's, with its seed)."""
    cfg = engines.EngineConfig(method="ddtree", forms=("ar", "4"), max_batch=3, max_len=MAX_LEN, rounds_per_step=2,
                               batch_buckets=(1,))
    eng = engines.Engine(target, drafter, cfg, tokenizer=tokenizer)
    assert eng.sizes == [1, 3]
    assert set(eng.programs) == {(f, n, v) for f in ("ar", "4") for n in (1, 3) for v in programs.VARIANTS}
    eng.start()
    try:
        assert eng.first.fn is not None and eng.costs.get(eng.first.cost_key) is not None  # compiled and timed
        wait_until(lambda: eng.programs_ready == 5)  # the greedy ones besides the first
        wait_until(lambda: not eng._untimed())  # every program timed with no compilation in flight
        for (form, size, _), p in eng.programs.items():
            eng.costs.measured(p.cost_key, 1e-3 * size * (2 if form == "4" else 1), 64)
        monkeypatch.setattr(eng.costs, "observe", lambda *a: None)
        run = reference_runs[0]
        n = len(run["prompt"])
        res = eng.generate(run["prompt"], greedy(run["max_new_tokens"]), timeout=120)
        assert res.token_ids == run["ar"][n:]
        assert eng.step_sizes[1] > 0 and eng.step_sizes[3] == 0
        assert {form for form, _, _ in eng.step_programs} == {"ar", "4"}  # 4 explored, then AR (random drafter)
        params = engines.SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
        alone = eng.generate(reference_runs[1]["prompt"], params, timeout=120)
        reqs = [(r["prompt"], greedy(min(4 + 5 * i, r["max_new_tokens"]))) for i, r in enumerate(reference_runs)]
        results = run_concurrently(eng, reqs + [(reference_runs[1]["prompt"], params)])
        for (prompt, p), got in zip(reqs, results):
            ref = next(r["ar"] for r in reference_runs if r["prompt"] == prompt)
            assert got.token_ids == ref[len(prompt): len(prompt) + p.max_tokens]
        assert results[-1].token_ids == alone.token_ids
        assert eng.step_sizes[3] > 0
        wait_until(lambda: eng.programs_ready == eng.programs_wanted == 8)  # the greedy and the top-p ones
    finally:
        eng.stop()
    opts = decode.GenerateOptions(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    ar = decode.generate(target, [reference_runs[1]["prompt"]], opts)
    assert ar.output_ids[0][len(reference_runs[1]["prompt"]):] == alone.token_ids
    with pytest.raises(ValueError, match="batch buckets must be between 1 and max_batch - 1"):
        engines.Engine(target, drafter, dataclasses.replace(cfg, batch_buckets=(3,)))


def test_a_round_that_commits_nothing_ends_the_request_with_an_error(target, drafter, tokenizer, reference_runs,
                                                                     faulty_walk):
    """Every round commits a token at least; a step where a slot ran more rounds than it committed tokens (a
    faulty walk, simulated here) ends that request with a 'decode fault' error instead of serving its output."""
    cfg = engines.EngineConfig(method="dflash", max_batch=1, max_len=MAX_LEN, rounds_per_step=2)
    # no warm-up: the greedy request compiles the one program it runs (warm-up would compile all three)
    eng = engines.Engine(target, drafter, cfg, tokenizer=tokenizer).start(warmup=False)
    try:
        run = reference_runs[0]
        res = eng.generate(run["prompt"], greedy(run["max_new_tokens"]), timeout=120)
        assert res.finish_reason == "error" and "decode fault" in res.error
    finally:
        eng.stop()


def test_a_step_runs_more_rounds_where_they_fit_in_step_ms():
    """Programs.rounds: a step runs as many rounds as fit in step_s by its program's cost, at least rounds_per_step
    and at most the program's ``most`` (compiled in: MAX_STEP_ROUNDS // slot batch, at least rounds_per_step);
    rounds_per_step while its cost is unknown, and always with step_s 0."""
    lock = threading.Lock()
    table = {("ar", n, "greedy"): programs.Program("ar", n, "greedy", None) for n in (1, 2, 8)}

    def progs(step_s):
        return programs.Programs(table, table["ar", 1, "greedy"], weights=(None, None), shapes=None, batch=8,
                                 rounds_per_step=4, max_len=64, path_len=1, cost_table=costs.CostTable("t"),
                                 lock=lock, wake=threading.Condition(lock), step_s=step_s)

    p = progs(0.02)
    assert [table["ar", n, "greedy"].most for n in (1, 2, 8)] == [programs.MAX_STEP_ROUNDS, 8, 4]
    assert [p.rounds(table["ar", n, "greedy"]) for n in (1, 2, 8)] == [4, 4, 4]  # costs unknown
    for n, sec in ((1, 1e-3), (2, 1e-3), (8, 1e-3)):
        p.costs.measured(costs.program_key("ar", n, "greedy"), sec, 64)
    assert [p.rounds(table["ar", n, "greedy"]) for n in (1, 2, 8)] == [16, 8, 4]  # 20 fit in 20 ms: capped
    p.costs.measured(costs.program_key("ar", 1, "greedy"), 2.5e-3, 64)
    assert p.rounds(table["ar", 1, "greedy"]) == 8
    p.costs.measured(costs.program_key("ar", 1, "greedy"), 9e-3, 64)
    assert p.rounds(table["ar", 1, "greedy"]) == 4  # 2 fit: rounds_per_step at least
    fixed = progs(0.0)
    assert [table["ar", n, "greedy"].most for n in (1, 2, 8)] == [4, 4, 4]
    assert fixed.rounds(table["ar", 1, "greedy"]) == 4


def test_one_compile_thread_works_while_the_engine_serves():
    """Programs.serving(True) (requests live or waiting) leaves one background compile thread working, so that the
    steps keep the host (and the GPU) nearly to themselves (2-6x slower beside four on an H100); once idle, every
    thread compiles. Compilation faked: each takes 0.5 s (so that the three overlap even on a busy machine) and records
    how many ran at once."""
    lock = threading.Lock()
    table = {(str(b), 1, "greedy"): programs.Program(str(b), 1, "greedy", None) for b in range(1, 9)}
    progs = programs.Programs(table, table["1", 1, "greedy"], weights=(None, None), shapes=None, batch=1,
                              rounds_per_step=1, max_len=8, path_len=1, cost_table=None, lock=lock,
                              wake=threading.Condition(lock))
    counting = threading.Lock()
    running, peak = [0], {True: 0, False: 0}

    def fake_compile(program):
        with counting:
            running[0] += 1
            peak[progs._serving] = max(peak[progs._serving], running[0])
        time.sleep(0.5)
        with counting:
            running[0] -= 1
        program.fn = object()

    progs.compile = fake_compile
    with lock:
        progs.serving(True)
    progs.start(3)
    try:
        wait_until(lambda: progs.ready >= 3, timeout=30)
        with lock:
            progs.serving(False)
        wait_until(lambda: progs.ready == 8 and progs._in_flight == 0, timeout=30)
    finally:
        with lock:
            progs._stopping = True
            progs._compile_wake.notify_all()
        progs.join(5)
    assert peak == {True: 1, False: 3}
