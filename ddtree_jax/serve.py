"""``python -m ddtree_jax.serve``: the command that serves a model over an OpenAI-compatible HTTP API
(http_server.build_app, whose request fields are openai_api's) with the continuous-batching engine.

Pipeline: parse and range-check the flags -> read the configs and the tokenizer -> load the weights ->
build the engine -> start uvicorn; the engine compiles in the background (``/health`` is 503 until then).
``--target random:SHAPE`` (a shape of ``ddtree_jax.shapes.SHAPES``) skips the files: the target and its DFlash
drafter get random weights made on the device (``shapes.model_configs`` / ``shapes.build_params``), for load
tests at real shapes; with no tokenizer, only token-id prompts are served.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import re
import sys
import time
from typing import Sequence

from ddtree_jax import cli, config, shapes
from ddtree_jax import engine as engines
from ddtree_jax.http_server import NO_TOKENIZER_JSON, build_app
from ddtree_jax.slots import check_batch_buckets, default_buckets
from ddtree_jax.spec import AUTO, DEFAULT_TREE_BUDGET, MAX_STOP_IDS, METHODS, GenerateOptions, make_spec
from ddtree_jax.tokenizer import Tokenizer, load_tokenizer

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
    g.add_argument("--method", choices=METHODS, default=None,
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
                   help="rounds per device call between host visits, at least: new tokens stream, requests join and "
                        "finished slots free every K rounds (default: 4)")
    b.add_argument("--step-ms", type=cli.nonneg_float, default=20.0, metavar="MS",
                   help="a step at a small slot batch runs more rounds (up to 16 at one request) while it lasts at "
                        "most MS by its measured cost, spreading each device call's fixed cost; 0: every step "
                        "runs K rounds (default: 20)")
    b.add_argument("--batch-buckets", type=_buckets, default=None, metavar="N,N,...|none",
                   help="smaller slot batches besides --max-batch, e.g. 1,4,16, or none: a step runs on one that "
                        "holds the live requests (their rows gathered out of the slots), so few requests do not pay "
                        "for a full batch (a verify runs slots x (nodes + 1) rows); under --tree-budget auto the "
                        "cheapest for the chosen form. Each size's programs compile in the background after "
                        "start-up; not with a data axis in --mesh (default: the powers of two below --max-batch)")
    b.add_argument("--compile-threads", type=cli.positive_int, default=None, metavar="N",
                   help="threads compiling the programs in the background after start-up while no request is "
                        "live; one while requests are served, which share the host (and the GPU, which XLA's "
                        "autotuning uses) with it (default: a quarter of the CPU cores, 1 to 4)")
    b.add_argument("--no-disk-cache", action="store_true",
                   help="keep nothing on disk: no persistent compilation cache (by default compiled programs are kept "
                        "in $DDTREE_JAX_CACHE/jit, unless JAX_COMPILATION_CACHE_DIR names another, so a second start "
                        "compiles little) and no cost table ($DDTREE_JAX_CACHE/costs.json: each program's seconds "
                        "per round, which --tree-budget auto weighs; then timed anew at every start)")
    b.add_argument("--warmup-all", action="store_true",
                   help="compile the prefills of every prompt-length bucket (64, 128, 256, ... up to --max-len; "
                        "each for 1, 2 and 4 requests prefilled together) before /health turns 200; by default only "
                        "the shortest bucket's for one request is, and the engine compiles the others while it is "
                        "idle (one no idle moment reached compiles on first use, pausing the batch once)")
    b.add_argument("--step-log", metavar="FILE", default=None,
                   help="append one JSON line per device step to FILE: when it was dispatched and how long it took, "
                        "its program (form, slot batch, sampling variant) and why it ran, its rounds, live "
                        "requests and tokens, whether admissions ran beside it (docs/SERVING.md#load-tests; "
                        "benchmarks/step_summary.py summarises it) (default: none)")

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
    budget = args.tree_budget if args.tree_budget is not None else DEFAULT_TREE_BUDGET
    if args.tree_budget is not None and method == "ar":
        cli.warn(f"--tree-budget {args.tree_budget} is ignored with --method ar")
    if args.forms is not None and (budget != AUTO or method == "ar"):
        cli.warn("--forms is ignored without --tree-budget auto and a drafter")
    if args.port > 65535:
        raise cli.UsageError(f"--port {args.port} is not a port number (0..65535)")
    if args.step_log and not os.path.isdir(os.path.dirname(os.path.abspath(args.step_log))):
        raise cli.UsageError(f"--step-log {args.step_log}: no such directory")
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
        check_batch_buckets(buckets or (), args.max_batch, args.mesh[0])
    except ValueError as e:
        raise cli.UsageError(f"--batch-buckets: {e}") from None
    options = GenerateOptions(method=method, tree_budget=budget, forms=args.forms or ())
    smallest = min((buckets if buckets is not None else default_buckets(args.max_batch, args.mesh[0]))
                   + (args.max_batch,))
    try:  # the verify block of the largest form the engine may run (as the engine computes it)
        block = make_spec(tcfg, dcfg if method != "ar" else None, options, args.tuning,
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
    if len(eos) > MAX_STOP_IDS:
        cli.warn(f"the model has {len(eos)} eos ids; only the first {MAX_STOP_IDS} stop generation")
        eos = eos[:MAX_STOP_IDS]
    name = args.served_model_name or (args.target if shape else os.path.basename(os.path.normpath(args.target)))
    ecfg = engines.EngineConfig(method=method, tree_budget=budget, max_batch=args.max_batch, max_len=max_len,
                                rounds_per_step=args.rounds_per_step, step_ms=args.step_ms, max_queue=args.max_queue,
                                attention=args.attention, batch_buckets=buckets, forms=args.forms or (),
                                tuning=args.tuning, compile_threads=args.compile_threads, step_log=args.step_log)
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
