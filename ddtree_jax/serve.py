"""``python -m ddtree_jax.serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

Endpoints (the convention of vLLM and SGLang, callable with the official ``openai`` client):

    POST /v1/completions        prompt as text, token ids, or a list of either (one choice each)
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models             the one served model
    GET  /health                200 when ready, 503 while compiling or after a failure
    GET  /metrics               Prometheus text (see metrics.Metrics)

``stream: true`` answers with server-sent events, ``data: {json}\\n\\n`` per chunk and ``data: [DONE]``
at the end. Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): 400 for a bad
request (unknown model, prompt too long, parameter out of range, malformed JSON), 429 when the queue is
full, 503 while the engine is starting or after it failed. Every accepted request either completes or
gets an error; a client that disconnects cancels its request and frees its slot.

Pipeline: parse and range-check the flags -> read the configs and the tokenizer -> load the weights ->
build the engine -> start uvicorn; the engine compiles in the background (``/health`` is 503 until then).
``--target random:SHAPE`` (a shape of ``ddtree_jax.shapes.SHAPES``) skips the files: the target and its DFlash
drafter get random weights made on the device (``shapes.model_configs`` / ``shapes.build_params``), for load
tests at real shapes; with no tokenizer, only token-id prompts are served.
HTTP is starlette + uvicorn, server-sent events are sse-starlette, metrics are prometheus_client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from typing import Any, Sequence

from ddtree_jax import cli, config, decode, shapes
from ddtree_jax import engine as engines
from ddtree_jax.tokenizer import Tokenizer, TokenizerError, load_tokenizer

log = logging.getLogger("ddtree_jax.serve")

MAX_STOP_STRINGS = 16
NO_TOKENIZER_JSON = "the model directory has no tokenizer.json"
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

_EPILOG = """\
request fields beyond OpenAI's (vLLM's spelling; with the openai client pass them in extra_body):
  top_k (int, 0 or -1 = off), stop_token_ids (list of ints, kept in the output like eos), ignore_eos
  (bool), return_token_ids (bool: each choice gets "token_ids" and "prompt_token_ids"),
  chat_template_kwargs (dict of extra chat-template variables, chat only).
unsupported (400 if set to a non-default value): n > 1, best_of > 1, logprobs, echo, suffix,
  presence/frequency penalties, logit_bias, tools, response_format other than text.
defaults: temperature 1, top_p 1; max_tokens 16 for /v1/completions (as OpenAI's), the rest of --max-len
  for /v1/chat/completions. Without a seed a request samples with a random one; with a seed the output is
  the same whatever else is being decoded (and equals `python -m ddtree_jax.generate` with that --seed).
  A model directory without tokenizer.json takes token-id prompts only and answers with the ids as text.

random weights (load tests at real shapes, nothing to download): --target random:SHAPE, SHAPE one of
  {shapes}.
  The target and its DFlash drafter (that shape's, e.g. 5 layers and block 16 for the Qwen3 shapes) get
  random weights (--dtype, bfloat16 by default) made directly on the device; --draft is not taken. There
  is no tokenizer: /v1/completions takes token-id prompts only; text prompts and /v1/chat/completions get
  400. The drafter never agrees with random weights, so dflash/ddtree accept about one token per round
  (--tree-budget auto then runs AR steps, probing speculation now and then): the speeds and latencies are
  real, the acceptance is not.

--tree-budget auto (the default of dflash and ddtree): every step takes the (form, slot batch) with the most
  expected tokens per second; each program (form x slot batch x greedy / sampling / top-k-top-p) compiles in a
  background thread after start-up (the full batch's AR step first: /health turns 200 once it and the shortest
  prefill are compiled; /health's programs_compiled counts the rest) and is timed once on free slots. /metrics:
  ddtree_form_sequence_rounds_total{form=...} (rounds by form), ddtree_expected_acceptance_length and
  ddtree_acceptance_ratio (the policy's estimates), ddtree_programs_compiled.

examples:
  python -m ddtree_jax.serve --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --method ddtree \\
      --max-batch 16 --max-len 4096 --port 8000
  curl localhost:8000/v1/completions -d '{"model": "Qwen3-8B", "prompt": "Hello", "max_tokens": 32}'
  python -m ddtree_jax.loadtest --url http://127.0.0.1:8000 --concurrency 1,2,4,8,16,32
  python -m ddtree_jax.serve --target random:qwen3-8b --method ddtree --max-batch 32
  python benchmarks/load_bench.py OUT_DIR        # ar, dflash, ddtree servers in turn, each load-tested

Bad flags: one 'error: ...' line on stderr and exit status 2. DDTREE_JAX_DEBUG=1 shows tracebacks.
"""


# ---------------------------------------------------------------------------------------------- errors
class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _from_engine(e: Exception) -> ApiError:
    if isinstance(e, engines.RequestError):
        return bad_request(str(e), e.param, e.code)
    if isinstance(e, engines.QueueFull):
        return ApiError(429, str(e), type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(e, engines.EngineClosed):
        return ApiError(503, str(e), type="server_error", code="unavailable", headers={"Retry-After": "5"})
    raise e


# ---------------------------------------------------------------------------------------------- fields
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad_request(f"'{name}' must be an integer, got {json.dumps(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {rng}, got {v}", name)
    return v


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or v != v:
        raise bad_request(f"'{name}' must be a number, got {json.dumps(v)}", name)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad_request(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def _unsupported(body: dict, name: str, default: Any = None, what: str | None = None) -> None:
    v = body.get(name)
    if v is None or v == default or (isinstance(v, (dict, list)) and not v and not default):
        return
    raise bad_request(f"'{name}' {what or 'is not supported by this server'}", name)


@dataclasses.dataclass
class Options:
    """The request fields both endpoints share, checked."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool

    def params(self, max_tokens: int) -> engines.SamplingParams:
        return engines.SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                      top_k=self.top_k, seed=self.seed, stop=self.stop,
                                      stop_token_ids=self.stop_token_ids)


def parse_options(body: dict, *, chat: bool) -> Options:
    for name in ("n", "best_of"):
        if _int(body, name, 1) != 1:
            raise bad_request(f"'{name}' must be 1: one choice per prompt is supported", name)
    _unsupported(body, "logprobs", False if chat else None, "(log probabilities) is not supported")
    _unsupported(body, "top_logprobs", None, "(log probabilities) is not supported")
    _unsupported(body, "echo", False)
    _unsupported(body, "suffix", None)
    _unsupported(body, "logit_bias", None)
    _unsupported(body, "tools", None)
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, 0.0, -2.0, 2.0)
        _unsupported(body, name, 0, "must be 0: penalties are not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise bad_request("only response_format {\"type\": \"text\"} is supported", "response_format")

    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or any(not _is_int(t) for t in stop_ids):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    top_k = _int(body, "top_k", 0, -1)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if so and not stream:
        raise bad_request("'stream_options' is only allowed with stream: true", "stream_options")
    return Options(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),
        seed=_int(body, "seed", None, 0, engines.SEED_LIMIT - 1),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos"),
        stream=stream,
        include_usage=bool(so and _bool(so, "include_usage")),
        return_token_ids=_bool(body, "return_token_ids"),
    )


# ---------------------------------------------------------------------------------------------- server
class Server:
    """The endpoints over one engine. ``model_name`` is what /v1/models lists and requests must name."""

    def __init__(self, engine: engines.Engine, model_name: str, tokenizer: Tokenizer | None,
                 no_tokenizer: str = NO_TOKENIZER_JSON):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.no_tokenizer = no_tokenizer  # why there is none, for the 400 of a request that needs one
        self.created = int(time.time())

    # ------------------------------------------------------------------ request parsing
    async def _body(self, request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(400, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        return body

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise bad_request(f"{what} needs a tokenizer, and {self.no_tokenizer}; "
                              "send the prompt as a list of token ids to /v1/completions", "prompt",
                              "no_tokenizer")
        return self.tokenizer

    def _completion_prompts(self, body: dict) -> list[list[int]]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            items: list = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            items = prompt
        else:
            raise bad_request("'prompt' must be a string, a list of token ids, or a non-empty list of either",
                              "prompt")
        out = []
        for p in items:
            if isinstance(p, str):
                out.append(self._need_tokenizer("a text prompt").encode(p))
            elif p and all(_is_int(t) and t >= 0 for t in p):
                out.append(list(p))
            else:
                raise bad_request("a token-id prompt must be a non-empty list of integers >= 0", "prompt")
        return out

    def _chat_prompt(self, body: dict) -> list[int]:
        tok = self._need_tokenizer("/v1/chat/completions")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", "messages")
        clean = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request("every message must be an object with a string 'role'", "messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text
                if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                       for p in content):
                    raise bad_request("only text content parts are supported", "messages")
                content = "".join(p["text"] for p in content)
            elif content is not None and not isinstance(content, str):
                raise bad_request("message 'content' must be a string or a list of text parts", "messages")
            clean.append({**m, "content": content if content is not None else ""})
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        add_gen = _bool(body, "add_generation_prompt", True)
        if not tok.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            return tok.encode_chat(clean, add_generation_prompt=add_gen, **kwargs)
        except TokenizerError as e:
            raise bad_request(str(e), "messages") from None

    def _submit(self, prompts: list[list[int]], opts: Options, *, chat: bool, rid: str, queue: asyncio.Queue):
        loop = asyncio.get_running_loop()
        max_len = self.engine.config.max_len
        jobs: list[engines.Job] = []
        try:
            for i, ids in enumerate(prompts):
                room = max_len - len(ids)
                default = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
                max_tokens = opts.max_tokens if opts.max_tokens is not None else max(default, 1)

                def sink(ev, i=i):
                    loop.call_soon_threadsafe(queue.put_nowait, (i, ev))

                jobs.append(self.engine.submit(ids, opts.params(max_tokens), sink, ignore_eos=opts.ignore_eos,
                                               request_id=f"{rid}-{i}"))
        except (engines.RequestError, engines.QueueFull, engines.EngineClosed) as e:
            for job in jobs:
                self.engine.cancel(job)
            if isinstance(e, engines.RequestError) and len(prompts) > 1:
                e = engines.RequestError(f"prompt {len(jobs)}: {e}", e.param, e.code)
            raise _from_engine(e) from None
        return jobs

    # ------------------------------------------------------------------ endpoints
    async def completions(self, request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request):
        return await self._generate(request, chat=True)

    async def _generate(self, request, *, chat: bool):
        from starlette.responses import JSONResponse

        body = await self._body(request)
        opts = parse_options(body, chat=chat)
        prompts = [self._chat_prompt(body)] if chat else self._completion_prompts(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        jobs = self._submit(prompts, opts, chat=chat, rid=rid, queue=queue)
        created = int(time.time())
        if opts.stream:
            from sse_starlette import EventSourceResponse

            return EventSourceResponse(self._stream(jobs, prompts, opts, queue, rid, created, chat), sep="\n")

        results = [_Collected() for _ in jobs]
        pending = len(jobs)
        checked = time.monotonic()
        try:
            while pending:
                with contextlib.suppress(TimeoutError):
                    i, ev = await asyncio.wait_for(queue.get(), timeout=0.25)
                    results[i].add(ev)
                    pending -= ev.finish_reason is not None
                if pending and time.monotonic() - checked >= 0.25:  # a client that left cancels its request
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return JSONResponse({}, status_code=499)  # nobody reads it; the finally cancels
        finally:
            for job, r in zip(jobs, results):
                if r.finish_reason is None:
                    self.engine.cancel(job)
        failed = [r for r in results if r.finish_reason == "error"]
        if failed:
            raise ApiError(503, failed[0].error or "the engine failed", type="server_error", code="engine_error")
        choices = []
        for i, (ids, r) in enumerate(zip(prompts, results)):
            c: dict[str, Any] = {"index": i}
            if chat:
                c["message"] = {"role": "assistant", "content": r.text}
            else:
                c["text"] = r.text
            c["logprobs"] = None
            c["finish_reason"] = r.finish_reason
            if opts.return_token_ids:
                c["token_ids"], c["prompt_token_ids"] = r.tokens, ids
            choices.append(c)
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": self.model_name, "choices": choices, "usage": _usage(prompts, results)}
        return JSONResponse(out)

    async def _stream(self, jobs, prompts, opts: Options, queue: asyncio.Queue, rid: str, created: int, chat: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"
        results = [_Collected() for _ in jobs]

        def chunk(i: int, text: str | None, finish: str | None, token_ids=None, role: bool = False) -> str:
            c: dict[str, Any] = {"index": i}
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                c["delta"] = delta
            else:
                c["text"] = text or ""
            c["logprobs"] = None
            c["finish_reason"] = finish
            if opts.return_token_ids and token_ids is not None:
                c["token_ids"] = list(token_ids)
                if role or (not chat and results[i].first):
                    c["prompt_token_ids"] = prompts[i]
            out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                                   "choices": [c]}
            if opts.include_usage:
                out["usage"] = None
            return json.dumps(out)

        pending = len(jobs)
        try:
            if chat:
                for i in range(len(jobs)):
                    yield chunk(i, None, None, [] if opts.return_token_ids else None, role=True)
            while pending:
                i, ev = await queue.get()
                r = results[i]
                if ev.finish_reason == "error":
                    r.add(ev)
                    err = ApiError(503, ev.error or "the engine failed", type="server_error", code="engine_error")
                    yield json.dumps(err.body())
                    break
                if ev.text or ev.finish_reason or (opts.return_token_ids and ev.token_ids):
                    yield chunk(i, ev.text, ev.finish_reason, ev.token_ids)
                r.add(ev)
                r.first = False
                pending -= ev.finish_reason is not None
            else:
                if opts.include_usage:
                    yield json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                      "choices": [], "usage": _usage(prompts, results)})
            yield "[DONE]"
        finally:  # also on a client disconnect: sse-starlette cancels this generator
            for job, r in zip(jobs, results):
                if r.finish_reason is None:
                    self.engine.cancel(job)

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "ddtree_jax",
            "max_model_len": self.engine.config.max_len, "method": self.engine.config.method}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        e = self.engine
        if e.failure:
            return JSONResponse({"status": "failed", "error": e.failure}, status_code=503)
        if not e.alive:
            return JSONResponse({"status": "starting" if not e.ready else "stopped"}, status_code=503)
        return JSONResponse({"status": "ok", "active_slots": e.active_slots, "queue_length": e.queue_length,
                             "programs_compiled": e.programs_ready, "programs": e.programs_wanted})

    async def metrics(self, request):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        from starlette.responses import Response

        return Response(generate_latest(self.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@dataclasses.dataclass
class _Collected:
    tokens: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    first: bool = True

    def add(self, ev: engines.Event) -> None:
        self.tokens.extend(ev.token_ids)
        self.text += ev.text
        if ev.finish_reason is not None:
            self.finish_reason, self.error = ev.finish_reason, ev.error


def _usage(prompts: list[list[int]], results: list[_Collected]) -> dict[str, int]:
    p = sum(len(ids) for ids in prompts)
    c = sum(len(r.tokens) for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def build_app(engine: engines.Engine, *, model_name: str, tokenizer: Tokenizer | None, start_engine: bool = True,
              warmup_all: bool = False, no_tokenizer: str = NO_TOKENIZER_JSON):
    """The starlette app. With ``start_engine`` the app's lifespan warms up (every prompt bucket with
    ``warmup_all``) and starts the engine in the background (``/health`` is 503 until it is ready) and stops
    it on shutdown. ``no_tokenizer`` says why ``tokenizer`` is None in the 400 of a text prompt."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    server = Server(engine, model_name, tokenizer, no_tokenizer)

    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)

    async def internal_error(request, exc: Exception):
        log.exception("internal error")
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine and not engine.alive:
            threading.Thread(target=_start_or_exit, args=(engine, warmup_all), name="ddtree-warmup",
                             daemon=True).start()
        try:
            yield
        finally:
            if start_engine:
                await asyncio.to_thread(engine.stop)

    app = Starlette(
        routes=[
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.server = server
    return app


def _start_or_exit(engine: engines.Engine, warmup_all: bool = False) -> None:
    t0 = time.perf_counter()
    try:
        engine.warmup(engine.layout.buckets() if warmup_all else None)
        engine.start(warmup=False)
    except BaseException as e:  # noqa: BLE001 - a server that cannot compile must not look alive
        engine.failure = f"engine failed to start: {type(e).__name__}: {e}"
        log.exception("engine failed to start")
        cli.error(engine.failure, cli.EXIT_INTERNAL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    cli.info(f"engine ready in {time.perf_counter() - t0:.1f}s (compiled)")


# ---------------------------------------------------------------------------------------------- CLI
def _buckets(text: str) -> tuple[int, ...]:
    """--batch-buckets: a list of slot batches, or 'none' (argparse type)."""
    return () if text.strip().lower() == "none" else tuple(cli.int_list(text))


def parse_mesh(text: str) -> tuple[int, int]:
    """'DxM' -> (data, model) axis sizes (argparse type)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a mesh shape DxM (data x model), e.g. 1x1 or 2x4")
    return int(m.group(1)), int(m.group(2))


def build_parser() -> cli.ArgumentParser:
    shape_names = ", ".join(shapes.SHAPES)
    p = cli.ArgumentParser(
        prog="python -m ddtree_jax.serve",
        description="Serve a Qwen3 / Llama target over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, streaming, /v1/models, /health, /metrics), with continuous "
                    "batching of requests into a fixed number of slots that decode together on device, "
                    "plainly (ar) or with lossless speculative decoding (dflash, ddtree).",
        epilog=_EPILOG.replace("{shapes}", shape_names),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("models")
    m.add_argument("--target", metavar="PATH", required=True,
                   help="target model: a Hugging Face directory (config.json + *.safetensors, tokenizer.json) "
                        "or a checkpoint converted with convert/; or random:SHAPE (SHAPE one of "
                        f"{shape_names}): random weights of that shape and of its DFlash drafter, made on the "
                        "device, no tokenizer (token-id prompts only; see below)")
    m.add_argument("--draft", metavar="PATH",
                   help="DFlash drafter directory (z-lab layout); required by --method dflash and ddtree, "
                        "except with --target random:SHAPE (whose drafter is random too)")
    m.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the --target directory's "
                        "name, or random:SHAPE); any other model id is answered with 400")
    m.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16",
                   help="weights and activations dtype (default: bfloat16, with float32 accumulation and "
                        "softmax); float32 reproduces the reference fixtures exactly")

    g = p.add_argument_group("decoding")
    g.add_argument("--method", choices=decode.METHODS, default=None,
                   help="ar: plain autoregressive; dflash: DFlash chain speculation; ddtree: DDTree draft tree "
                        "of --tree-budget nodes (default: ddtree with --draft or a random target, ar otherwise)")
    g.add_argument("--tree-budget", type=cli.tree_budget, default=None, metavar="N|auto", help=cli.TREE_BUDGET_HELP)
    g.add_argument("--forms", type=cli.form_list, default=None, metavar="LIST", help=cli.FORMS_HELP)
    g.add_argument("--attention", choices=cli.ATTENTIONS, default="auto", help=cli.ATTENTION_HELP)
    cli.add_tuning(g)
    g.add_argument("--mesh", type=parse_mesh, default=(1, 1), metavar="DxM",
                   help="device mesh, data x model: the slots are split over D devices (data parallel), heads, "
                        "MLP and vocabulary over M (tensor parallel); D*M must equal the visible devices "
                        "(restrict them with CUDA_VISIBLE_DEVICES). Default: 1x1, one device")

    b = p.add_argument_group("batching")
    b.add_argument("--max-batch", type=cli.positive_int, default=8, metavar="B",
                   help="slots: sequences decoded together in one device call; requests beyond wait in the "
                        "queue and join as slots free up (default: 8)")
    b.add_argument("--max-len", type=cli.positive_int, default=None, metavar="L",
                   help="tokens per sequence, prompt + generated: sizes every slot's KV cache; longer requests "
                        "get 400 (default: the smaller of 4096 and what max_position_embeddings allows)")
    b.add_argument("--max-queue", type=cli.nonneg_int, default=256, metavar="N",
                   help="requests that may wait for a slot; more get 429 (default: 256)")
    b.add_argument("--rounds-per-step", type=cli.positive_int, default=4, metavar="K",
                   help="rounds per device call between host visits: new tokens stream, requests join and "
                        "finished slots free every K rounds (default: 4)")
    b.add_argument("--batch-buckets", type=_buckets, default=None, metavar="N,N,...|none",
                   help="smaller slot batches besides --max-batch, e.g. 1,4,16, or none: a step runs on one that "
                        "holds the live requests (their rows gathered out of the slots), so few requests do not pay "
                        "for a full batch (a verify runs slots x (nodes + 1) rows); under --tree-budget auto the "
                        "cheapest for the chosen form. Each size's programs compile in the background after "
                        "start-up; not with a data axis in --mesh (default: the powers of two below --max-batch)")
    b.add_argument("--no-disk-cache", action="store_true",
                   help="keep nothing on disk: no persistent compilation cache (by default compiled programs are kept "
                        "in $DDTREE_JAX_CACHE/jit, unless JAX_COMPILATION_CACHE_DIR names another, so a second start "
                        "compiles little) and no cost table ($DDTREE_JAX_CACHE/costs.json: each program's seconds "
                        "per round, which --tree-budget auto weighs; then timed anew at every start)")
    b.add_argument("--warmup-all", action="store_true",
                   help="compile the prefill of every prompt-length bucket (64, 128, 256, ... up to --max-len) "
                        "before /health turns 200; by default only the shortest is, and a longer bucket "
                        "compiles on its first prompt, pausing the batch once")

    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    h.add_argument("--port", type=cli.nonneg_int, default=8000, help="port (default: 8000; 0 = any free port)")
    h.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                   help="server log level (default: info; 'warning' hides the access log)")
    return p


@dataclasses.dataclass
class Plan:
    target_path: str | None  # None for a random target
    draft_path: str | None
    dtype: str
    model_name: str
    engine_config: engines.EngineConfig
    mesh: tuple[int, int]
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    host: str
    port: int
    log_level: str
    warmup_all: bool = False
    random_shape: str | None = None  # --target random:SHAPE
    disk_cache: bool = True  # the persistent compilation cache and the cost table (--no-disk-cache: neither)


def plan(args: argparse.Namespace) -> Plan:
    """Check every flag and read configs/tokenizer before any weight is loaded."""
    shape = shapes.random_shape(args.target)
    method = args.method or ("ddtree" if args.draft or shape else "ar")
    if shape is not None and args.draft is not None:
        raise cli.UsageError(f"--draft cannot be combined with --target {args.target}: its drafter is random "
                             f"too (drop --draft)")
    if method != "ar" and args.draft is None and shape is None:
        raise cli.UsageError(f"--method {method} needs a drafter: pass --draft PATH")
    if method == "ar" and args.draft is not None:
        cli.warn("--draft is ignored with --method ar")
    budget = args.tree_budget if args.tree_budget is not None else decode.DEFAULT_TREE_BUDGET
    if args.tree_budget is not None and method == "ar":
        cli.warn(f"--tree-budget {args.tree_budget} is ignored with --method ar")
    if args.forms is not None and (budget != decode.AUTO or method == "ar"):
        cli.warn("--forms is ignored without --tree-budget auto and a drafter")
    if args.port > 65535:
        raise cli.UsageError(f"--port {args.port} is not a port number (0..65535)")
    target_path = draft_path = dcfg = None
    if shape is not None:
        tcfg, dcfg = shapes.model_configs(shapes.SHAPES[shape])
        dcfg = dcfg if method != "ar" else None
    else:
        target_path = cli.existing_dir("--target", args.target)
        draft_path = cli.existing_dir("--draft", args.draft) if method != "ar" else None
        tcfg = config.model_config(target_path)
        if draft_path is not None:
            dcfg = config.draft_config(draft_path)
    if dcfg is not None:
        config.check_pair(tcfg, dcfg)
    buckets = None if args.batch_buckets is None else tuple(sorted(set(args.batch_buckets)))
    try:  # the engine's own rules, checked before any weight is loaded
        engines.check_batch_buckets(buckets or (), args.max_batch, args.mesh[0])
    except ValueError as e:
        raise cli.UsageError(f"--batch-buckets: {e}") from None
    options = decode.GenerateOptions(method=method, tree_budget=budget, forms=args.forms or ())
    smallest = min((buckets if buckets is not None else engines.default_buckets(args.max_batch, args.mesh[0]))
                   + (args.max_batch,))
    try:  # the verify block of the largest form the engine may run (as the engine computes it)
        block = decode.make_spec(tcfg, dcfg if method != "ar" else None, options, args.tuning,
                                 batch=smallest).round_positions
    except ValueError as e:  # --forms that the method or the slot batches cannot take
        raise cli.UsageError(f"--forms: {e}") from None
    allowed = tcfg.max_position_embeddings - block
    max_len = args.max_len if args.max_len is not None else min(4096, allowed)
    if max_len < 2:
        raise cli.UsageError(f"--max-len must be at least 2 (a prompt token and a new one), got {max_len}")
    if max_len > allowed:
        raise cli.UsageError(f"--max-len {max_len} + the verify block {block} exceeds the model's "
                             f"max_position_embeddings={tcfg.max_position_embeddings}; use --max-len {allowed} "
                             f"or less")
    _check_mesh(args.mesh, args.max_batch, tcfg, dcfg)
    tok = load_tokenizer(target_path) if target_path is not None else None
    eos = tuple(dict.fromkeys((tok.eos_token_ids if tok else ()) + tcfg.eos_token_ids))
    if len(eos) > decode.MAX_STOP_IDS:
        cli.warn(f"the model has {len(eos)} eos ids; only the first {decode.MAX_STOP_IDS} stop generation")
        eos = eos[: decode.MAX_STOP_IDS]
    name = args.served_model_name or (args.target if shape else os.path.basename(os.path.normpath(args.target)))
    ecfg = engines.EngineConfig(method=method, tree_budget=budget, max_batch=args.max_batch, max_len=max_len,
                                rounds_per_step=args.rounds_per_step, max_queue=args.max_queue,
                                attention=args.attention, batch_buckets=buckets, forms=args.forms or (),
                                tuning=args.tuning)
    return Plan(target_path, draft_path, args.dtype, name, ecfg, args.mesh, tok, eos, args.host, args.port,
                args.log_level, args.warmup_all, shape, not args.no_disk_cache)


def _check_mesh(shape: tuple[int, int], max_batch: int, tcfg, dcfg) -> None:
    """Everything a --mesh run needs, before any weight is read (ShardingError is a one-line ValueError)."""
    if shape == (1, 1):
        return
    from ddtree_jax import sharding

    if max_batch % shape[0]:
        raise cli.UsageError(f"--max-batch {max_batch} must be a multiple of the mesh's data axis ({shape[0]})")
    sharding.check(sharding.make_mesh(shape), tcfg, dcfg)


def _make_mesh(shape: tuple[int, int]):
    """A jax Mesh (sharding.make_mesh), or None for 1x1: one device, nothing sharded."""
    if shape == (1, 1):
        return None
    from ddtree_jax import sharding

    return sharding.make_mesh(shape)


def _random_models(p: Plan, dtype):
    """(target, draft) of random weights of ``p.random_shape`` (shapes.random_models); the draft is None for ar. On
    a mesh the engine then places them (sharding.shard_model)."""
    return shapes.random_models(p.random_shape, dtype, draft=p.engine_config.method != "ar")


def use_compilation_cache() -> None:
    """Keep compiled programs in the cache directory's jit/ (as generate does for the default pair), unless jax's
    persistent compilation cache already points somewhere (JAX_COMPILATION_CACHE_DIR)."""
    import jax

    from ddtree_jax import gguf_model

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.join(gguf_model.cache_dir(), "jit"))


def load_engine(p: Plan) -> engines.Engine:
    import jax.numpy as jnp

    from ddtree_jax import weights

    if p.disk_cache:
        use_compilation_cache()
    dtype = jnp.dtype(p.dtype)
    mesh = _make_mesh(p.mesh)
    if p.random_shape is not None:
        target, draft = _random_models(p, dtype)
        return engines.Engine(target, draft, p.engine_config, tokenizer=None, eos_token_ids=p.eos_token_ids,
                              mesh=mesh, persist_costs=p.disk_cache)
    if mesh is None:
        load_target, load_draft = weights.load_target, weights.load_draft
    else:  # each device reads its own part of the weights
        from ddtree_jax import sharding

        load_target = functools.partial(sharding.load_target, mesh=mesh)
        load_draft = functools.partial(sharding.load_draft, mesh=mesh)
    t0 = time.perf_counter()
    target = load_target(p.target_path, dtype=dtype)
    cli.info(f"loaded target {p.target_path} ({p.dtype}) in {time.perf_counter() - t0:.1f}s")
    draft = None
    if p.draft_path is not None:
        t0 = time.perf_counter()
        draft = load_draft(p.draft_path, dtype=dtype)
        cli.info(f"loaded drafter {p.draft_path} ({p.dtype}) in {time.perf_counter() - t0:.1f}s")
    return engines.Engine(target, draft, p.engine_config, tokenizer=p.tokenizer, eos_token_ids=p.eos_token_ids,
                          mesh=mesh, persist_costs=p.disk_cache)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    p = plan(args)
    logging.basicConfig(level=p.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = load_engine(p)
    no_tok = (f"the random model ({shapes.RANDOM_PREFIX}{p.random_shape}) has no tokenizer" if p.random_shape
              else NO_TOKENIZER_JSON)
    app = build_app(engine, model_name=p.model_name, tokenizer=p.tokenizer, warmup_all=p.warmup_all,
                    no_tokenizer=no_tok)
    import uvicorn

    c = p.engine_config
    cli.info(f"serving {p.model_name} ({c.method}{f', budget {c.tree_budget}' if c.method != 'ar' else ''}, "
             f"{c.max_batch} slots x {c.max_len} tokens, mesh {p.mesh[0]}x{p.mesh[1]}) on http://{p.host}:{p.port} ; compiling, /health "
             f"turns 200 when ready")
    uvicorn.run(app, host=p.host, port=p.port, log_level=p.log_level, timeout_graceful_shutdown=10)
    return cli.EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
