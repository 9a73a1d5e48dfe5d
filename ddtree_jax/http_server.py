"""The OpenAI-compatible HTTP endpoints over one continuous-batching engine (a starlette app; the command that
builds the engine and runs this app is ``python -m ddtree_jax.serve``):

    POST /v1/completions        prompt as text, token ids, or a list of either (one choice each)
    POST /v1/chat/completions   messages rendered with the model's chat template
    GET  /v1/models             the one served model
    GET  /health                200 when ready, 503 while compiling or after a failure
    GET  /metrics               Prometheus text (see metrics.Metrics)

``stream: true`` answers with server-sent events, ``data: {json}\\n\\n`` per chunk and ``data: [DONE]``
at the end. Errors are OpenAI-shaped (openai_api.ApiError): 400 for a bad request (unknown model, prompt too long,
parameter out of range, malformed JSON), 429 when the queue is full, 503 while the engine is starting or after it
failed. Every accepted request either completes or gets an error; a client that disconnects cancels its request and
frees its slot. HTTP is starlette + uvicorn, server-sent events are sse-starlette, metrics are prometheus_client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
import uuid
from typing import Any

from ddtree_jax import cli
from ddtree_jax import engine as engines
from ddtree_jax.openai_api import (DEFAULT_COMPLETION_TOKENS, ApiError, Options, bad_request, bool_field, from_engine,
                                   is_int, parse_options)
from ddtree_jax.requests import EngineClosed, Event, Job, QueueFull, RequestError
from ddtree_jax.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger("ddtree_jax.serve")  # named after the command, as its log lines always were

NO_TOKENIZER_JSON = "the model directory has no tokenizer.json"


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
        elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
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
            elif p and all(is_int(t) and t >= 0 for t in p):
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
        add_gen = bool_field(body, "add_generation_prompt", True)
        if not tok.has_chat_template:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        try:
            return tok.encode_chat(clean, add_generation_prompt=add_gen, **kwargs)
        except TokenizerError as e:
            raise bad_request(str(e), "messages") from None

    def _submit(self, prompts: list[list[int]], opts: Options, *, chat: bool, rid: str, queue: asyncio.Queue):
        loop = asyncio.get_running_loop()
        max_len = self.engine.config.max_len
        jobs: list[Job] = []
        try:
            for i, ids in enumerate(prompts):
                room = max_len - len(ids)
                default = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
                max_tokens = opts.max_tokens if opts.max_tokens is not None else max(default, 1)

                def sink(ev, i=i):
                    loop.call_soon_threadsafe(queue.put_nowait, (i, ev))

                jobs.append(self.engine.submit(ids, opts.params(max_tokens), sink, ignore_eos=opts.ignore_eos,
                                               request_id=f"{rid}-{i}"))
        except (RequestError, QueueFull, EngineClosed) as e:
            for job in jobs:
                self.engine.cancel(job)
            if isinstance(e, RequestError) and len(prompts) > 1:
                e = RequestError(f"prompt {len(jobs)}: {e}", e.param, e.code)
            raise from_engine(e) from None
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
                             "programs_compiled": e.programs_ready, "programs_timed": e.programs_timed,
                             "programs": e.programs_wanted, "prefills_to_compile": e.prefills_to_compile})

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

    def add(self, ev: Event) -> None:
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
