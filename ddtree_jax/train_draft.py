"""``python -m ddtree_jax.train_draft --target PATH --out DIR``: train a DFlash drafter for a target, end to end.

    data      curated prompts (offline text, the target's own self-instruct user turns; deduplicated, held-out
              prompts kept out, a held-out split by topic) and the target's greedy and sampled responses, made with
              the project's decode loop at large batch (:mod:`ddtree_jax.training.curate`)       -> DIR/data.npz
    train     the DFlash objective over packed rows (:mod:`ddtree_jax.training.objective`), AdamW, data parallel
              over ``--mesh`` (:mod:`ddtree_jax.training.trainer`); orbax checkpoints, a JSONL history, evaluations
              on the shipped held-out prompt sets with the real decode loop         -> DIR/ckpt, DIR/history.jsonl
    export    the z-lab drafter layout, loadable by ``weights.load_draft`` and ``generate --draft`` -> DIR/drafter
    record    what was done and measured                                                         -> DIR/run.json

Rerunning the same command resumes: the data is reused, training continues from the last checkpoint. ``--init``
starts from exported drafter weights instead (a warm start across machines: the optimiser state stays behind).
``--time-limit`` boxes the whole command (data generation stops at ``--data-minutes``, the learning-rate schedule is
planned to end with the time); SIGTERM or Ctrl-C stops it early, keeping and exporting what exists.
``--results DIR2`` also writes the shareable record: the drafter split into parts of 15 MiB, config.json,
history.jsonl and run.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shlex
import shutil
import signal
import sys
import time
from typing import Sequence

from ddtree_jax import cli
from ddtree_jax.training import corpus

T0 = time.perf_counter()


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where there is a default (not for required flags or None)."""

    def _get_help_string(self, action):
        if action.default is None or action.required or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m ddtree_jax.train_draft",
        description="Train a DFlash block-diffusion drafter for a target model on the target's own responses to "
                    "curated prompts, then export it. Rerunning the same command resumes.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--target", required=True, metavar="PATH",
                   help="target model directory (Hugging Face or converted), or 'default' for SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, metavar="DIR", help="work directory: data.npz, ckpt/, drafter/, run.json")
    p.add_argument("--init", default=None, metavar="DRAFTER",
                   help="start from this exported drafter (config.json + model.safetensors or its .partNN files; "
                        "its shape replaces the drafter flags but --layers, which may deepen it) when DIR/ckpt has "
                        "no checkpoint")
    p.add_argument("--results", default=None, metavar="DIR2",
                   help="also write the drafter split into parts, config.json, history.jsonl and run.json here")
    p.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16",
                   help="the target's weights and the training's compute dtype (the drafter's master weights are "
                        "float32)")
    p.add_argument("--mesh", default="1", metavar="D",
                   help="data-parallel devices: each step's rows split over D devices (D or Dx1)")
    p.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                   help="the whole command's time: training stops and exports in time")
    p.add_argument("--attention", choices=cli.ATTENTIONS, default="auto",
                   help="the decode loop's attention, for the data and the evaluations, and on one GPU the "
                        "target's forward over the training rows (the tree-attention kernel when this resolves to "
                        "a Pallas one, else XLA's); " + cli.ATTENTION_HELP.removeprefix("attention: "))
    m = p.add_argument_group("drafter")
    m.add_argument("--layers", type=cli.positive_int, default=None, metavar="N",
                   help="drafter layers, of the target's width (default 2, or --init's); more than --init's grows it: "
                        "its layers, then new ones that start as the identity (zero output projections)")
    m.add_argument("--block-size", type=cli.positive_int, default=16, metavar="N",
                   help="block: the anchor token + block-size - 1 predicted positions")
    m.add_argument("--intermediate-size", type=cli.positive_int, default=None, metavar="N",
                   help="MLP width (default: the target's)")
    m.add_argument("--target-layer-ids", type=cli.int_list, default=None,
                   help="tapped target layers (default: 4 spread over the target's depth)")
    m.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the tokenizer's last control token, else the last vocabulary id")
    d = p.add_argument_group("data")
    d.add_argument("--corpus", type=_corpora, default="pydoc,stdlib", metavar="NAME,...",
                   help="offline text the passage prompts come from: pydoc (CPython's language reference), stdlib "
                        "(the standard library's source), packages (docstrings of installed packages with a "
                        "permissive licence), comma-separated")
    d.add_argument("--self-instruct", type=cli.nonneg_int, default=8000, metavar="N",
                   help="user turns the target writes itself (Magpie) to be answered (targets with a chat template)")
    d.add_argument("--num-prompts", type=cli.positive_int, default=None, metavar="N",
                   help="passage requests answered (default: all)")
    d.add_argument("--prompts-per-passage", type=cli.positive_int, default=1, metavar="N",
                   help="requests drawn per passage")
    d.add_argument("--held-out-prompts", type=cli.nonneg_int, default=64, metavar="N",
                   help="held-out requests answered (their loss is tracked while training)")
    d.add_argument("--max-prompt-tokens", type=cli.positive_int, default=256, metavar="N",
                   help="longer prompts are dropped (every prompt is padded to this for its prefill)")
    d.add_argument("--max-new-tokens", type=cli.positive_int, default=1024, metavar="N", help="the longest response")
    d.add_argument("--greedy-share", type=float, default=0.5, help="share of greedy responses (the rest sampled)")
    d.add_argument("--temperatures", type=_floats, default="0.7,1.0", metavar="T,...",
                   help="temperatures of the sampled responses (drawn uniformly)")
    d.add_argument("--gen-batch", type=cli.positive_int, default=256, metavar="N", help="rows decoded together")
    d.add_argument("--data-minutes", type=float, default=None, metavar="MINUTES",
                   help="stop generating after this long (responses cut there are kept)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=cli.positive_int, default=2000, metavar="N",
                   help="training steps: the schedule's length (the most, with --time-limit)")
    t.add_argument("--batch", type=cli.positive_int, default=16, metavar="N", help="rows per step")
    t.add_argument("--seq-len", type=cli.positive_int, default=2048, metavar="N",
                   help="tokens per row (whole sequences packed)")
    t.add_argument("--anchors", type=cli.positive_int, default=512, metavar="N", help="blocks per row per step")
    t.add_argument("--anchor-group", type=cli.positive_int, default=32, metavar="N",
                   help="blocks computed at once (memory grows with it, not with --anchors)")
    t.add_argument("--anchor-half-life", type=cli.positive_int, default=None, metavar="H",
                   help="draw anchors weighted 2^(-r/H) at the r-th token of a response, so more blocks fall early in "
                        "answers (default: uniformly, as DFlash)")
    t.add_argument("--loss", choices=("ce", "kl"), default="ce",
                   help="ce: cross-entropy on the target's tokens; kl: KL to the target's distribution")
    t.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (warmup, cosine to 0)")
    t.add_argument("--warmup", type=cli.positive_int, default=100, metavar="N", help="warmup steps")
    t.add_argument("--gamma", type=float, default=None,
                   help="loss decay: slot k weighs exp(-(k-1)/gamma) (default: 7 for block 16, as DFlash)")
    t.add_argument("--seed", type=int, default=0, help="prompts, decoding, initialisation, batches and anchors")
    t.add_argument("--save-every", type=cli.positive_int, default=500, metavar="N", help="checkpoint every N steps")
    e = p.add_argument_group("evaluation (greedy ddtree on the shipped held-out sets, with the real decode loop)")
    e.add_argument("--evals", type=cli.nonneg_int, default=4, metavar="N",
                   help="evaluations spread over the run, the last at its end (0: none)")
    e.add_argument("--eval-budget", type=cli.positive_int, default=64, metavar="N", help="ddtree budget")
    e.add_argument("--eval-tokens", type=cli.positive_int, default=128, metavar="N", help="new tokens per prompt")
    return p


def _corpora(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in corpus.CORPORA]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown corpus {', '.join(bad) or repr(text)} "
                                         f"(choose from {', '.join(corpus.CORPORA)})")
    return names


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: temperatures must be above 0")
    return values


def default_layer_ids(num_layers: int, n: int = 4) -> tuple[int, ...]:
    """n layers spread from 1 to num_layers - 3 (z-lab's range)."""
    hi = max(1, num_layers - 3)
    return tuple(sorted({int(round(1 + i * (hi - 1) / max(1, n - 1))) for i in range(n)}))


def draft_raw_config(target_cfg, *, num_layers: int, block_size: int, mask_token_id: int,
                     target_layer_ids: Sequence[int], intermediate_size: int | None = None) -> dict:
    """A z-lab DFlash config.json for a drafter as wide as the target (its heads and MLP width by default)."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "block_size": int(block_size),
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in target_layer_ids]},
        "head_dim": target_cfg.head_dim, "hidden_act": "silu", "hidden_size": target_cfg.hidden_size,
        "intermediate_size": int(intermediate_size or target_cfg.intermediate_size),
        "layer_types": ["full_attention"] * num_layers, "max_position_embeddings": target_cfg.max_position_embeddings,
        "num_attention_heads": target_cfg.num_heads, "num_hidden_layers": int(num_layers),
        "num_key_value_heads": target_cfg.num_kv_heads, "num_target_layers": target_cfg.num_layers,
        "rms_norm_eps": target_cfg.rms_norm_eps, "rope_theta": target_cfg.rope.theta, "tie_word_embeddings": False,
        "vocab_size": target_cfg.vocab_size, "torch_dtype": "bfloat16",
    }


def _drafter_config(args, tcfg, tok) -> dict:
    if args.init:
        with open(os.path.join(cli.existing_dir("--init", args.init), "config.json")) as f:
            raw = json.load(f)
        raw.pop("weights_sha256", None)
        have = int(raw["num_hidden_layers"])
        if args.layers is not None and args.layers != have:
            if args.layers < have:
                raise cli.UsageError(f"--layers {args.layers} is fewer than the --init drafter's {have}: a drafter "
                                     "can grow, not shrink")
            raw.update(num_hidden_layers=args.layers, layer_types=["full_attention"] * args.layers)
        return raw
    if args.block_size < 2:
        raise cli.UsageError("--block-size must be at least 2")
    mask = args.mask_token_id
    if mask is None:
        mask = tcfg.vocab_size - 1
        if tok is not None:
            specials = [i for i, t in tok._tok.get_added_tokens_decoder().items() if t.special and i < tcfg.vocab_size]
            mask = max(specials) if specials else mask
    return draft_raw_config(tcfg, num_layers=args.layers or 2, block_size=args.block_size, mask_token_id=mask,
                            target_layer_ids=args.target_layer_ids or default_layer_ids(tcfg.num_layers),
                            intermediate_size=args.intermediate_size)


def _target_attention(choice: str, mesh) -> str:
    """The target's forward over the training rows: the tree-attention kernel on one GPU when ``--attention``
    resolves to a Pallas implementation (it does not materialise the rows' [T, T] scores: 50 against 217 ms a step's
    forward on an H100, docs/TRAINING.md), else XLA's attention (on a mesh XLA partitions it by itself)."""
    from ddtree_jax import kernels

    return "pallas" if mesh is None and kernels.resolve_attention(choice) in ("pallas", "pallas-inplace") else "xla"


def _mesh(text: str):
    from ddtree_jax import sharding

    d, m = sharding.parse_mesh(text if "x" in text.lower() else f"{text}x1")
    if m != 1:
        raise cli.UsageError(f"--mesh {text}: training is data parallel only (Dx1)")
    return None if d == 1 else sharding.make_mesh((d, 1))


class _Stop:
    """SIGTERM / SIGINT while running: stop at the next chance (a generation sync, a training step), keep what
    exists. A second signal interrupts at once."""

    def __init__(self):
        self.reason: str | None = None
        self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.reason is not None:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name
        cli.warn(f"{self.reason}: stopping at the next step, keeping what exists")

    def __call__(self) -> bool:
        return self.reason is not None

    def restore(self):
        for s, h in self.old.items():
            signal.signal(s, h)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp

    from ddtree_jax import config, defaults, weights
    from ddtree_jax.tokenizer import load_tokenizer
    from ddtree_jax.training import curate, dataset, evaluate, export, objective, trainer

    deadline = None if args.time_limit is None else T0 + 60 * args.time_limit
    mesh = _mesh(args.mesh)
    target_path = defaults.target_path() if args.target == "default" else cli.existing_dir("--target", args.target)
    tcfg, tok = config.model_config(target_path), load_tokenizer(target_path)
    raw = _drafter_config(args, tcfg, tok)
    dcfg = config.draft_config(raw)
    config.check_pair(tcfg, dcfg)
    os.makedirs(args.out, exist_ok=True)
    stop_ids = tuple(dict.fromkeys((tok.eos_token_ids if tok else ()) + tcfg.eos_token_ids))
    run: dict = {"argv": shlex.join(sys.argv[1:] if argv is None else argv), "target": target_path,
                 "drafter_config": raw,
                 "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "phases_s": {}}
    stop = _Stop()
    try:
        target = weights.load_target(target_path, jnp.dtype(args.dtype))
        init = export.load(args.init) if args.init else None
        tc = trainer.TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, warmup=args.warmup, seed=args.seed,
                                 compute_dtype=args.dtype, target_attention=_target_attention(args.attention, mesh),
                                 objective=objective.Objective(
                                     anchors=args.anchors, group=args.anchor_group, half_life=args.anchor_half_life,
                                     gamma=args.gamma, loss=args.loss))
        tr = trainer.Trainer(target, dcfg, raw, tc, args.out, mesh)
        run["phases_s"]["setup"] = round(time.perf_counter() - T0, 1)
        run["target_attention"] = tc.target_attention

        data_file = os.path.join(args.out, "data.npz")
        # the step compiles on another thread (while the target generates the data, if it must)
        ahead = concurrent.futures.ThreadPoolExecutor(1).submit(tr.compile, args.seq_len)
        if os.path.exists(data_file):
            seqs = dataset.Sequences.load(data_file)
            cli.info(f"reusing {data_file}: {len(seqs)} sequences, {seqs.response_tokens:,} response tokens")
            run["data"] = {"sequences": seqs.summary()}
            if os.path.exists(os.path.join(args.out, "data.json")):
                with open(os.path.join(args.out, "data.json")) as f:
                    run["data"] = json.load(f)
        else:
            t0 = time.perf_counter()
            dc = curate.DataConfig(corpora=args.corpus, per_passage=args.prompts_per_passage,
                                   self_instruct=args.self_instruct if tok is not None and tok.has_chat_template else 0,
                                   max_prompts=args.num_prompts, held_out_prompts=args.held_out_prompts,
                                   max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
                                   greedy_share=args.greedy_share, temperatures=args.temperatures,
                                   batch=args.gen_batch, seed=args.seed)
            cuts = [x for x in (deadline and deadline - 120, args.data_minutes and t0 + 60 * args.data_minutes) if x]
            seqs, run["data"] = curate.curate(target, tok, dc, stop_ids=stop_ids, deadline=min(cuts, default=None),
                                              should_stop=stop, attention=args.attention, log=cli.info)
            seqs.save(data_file)
            with open(os.path.join(args.out, "data.json"), "w") as f:
                json.dump(run["data"], f, indent=2)
            run["phases_s"]["data"] = round(time.perf_counter() - t0, 1)
        rows = dataset.pack(seqs.subset(seqs.split == dataset.TRAIN), args.seq_len)
        held = dataset.pack(seqs.subset(seqs.split == dataset.HELD_OUT), args.seq_len)
        if len(rows) == 0:
            raise cli.UsageError("no training sequence with a response of 2 tokens or more")
        run["rows"] = {"train": len(rows), "held_out": len(held), "seq_len": args.seq_len,
                       "fill": round(float(rows.supervised.mean()), 3)}
        cli.info(f"{len(rows)} training rows of {args.seq_len} tokens ({run['rows']['fill']:.0%} response tokens), "
                 f"{len(held)} held out")
        try:
            run["phases_s"]["step_compile_ahead"] = round(ahead.result(), 1)
        except Exception as e:  # noqa: BLE001 - the kernel's form falls back to XLA's; else the first step compiles
            if tc.target_attention == "xla":
                cli.warn(f"compiling the step ahead failed ({type(e).__name__}: {e}); it compiles at the first step")
            else:  # a kernel that does not compile here must not cost the run
                cli.warn(f"the step with the tree-attention kernel did not compile ({type(e).__name__}: "
                         f"{cli.one_line(e)[:200]}); training with XLA's attention")
                tc = dataclasses.replace(tc, target_attention="xla")
                tr = trainer.Trainer(target, dcfg, raw, tc, args.out, mesh)
                run["target_attention"] = tc.target_attention
        tr.start(init, log=cli.info)

        def held_out(params) -> dict:
            draft = (dcfg, jax.device_put(jax.tree.map(lambda x: x.astype(args.dtype), params), jax.devices()[0]))
            return evaluate.held_out_acceptance(target, draft, tok, budget=args.eval_budget,
                                                max_new_tokens=args.eval_tokens, stop_ids=stop_ids,
                                                attention=args.attention)

        can_eval = args.evals and tok is not None and tok.has_chat_template
        fit = tr.fit(rows, held, deadline=None if deadline is None else deadline - 20, evals=args.evals,
                     evaluate=held_out if can_eval else None, should_stop=stop, save_every=args.save_every,
                     log=cli.info)
        run["training"] = {**fit, **_throughput(tr.history, objective.flops_per_row(
            tcfg, dcfg, args.seq_len, args.anchors) * args.batch)}
        export.export(tr.params, raw, os.path.join(args.out, "drafter"), meta={"step": tr.step})
        run["evals"] = [h for h in tr.history if "eval_s" in h]
        cli.info(f"wrote {os.path.join(args.out, 'drafter')} (step {tr.step})")
    finally:
        stop.restore()
        run["stopped_by_signal"] = stop.reason
        run["phases_s"]["total"] = round(time.perf_counter() - T0, 1)
        _memory(run)
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump(run, f, indent=2)
        if args.results:
            _write_results(args.out, args.results)
    return cli.EXIT_OK


def _throughput(history: list[dict], step_flops: float) -> dict:
    """Training tokens/s from the log entries after the first two (compilation and warm-up behind them), and the
    model FLOPs they mean (``objective.flops_per_row``: an estimate)."""
    logs = [h for h in history if "loss" in h][2:]
    if not logs:
        return {}
    steps = sum(h["steps"] for h in logs)
    secs = sum(h["elapsed_s"] for h in logs)
    return {"row_tokens_per_s": round(sum(h["row_tokens_per_s"] * h["elapsed_s"] for h in logs) / secs),
            "labels_per_s": round(sum(h["labels_per_s"] * h["elapsed_s"] for h in logs) / secs),
            "steady_sec_per_step": round(secs / steps, 4),
            "model_tflops_per_s": round(step_flops * steps / secs / 1e12, 1)}


def _memory(run: dict) -> None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        run["device_peak_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 2)


def _write_results(out: str, results: str) -> None:
    """The shareable record (what a device call brings back): the drafter in parts, history, run record."""
    from ddtree_jax.training import export

    os.makedirs(results, exist_ok=True)
    if os.path.exists(os.path.join(out, "drafter", export.WEIGHTS)):
        export.split(os.path.join(out, "drafter"), results)
    for name in ("history.jsonl", "run.json"):
        if os.path.exists(os.path.join(out, name)):
            shutil.copy(os.path.join(out, name), os.path.join(results, name))


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
