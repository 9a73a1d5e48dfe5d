"""``python -m ddtree_jax.serve`` end to end: real servers on loopback (subprocesses, the fixture pair in
float32), called with the official ``openai`` client and with httpx for what the client hides.

Three servers start together (their compilation overlaps the CLI runs of the fixture below):
- ``server``: ddtree under --tree-budget auto (AR steps, the chain or trees of 8 nodes), 4 slots x 128 tokens:
  parity with the reference and with the CLI at a fixed budget of 8, streaming, 32 concurrent clients, bad requests,
  the load test;
- ``small``: ar, 1 slot x 2048 tokens, a queue of 1: long requests to disconnect from, a full queue;
- ``meshed``: ar on a 2x2 mesh of 4 (fake) CPU devices, 2 slots: data + tensor parallel serving.

One more starts alone: ``--target random:tiny`` (random weights, no tokenizer), with the default flags.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from ddtree_jax import generate as gen
from ddtree_jax import loadtest, serve
from ddtree_jax.tokenizer import load_tokenizer
from ddtree_jax.tuning import Tuning
from tests.conftest import fixture_path

TARGET, DRAFT = fixture_path("target"), fixture_path("draft")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "target"  # the served name: the --target directory's name
BUDGET = 8
MAX_LEN = 128
CHAT = "Tell me a story about a fox."
NEW = 24  # max tokens of the CLI comparisons
SAMPLED = {"temperature": 0.8, "seed": 11}
LONG = 2000  # tokens of the small server's long requests
# the meshed server's 4 fake CPU devices, on top of the suite's XLA flags (tests/conftest.py)
FOUR_DEVICES = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    def __init__(self, tmp, name: str, *flags: str, env: dict[str, str] | None = None, target: str = TARGET,
                 dtype: str = "float32"):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "w")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}
        cmd = [sys.executable, "-m", "ddtree_jax.serve", "--target", target, "--dtype", dtype, "--no-disk-cache",
               "--port", str(self.port), "--log-level", "warning", *flags]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-3000:]

    def wait_ready(self, timeout: float = 300.0) -> "Launched":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.3)
        pytest.fail(f"server not ready after {timeout}s:\n{self.tail()}")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict[str, float]:
        return loadtest._scrape(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _run_cli(*argv: str) -> dict:
    """``python -m ddtree_jax.generate ... --json`` in-process; its one JSON object."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = gen.main(["--target", TARGET, "--draft", DRAFT, "--method", "ddtree", "--tree-budget", str(BUDGET),
                         "--dtype", "float32", "--max-new-tokens", str(NEW), "--json", *argv])
    assert code == 0
    return json.loads(buf.getvalue())["results"][0]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    servers = {
        "server": Launched(tmp, "server", "--draft", DRAFT, "--method", "ddtree", "--forms", f"ar,chain,{BUDGET}",
                           "--batch-buckets", "none", "--max-batch", "4", "--max-len", str(MAX_LEN)),
        "small": Launched(tmp, "small", "--method", "ar", "--max-batch", "1", "--max-queue", "1",
                          "--max-len", str(LONG + 48), "--rounds-per-step", "2"),
        "meshed": Launched(tmp, "meshed", "--method", "ar", "--mesh", "2x2", "--max-batch", "2",
                           "--max-len", str(MAX_LEN), env={"XLA_FLAGS": FOUR_DEVICES}),
    }
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def cli_runs(launched):
    """The CLI's outputs for a chat prompt and a raw text prompt of the same length (one compilation),
    greedy and sampled; computed while the servers compile."""
    tok = load_tokenizer(TARGET)
    n = len(tok.encode_chat([{"role": "user", "content": CHAT}]))
    raw = "Once upon a time"
    while len(tok.encode(raw)) < n:
        raw += "."
    assert len(tok.encode(raw)) == n
    runs = {}
    for kind, prompt in (("chat", ["--prompt", CHAT]), ("text", ["--prompt", raw, "--no-chat-template"])):
        for mode, flags in (("greedy", []), ("sampled", ["--temperature", str(SAMPLED["temperature"]),
                                                         "--seed", str(SAMPLED["seed"])])):
            runs[kind, mode] = _run_cli(*prompt, *flags)
    runs["raw"] = raw
    return runs


@pytest.fixture(scope="module")
def server(launched, cli_runs):  # cli_runs first: the CLI compiles while the servers do
    return launched["server"].wait_ready()


@pytest.fixture(scope="module")
def small(launched):
    return launched["small"].wait_ready()


@pytest.fixture(scope="module")
def meshed(launched):
    return launched["meshed"].wait_ready()


def _stream_completion(client, **kw):
    text, ids, finish, usage = "", [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.text
            ids += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
    return text, ids, finish, usage


def _stream_chat(client, **kw):
    text, ids, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            ids += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
    return text, ids, finish


def _ids(choice):
    return choice.model_extra["token_ids"]


# ------------------------------------------------------------------------------------------------ basics
def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_LEN
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and 1 <= health["programs_compiled"] <= 9 and health["programs"] >= 3
    assert 0 <= health["programs_timed"] <= health["programs_compiled"]
    assert 0 <= health["prefills_to_compile"] <= 3 * 2  # the buckets of 64 and 128 tokens, 1, 2 and 4 together
    server.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=8, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("ddtree_requests_total", "ddtree_generated_tokens_total", "ddtree_mean_acceptance_length",
                 "ddtree_tokens_per_second", "ddtree_queue_length", "ddtree_round_latency_seconds_bucket",
                 "ddtree_active_slots", "ddtree_expected_acceptance_length", "ddtree_acceptance_ratio",
                 "ddtree_programs_compiled", "ddtree_programs", "ddtree_step_seconds_total",
                 "ddtree_batch_rounds_total", "ddtree_host_seconds_total", "ddtree_admission_wait_seconds_total",
                 "ddtree_policy_choices_total"):
        assert name in text
    by_form = {k: v for k, v in server.metrics().items() if k.startswith("ddtree_form_sequence_rounds_total")}
    assert by_form and set(by_form) <= {f'ddtree_form_sequence_rounds_total{{form="{f}"}}' for f in ("ar", "chain", "8")}
    by_batch = {k for k, v in server.metrics().items() if k.startswith("ddtree_slot_batch_steps_total") and v > 0}
    assert by_batch and all(k.split('"')[1].isdigit() for k in by_batch), by_batch
    costs = {k: v for k, v in server.metrics().items() if k.startswith("ddtree_program_round_seconds")}
    assert costs and all(v > 0 for v in costs.values())  # the policy's cost table: a round of each timed program
    assert all('form="' in k and 'batch="' in k and 'variant="' in k for k in costs)
    timed = {k for k in server.metrics() if k.startswith("ddtree_program_timed_round_seconds")}
    assert {k.split("{")[1] for k in timed} == {k.split("{")[1] for k in costs}  # and each one's timing
    by_reason = {k: v for k, v in server.metrics().items() if k.startswith("ddtree_reason_sequence_rounds_total")}
    assert sum(by_reason.values()) == sum(by_form.values())  # every round has one reason
    reasons = ("policy", "probe", "timing")
    assert set(by_reason) <= {f'ddtree_reason_sequence_rounds_total{{reason="{r}"}}' for r in reasons}
    gc = server.metrics()  # Python's garbage collector: the server's requests allocated enough for young collections
    assert gc['ddtree_gc_collections_total{generation="0"}'] > 0
    assert gc['ddtree_gc_pause_seconds_total{generation="0"}'] > 0
    assert 'ddtree_gc_pause_seconds_total{generation="2"}' in gc


def test_greedy_completions_equal_the_reference(server, reference_runs):
    client = server.client()
    for run in reference_runs:
        n, m = len(run["prompt"]), run["max_new_tokens"]
        expected = run["ar"][n:]
        res = client.completions.create(model=MODEL, prompt=run["prompt"], max_tokens=m, temperature=0,
                                        extra_body={"return_token_ids": True})
        choice = res.choices[0]
        assert _ids(choice) == expected and choice.finish_reason == "length"
        assert choice.model_extra["prompt_token_ids"] == run["prompt"]
        assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (n, m)
        text, ids, finish, usage = _stream_completion(client, model=MODEL, prompt=run["prompt"], max_tokens=m,
                                                      temperature=0, extra_body={"return_token_ids": True})
        assert (text, ids, finish) == (choice.text, expected, "length")
        assert usage.completion_tokens == m


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_chat_and_text_completions_equal_the_cli(server, cli_runs, mode):
    client = server.client()
    kw = dict(max_tokens=NEW, extra_body={"return_token_ids": True},
              **(SAMPLED if mode == "sampled" else {"temperature": 0}))
    ref = cli_runs["chat", mode]
    messages = [{"role": "user", "content": CHAT}]
    res = client.chat.completions.create(model=MODEL, messages=messages, **kw)
    n = len(res.choices[0].model_extra["prompt_token_ids"])
    assert res.choices[0].message.content == ref["generated_text"]
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].model_extra["prompt_token_ids"] + _ids(res.choices[0]) == ref["output_ids"]
    assert _stream_chat(client, model=MODEL, messages=messages, **kw) == (
        ref["generated_text"], ref["output_ids"][n:], res.choices[0].finish_reason)

    ref = cli_runs["text", mode]
    res = client.completions.create(model=MODEL, prompt=cli_runs["raw"], **kw)
    assert res.choices[0].text == ref["generated_text"]
    assert res.choices[0].model_extra["prompt_token_ids"] + _ids(res.choices[0]) == ref["output_ids"]
    text, ids, finish, _ = _stream_completion(client, model=MODEL, prompt=cli_runs["raw"], **kw)
    assert (text, ids) == (ref["generated_text"], ref["output_ids"][n:])


def test_stop_strings_and_stop_token_ids(server, reference_runs):
    client = server.client()
    run = reference_runs[2]
    n = len(run["prompt"])
    gen_ids = run["ar"][n:]
    res = client.completions.create(model=MODEL, prompt=run["prompt"], max_tokens=30, temperature=0,
                                    extra_body={"stop_token_ids": [gen_ids[4]], "return_token_ids": True})
    assert _ids(res.choices[0]) == gen_ids[: gen_ids.index(gen_ids[4]) + 1]
    assert res.choices[0].finish_reason == "stop"
    full = client.completions.create(model=MODEL, prompt=run["prompt"], max_tokens=30, temperature=0).choices[0].text
    i = next(i for i in range(8, len(full) - 2) if "\ufffd" not in full[i: i + 2] and full[i: i + 2].strip())
    stop = full[i: i + 2]
    for stream in (False, True):
        if stream:
            text, _, finish, _ = _stream_completion(client, model=MODEL, prompt=run["prompt"], max_tokens=30,
                                                    temperature=0, stop=[stop])
        else:
            c = client.completions.create(model=MODEL, prompt=run["prompt"], max_tokens=30, temperature=0,
                                          stop=stop).choices[0]
            text, finish = c.text, c.finish_reason
        assert (text, finish) == (full[: full.index(stop)], "stop")


# ------------------------------------------------------------------------------------------------ load
def test_32_concurrent_clients_all_complete_correctly(server, cli_runs, reference_runs):
    client = server.client()
    requests = []  # (kind, kwargs, expected token ids)
    for i in range(12):  # greedy: the reference
        run = reference_runs[i % 3]
        n = len(run["prompt"])
        m = min(8 + 5 * i, run["max_new_tokens"])
        requests.append(("text", dict(prompt=run["prompt"], max_tokens=m, temperature=0), run["ar"][n: n + m]))
    for i in range(12):  # seeded samples: what the same request gives alone
        run = reference_runs[i % 3]
        kw = dict(prompt=run["prompt"], max_tokens=20 + i, temperature=1.0, top_p=0.9, seed=100 + i)
        alone = client.completions.create(model=MODEL, extra_body={"return_token_ids": True}, **kw)
        requests.append(("text", kw, _ids(alone.choices[0])))
    for i in range(8):  # the CLI's outputs
        kind, mode = ("chat", "text")[i % 2], ("greedy", "sampled")[(i // 2) % 2]
        ref = cli_runs[kind, mode]
        kw = dict(max_tokens=NEW, **(SAMPLED if mode == "sampled" else {"temperature": 0}))
        kw.update({"messages": [{"role": "user", "content": CHAT}]} if kind == "chat" else {"prompt": cli_runs["raw"]})
        requests.append((kind, kw, ref["output_ids"][-NEW:]))
    assert len(requests) == 32
    before = server.metrics()

    def call(i):
        kind, kw, _ = requests[i]
        kw = dict(kw, model=MODEL, extra_body={"return_token_ids": True})
        stream = i % 3 == 0
        if kind == "chat":
            if stream:
                return _stream_chat(client, **kw)[1]
            return _ids(client.chat.completions.create(**kw).choices[0])
        if stream:
            return _stream_completion(client, **kw)[1]
        return _ids(client.completions.create(**kw).choices[0])

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(call, range(32)))
    for (kind, kw, expected), got in zip(requests, results):
        assert got == expected, (kind, kw)
    after = server.metrics()
    finished = sum(v for k, v in after.items() if k.startswith("ddtree_requests_total")) - sum(
        v for k, v in before.items() if k.startswith("ddtree_requests_total"))
    assert finished == 32
    assert after["ddtree_active_slots"] == 0 and after["ddtree_queue_length"] == 0
    assert after["ddtree_generated_tokens_total"] - before["ddtree_generated_tokens_total"] == sum(
        len(e) for _, _, e in requests)


def test_load_benchmark_runs(server):
    results = loadtest.run_load(server.url, model=MODEL, concurrency=[1, 4], requests=4, prompt_len=8,
                                max_tokens=6, vocab=(0, 250), warmup=0)
    assert [r["concurrency"] for r in results] == [1, 4]
    for r in results:
        assert r["errors"] == 0 and r["output_tokens"] == 24
        assert r["latency_s"]["p50"] > 0 and r["ttft_s"]["p99"] is not None and r["mean_acceptance_length"] >= 1
        # the engine's own time per token (its rounds' wall time over the acceptance; not comparable with the
        # client's TPOT over 6 tokens, whose first step's tokens arrive with the first); the device steps fill part
        # of the level's time
        assert 0 < r["engine_tpot_s"] < r["latency_s"]["p50"] and 0 < r["device_busy"] <= 1.05
        # ... and the engine thread's own work between device calls part of it
        assert 0 < r["host_busy"] <= 1.05
        # ... and the step thread's waits for the joiners' prefills and inserts before the steps (device work too)
        assert 0 < r["admission_busy"] <= 1.05
        # ... and Python's garbage collector's pauses, every thread stopped (the load's allocations run some)
        assert 0 <= r["gc_busy"] < 1 and r["gc_full"] >= 0
        # the policy's costs at the slot batches the level stepped (the server's programs are timed before use)
        assert r["round_ms"] and {int(k.split("@")[1].split("/")[0]) for k in r["round_ms"]} <= set(
            r["slot_batch_steps"]) and all(v > 0 for v in r["round_ms"].values())
        assert set(r["timed_ms"]) == set(r["round_ms"])  # each program's timing beside the refined cost
        # what the policy expected of each form it weighed, per sequence and round: exactly 1 for an AR step
        assert r["expected_tokens"]["ar"] == 1.0 and all(v >= 1.0 for v in r["expected_tokens"].values())
    assert loadtest.format_table(results).count("\n") == 3


# ------------------------------------------------------------------------------------------------ errors
BAD = [
    ({"model": "gpt-4", "prompt": "hi"}, "model"),
    ({"prompt": [1] * (MAX_LEN + 5)}, "prompt"),
    ({"prompt": [1] * 100, "max_tokens": 40}, "max_tokens"),
    ({"prompt": "hi", "temperature": 2.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "logprobs": 2}, "logprobs"),
    ({"prompt": "hi", "stop": ["a"] * 17}, "stop"),
    ({"prompt": "hi", "stop_token_ids": [999]}, "stop_token_ids"),
    ({"prompt": [1, 2, 256]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_completion_requests_get_400(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body} if "model" not in body else body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_requests_through_the_client_and_malformed_json(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt="hi")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 200}], max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_p=1.5)
    for path in ("/v1/completions", "/v1/chat/completions"):
        for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
            r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", (path, raw, r.text)
    r = httpx.get(f"{server.url}/v1/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{server.url}/v1/completions").status_code == 405
    # the server is unharmed
    res = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 3


# ------------------------------------------------------------------------------------------------ slots
def _long_stream(small, **extra):
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}
    return httpx.stream("POST", f"{small.url}/v1/completions", json=body, timeout=60)


def _wait_for(small, predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = small.metrics()
        if predicate(m):
            return m
        time.sleep(0.02)
    pytest.fail(f"metrics never satisfied the condition: {small.metrics()}")


def _cancelled(m):
    return m.get('ddtree_requests_total{finish_reason="cancelled"}', 0)


def test_disconnect_mid_stream_frees_the_slot(small):
    before = small.metrics()
    with _long_stream(small) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert got and json.loads(got[0][6:])["choices"][0]["finish_reason"] is None
    # the client is gone: the request is cancelled and its slot freed long before 2000 tokens
    m = _wait_for(small, lambda m: _cancelled(m) == _cancelled(before) + 1 and m["ddtree_active_slots"] == 0)
    assert m["ddtree_generated_tokens_total"] - before["ddtree_generated_tokens_total"] < LONG
    res = small.client().completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, temperature=0)
    assert res.usage.completion_tokens == 5


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_slot(small):
    before = small.metrics()
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{small.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    m = _wait_for(small, lambda m: _cancelled(m) == _cancelled(before) + 1 and m["ddtree_active_slots"] == 0)
    assert m["ddtree_generated_tokens_total"] - before["ddtree_generated_tokens_total"] < LONG


def test_full_queue_gets_429_and_nothing_is_lost(small, reference_runs):
    client = small.client()
    run = reference_runs[0]
    n = len(run["prompt"])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _long_stream(small) as r:  # occupies the only slot
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            queued = pool.submit(lambda: client.completions.create(
                model=MODEL, prompt=run["prompt"], max_tokens=10, temperature=0, extra_body={"return_token_ids": True}))
            _wait_for(small, lambda m: m["ddtree_queue_length"] == 1)
            with pytest.raises(openai.RateLimitError) as e:  # the slot is busy and the queue (1) is full
                client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        # the long stream is closed: the queued request gets the slot and completes
        res = queued.result(timeout=60)
    assert _ids(res.choices[0]) == run["ar"][n: n + 10]
    m = small.metrics()
    assert m['ddtree_requests_rejected_total{reason="queue_full"}'] == 1
    assert m["ddtree_active_slots"] == 0 and m["ddtree_queue_length"] == 0


def test_mesh_2x2_serves_the_same_tokens(meshed, small, reference_runs):
    """Data + tensor parallel (4 fake devices): greedy equals the reference with more requests than slots,
    and a seeded sample equals the single-device server's."""
    client = meshed.client()

    def call(run):
        n = len(run["prompt"])
        res = client.completions.create(model=MODEL, prompt=run["prompt"], max_tokens=20, temperature=0,
                                        extra_body={"return_token_ids": True})
        return _ids(res.choices[0]) == run["ar"][n: n + 20]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert all(pool.map(call, reference_runs))
    kw = dict(model=MODEL, prompt=reference_runs[1]["prompt"], max_tokens=16, temperature=1.0, seed=5,
              extra_body={"return_token_ids": True})
    assert _ids(client.completions.create(**kw).choices[0]) == _ids(small.client().completions.create(**kw).choices[0])


def test_sigint_stops_the_server(small):
    assert small.stop() == 0
    assert "Traceback" not in small.log_path.read_text()


# ------------------------------------------------------------------------------------------------ CLI
def _one_line_error(capsys, argv, *fragments):
    code = serve.main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    for f in fragments:
        assert f in errors[0], errors[0]


def test_cli_bad_flags_are_one_line_errors(capsys, tmp_path):
    _one_line_error(capsys, ["--target", TARGET, "--method", "ddtree"], "needs a drafter")
    _one_line_error(capsys, ["--target", str(tmp_path / "missing")], "no such directory")
    _one_line_error(capsys, ["--target", TARGET, "--mesh", "2y3"], "mesh")
    _one_line_error(capsys, ["--target", TARGET, "--mesh", "2x1"], "needs 2 devices")
    _one_line_error(capsys, ["--target", TARGET, "--mesh", "2x1", "--max-batch", "3"], "multiple of the mesh")
    _one_line_error(capsys, ["--target", TARGET, "--max-len", "9999"], "max_position_embeddings")
    _one_line_error(capsys, ["--target", TARGET, "--max-batch", "0"], "--max-batch")
    _one_line_error(capsys, ["--target", TARGET, "--port", "70000"], "port")
    _one_line_error(capsys, ["--draft", DRAFT], "--target")
    _one_line_error(capsys, ["--target", "random:qwen9"], "unknown random shape 'qwen9'", "random:qwen3-8b")
    _one_line_error(capsys, ["--target", "random:tiny", "--draft", DRAFT], "drafter is random")
    _one_line_error(capsys, ["--target", TARGET, "--max-batch", "4", "--batch-buckets", "2,4"], "--batch-buckets")
    _one_line_error(capsys, ["--target", TARGET, "--batch-buckets", "0"], "--batch-buckets")
    _one_line_error(capsys, ["--target", TARGET, "--draft", DRAFT, "--method", "dflash", "--forms", "ar,16"],
                    "--forms", "dflash takes the forms ar and chain")
    _one_line_error(capsys, ["--target", TARGET, "--tree-budget", "many"], "--tree-budget")
    _one_line_error(capsys, ["--target", TARGET, "--forms", "ar,tree"], "--forms", "unknown form 'tree'")
    _one_line_error(capsys, ["--target", TARGET, "--step-log", str(tmp_path / "no" / "steps.jsonl")], "--step-log",
                    "no such directory")


def test_cli_help_explains_every_flag(capsys):
    assert serve.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--draft", "--method", "--tree-budget", "--mesh", "--max-batch", "--max-len",
                 "--host", "--port", "--dtype", "--attention", "--max-queue", "--rounds-per-step",
                 "--served-model-name", "--log-level", "--warmup-all", "--batch-buckets", "--forms", "--no-disk-cache",
                 "--step-log"):
        assert re.search(rf"^\s+{flag}\b.*\n?.*\w", out, re.M), flag
    assert "random:SHAPE" in out and "qwen3-8b" in out
    assert serve.parse_mesh("2x4") == (2, 4)


# ------------------------------------------------------------------------------------------------ random weights
def test_random_target_plan_needs_no_files():
    p = serve.plan(serve.build_parser().parse_args(["--target", "random:tiny", "--method", "dflash"]))
    assert (p.random_shape, p.target_path, p.draft_path, p.tokenizer) == ("tiny", None, None, None)
    assert p.model_name == "random:tiny" and p.engine_config.method == "dflash"
    p = serve.plan(serve.build_parser().parse_args(["--target", "random:tiny", "--batch-buckets", "4,1,4",
                                                    "--tuning", "layout=stacked,decode_attention=0",
                                                    "--compile-threads", "2", "--step-log", "steps.jsonl"]))
    assert p.engine_config.batch_buckets == (1, 4) and p.engine_config.compile_threads == 2
    assert p.engine_config.step_log == "steps.jsonl"
    assert p.engine_config.tuning == Tuning(layout="stacked", decode_attention=False)
    assert serve.plan(serve.build_parser().parse_args(["--target", "random:tiny"])).engine_config.method == "ddtree"


def test_random_tiny_server_takes_token_ids_and_refuses_text(tmp_path):
    """--target random:tiny: random bf16 weights (target and drafter) built in the server, no tokenizer; ddtree under
    --tree-budget auto with its default forms and slot batches."""
    s = Launched(tmp_path, "random", "--max-batch", "2", "--max-len", "128", target="random:tiny", dtype="bfloat16")
    try:
        s.wait_ready(120)
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "random:tiny", "prompt": [5, 6, 7], "max_tokens": 6,
                                                        "temperature": 0, "return_token_ids": True}, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == 6 and all(0 <= t < 2048 for t in choice["token_ids"])
        assert choice["text"] == "".join(f"{t} " for t in choice["token_ids"])  # no tokenizer: the ids as text
        for path, body in (("completions", {"prompt": "hello"}),
                           ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = httpx.post(f"{s.url}/v1/{path}", json=body, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "no_tokenizer"
            assert "random model (random:tiny) has no tokenizer" in err["message"]
    finally:
        assert s.stop() == 0
