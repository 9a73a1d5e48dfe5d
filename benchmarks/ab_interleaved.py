"""Interleaved same-process A/B of whole rounds: every variant compiled once, then timed in alternating pairs (A B,
B A, A B, ...) so that the drift of one process's speed (up to 8% over a minute on an H200: docs/PERFORMANCE.md)
falls on every variant alike. Reports each variant's median ms per round, the median of the paired differences
against the first variant, and how many pairs the variant won.

A variant is NAME:FIELD=VALUE,... with fields ``draft`` (the drafter's layout, tuning.LAYOUTS; default
weight_layout.DRAFT_GPU_LAYOUT), ``layout`` (the target's; default weight_layout.GPU_LAYOUT,
weight_layout.GPU_AR_LAYOUT where a run takes AR's layout: weight_layout.layout_method), ``sampling`` and ``filtering``
(0 or 1: the Spec's flags; default what the sequences' --temperature / --top-p / --top-k need, as spec.make_spec sets
them), the fields of the Spec's ``Tuning`` but its layout (ddtree_jax.tuning: qkv_write, add_norm, decode_attention,
verify_align, layer_unroll, prefill_chunk; e.g. qkv_write=0 for XLA's ops instead of that kernel), module constants of
the package read when tracing (``pallas_kernels.M.NAME=VALUE`` or ``ddtree_jax.M.NAME=VALUE``, a Python literal, set
while the variant is traced and compiled, e.g. pallas_kernels.decode_attention.BLOCK=128; commas inside brackets or
braces belong to the value, e.g. ddtree_jax.model.SPLIT_ROWS=(64,384) or
pallas_kernels.tree_attention._CTA_US={1:3.8,2:6.0}), ``forms`` (a ``--tree-budget auto`` run among these forms,
'+'-separated, e.g. forms=ar+chain+16+32+64+128+256, taking the method's form at --budget in every round: what auto's
own bookkeeping costs, its tree built at the largest budget for the predictions, against a fixed budget's round),
``smallest`` (with ``forms``: the run's smallest slot batch, default --batch; its State is laid out for the forms
allowed there, as a server's for its slot batch 1), ``form`` (with ``forms``: the form every round takes, default the
method's; e.g. --method ar --variant auto:forms=ar+chain+16,form=ar for the AR step of a ddtree run, which keeps its
drafter's context) and any XLA option (added to decode.XLA_OPTIONS, as ``bench models --ab``). Each variant's record
has its cache's capacity.

    PYTHONPATH=. python benchmarks/ab_interleaved.py --model qwen3-8b --method ddtree --budget 64 --pairs 12 \\
        --variant base: --variant tom:layout=stacked-out-major-fused --json $OUT/ab.json [--profile $OUT/prof] \\
        [--hlo $OUT/hlo]
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import glob
import gzip
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import bench, cli, decode, policy, tuning
from ddtree_jax import spec as spec_lib
from ddtree_jax.bench import analysis, records, timing
from ddtree_jax.shapes import SHAPES, build_params, model_configs
from ddtree_jax.weight_layout import DRAFT_GPU_LAYOUT, GPU_AR_LAYOUT, GPU_LAYOUT, device_layout, layout_method


PACKAGES = ("pallas_kernels.", "ddtree_jax.")


def _constant(path: str, text: str):
    """"pkg.module.NAME", "VALUE" -> the literal VALUE, once pkg.module is found to hold NAME."""
    module, _, attr = path.rpartition(".")
    try:
        if not hasattr(importlib.import_module(module), attr):
            raise ImportError
        return ast.literal_eval(text)
    except (ImportError, ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{path}={text}: expected an existing module constant and a Python literal")


@contextlib.contextmanager
def constants_set(values: dict):
    """Set module constants {"pkg.module.NAME": value} inside the block, restored after it."""
    saved = {}
    try:
        for path, value in values.items():
            module, _, attr = path.rpartition(".")
            mod = importlib.import_module(module)
            saved[path] = (mod, attr, getattr(mod, attr))
            setattr(mod, attr, value)
        yield
    finally:
        for mod, attr, value in saved.values():
            setattr(mod, attr, value)


def variant(text: str) -> tuple[str, dict]:
    """NAME:FIELD=VALUE,... -> (NAME, {"layout"?, "draft"?, "sampling"?, "filtering"?, "tuning": its KEY=VALUE text,
    "constants", "options": XLA options})."""
    name, colon, rest = text.partition(":")
    pieces = [x for x in re.split(r",(?![^(){}\[\]]*[)}\]])", rest) if x]  # commas inside (...) / [...] / {...} stay
    own = ("draft=", "layout=", "sampling=", "filtering=", "forms=", "smallest=", "form=")
    tuned = tuple(f"{k}=" for k in (*tuning.SWITCHES, *tuning.COUNTS))
    fields = dict(x.split("=", 1) for x in pieces if x.startswith(own))
    fields["tuning"] = ",".join(x for x in pieces if x.startswith(tuned))
    try:
        tuning.parse(fields["tuning"])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    fields["constants"] = {k: _constant(k, v) for k, v in (x.split("=", 1) for x in pieces if x.startswith(PACKAGES))}
    others = ",".join(x for x in pieces if not x.startswith((*own, *tuned, *PACKAGES)))
    fields["options"] = bench.xla_options(others) if others else {}
    if not (name and colon) or fields["options"] is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:FIELD=VALUE,...")
    for key in ("draft", "layout"):
        if fields.get(key, "auto") not in tuning.LAYOUTS:
            raise argparse.ArgumentTypeError(f"{key}={fields[key]!r}: expected one of {', '.join(tuning.LAYOUTS)}")
    for key in ("sampling", "filtering"):
        if fields.get(key, "0") not in ("0", "1"):
            raise argparse.ArgumentTypeError(f"{key}={fields[key]!r}: expected 0 or 1")
    if "forms" in fields:
        try:
            fields["forms"] = policy.parse_forms(fields["forms"].split("+"))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"forms={fields['forms']}: {e}") from None
    if not fields.get("smallest", "1").isdigit() or int(fields.get("smallest", "1")) < 1 or (
            "smallest" in fields and "forms" not in fields):
        raise argparse.ArgumentTypeError(f"smallest={fields['smallest']}: a positive slot batch, with forms=")
    if "form" in fields and ("forms" not in fields or fields["form"] not in fields["forms"]):
        raise argparse.ArgumentTypeError(f"form={fields['form']}: one of the variant's forms=")
    return name, fields


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--method", default="ddtree", choices=("ar", "dflash", "ddtree"))
    p.add_argument("--budget", type=cli.positive_int, default=64)
    p.add_argument("--prompt", type=cli.positive_int, default=512)
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=256,
                   help="room past the prompt: the cache's capacity is prompt + this + a round's scratch slots")
    p.add_argument("--batch", type=cli.positive_int, default=1)
    p.add_argument("--rounds", type=cli.positive_int, default=10, help="rounds per timed call")
    p.add_argument("--temperature", type=cli.nonneg_float, default=0.0,
                   help="every sequence's sampling temperature (default: 0, greedy)")
    p.add_argument("--top-p", type=cli.probability, default=1.0, help="every sequence's top-p (default: 1, off)")
    p.add_argument("--top-k", type=cli.nonneg_int, default=0, help="every sequence's top-k (default: 0, off)")
    p.add_argument("--pairs", type=cli.positive_int, default=12, help="alternating passes over the variants")
    p.add_argument("--variant", type=variant, action="append", required=True,
                   help="NAME:FIELD=VALUE,... (see the module doc; quote values with brackets for the shell)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", help="a directory: also trace 5 rounds of each variant and summarise the kernels")
    p.add_argument("--hlo", help="a directory: write each variant's optimized HLO there (NAME.hlo.txt.gz)")
    args = p.parse_args()

    shape = SHAPES[args.model]
    tcfg, dcfg = model_configs(shape)
    tp0, dp0 = build_params(tcfg, dcfg, jnp.bfloat16)
    sample = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    spec = timing.make_spec(tcfg, dcfg, args.method, args.budget, "auto", **sample)
    n = jnp.int32(args.rounds)

    def spec_and_state(forms, smallest, form):
        """The variant's options, Spec (a fixed budget's, or auto's among ``forms`` at the method's form, its State
        laid out for slot batch ``smallest``) and a state of random prompts laid out for it (the same prompts for
        every variant)."""
        s = spec
        opts = spec_lib.GenerateOptions(method=args.method, tree_budget=args.budget, **sample)
        if forms:
            method = "ddtree" if policy.trees(forms) else "dflash" if policy.CHAIN in forms else args.method
            opts = spec_lib.GenerateOptions(method=method, max_new_tokens=args.max_new_tokens,
                                            tree_budget=spec_lib.AUTO, forms=forms, **sample)
            form = form or (policy.AR if args.method == "ar" else policy.CHAIN if args.method == "dflash"
                            else str(args.budget))
            s = spec_lib.make_spec(tcfg, dcfg, opts, batch=smallest).with_form(form, args.batch)
        _, capacity, out_len = decode.layout(s, [args.prompt] * args.batch, args.max_new_tokens)
        state = timing.make_state(s, shape.vocab, args.batch, args.prompt, capacity, out_len, jnp.bfloat16, **sample)
        return opts, s, state
    laid: dict[tuple, object] = {}

    def lay(params, layout):
        key = (type(params).__name__, layout)
        if key not in laid:
            laid[key] = jax.block_until_ready(device_layout(params, layout=layout))
        return laid[key]

    runs = {}
    for name, fields in args.variant:
        run_opts, base, state = spec_and_state(fields.get("forms"), int(fields.get("smallest", args.batch)),
                                               fields.get("form"))
        own = GPU_AR_LAYOUT if layout_method(run_opts) == "ar" else GPU_LAYOUT  # as a run lays its weights out
        tl, dl = fields.get("layout", own), fields.get("draft", DRAFT_GPU_LAYOUT)
        opts = fields["options"]
        flags = {k: fields[k] == "1" for k in ("sampling", "filtering") if k in fields}
        vspec = dataclasses.replace(base, tuning=tuning.parse(fields["tuning"], base.tuning), **flags)
        vspec = vspec.per_call(args.rounds)  # as decode.group's calls run it
        tp = lay(tp0, tl)
        dp = lay(dp0, dl) if base.draft is not None else None
        t0 = time.perf_counter()
        jax.clear_caches()  # else run_rounds' trace is reused: the module constants are read when tracing
        with constants_set(fields["constants"]):
            compiled = decode.run_rounds.lower(vspec, tp, dp, state, n).compile({**decode.XLA_OPTIONS, **opts})
        cs = time.perf_counter() - t0
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with gzip.open(os.path.join(args.hlo, f"{name}.hlo.txt.gz"), "wt") as f:
                f.write(compiled.as_text())
        state = jax.block_until_ready(compiled(tp, dp, timing.reset(state, args.prompt), jnp.int32(2)))  # warm
        runs[name] = dict(compiled=compiled, state=state, tp=tp, dp=dp, layout=tl, draft_layout=dl, options=opts,
                          forms=list(fields.get("forms", ())), capacity=int(state.cache.capacity),
                          tuning=dataclasses.asdict(vspec.tuning), sampling=vspec.sampling, filtering=vspec.filtering,
                          constants=fields["constants"], compile_s=cs, ms=[])
        print(f"{name}: layout {tl}, draft {dl}, options {opts}, {vspec.tuning}, constants {fields['constants']}, "
              f"compiled in {cs:.1f}s", flush=True)

    names = list(runs)
    for i in range(args.pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            r = runs[name]
            state = jax.block_until_ready(timing.reset(r["state"], args.prompt))
            t0 = time.perf_counter()
            r["state"] = jax.block_until_ready(r["compiled"](r["tp"], r["dp"], state, n))
            r["ms"].append(1e3 * (time.perf_counter() - t0) / args.rounds)

    # every variant once more from its state reset to the prompts: the tokens and acceptance lengths it gives (a
    # variant that should not change the math must give the first's exactly; states of other layouts compared on the
    # columns they share)
    tokens = {}
    for name in names:
        r = runs[name]
        r["state"] = r["compiled"](r["tp"], r["dp"], timing.reset(r["state"], args.prompt), n)  # donated: keep it
        tokens[name] = (np.asarray(r["state"].out), np.asarray(r["state"].accept_hist))

    def same(a, b):
        return all(np.array_equal(x[:, : min(x.shape[1], y.shape[1])], y[:, : min(x.shape[1], y.shape[1])])
                   for x, y in zip(a, b))

    base = runs[names[0]]["ms"]
    out = {"model": args.model, "method": args.method, "budget": args.budget if args.method == "ddtree" else None,
           "prompt_len": args.prompt, "max_new_tokens": args.max_new_tokens, "batch": args.batch,
           "rounds_per_call": args.rounds, "pairs": args.pairs,
           **sample, "device": jax.devices()[0].device_kind, "date": records.now(), "variants": {}}
    for name in names:
        r = runs[name]
        diffs = [m - b for m, b in zip(r["ms"], base)]
        out["variants"][name] = {
            "layout": r["layout"], "draft_layout": r["draft_layout"], "xla_options": r["options"],
            "tuning": r["tuning"], "constants": r["constants"],
            "sampling": r["sampling"], "filtering": r["filtering"],
            "compile_s": r["compile_s"], "median_ms": statistics.median(r["ms"]), "ms": r["ms"],
            "median_diff_ms_vs_first": statistics.median(diffs), "pairs_faster_than_first": sum(d < 0 for d in diffs),
            "forms": r["forms"], "cache_capacity": r["capacity"],
            "same_tokens_as_first": same(tokens[name], tokens[names[0]]),
        }
        print(f"{name:>12}: median {statistics.median(r['ms']):.3f} ms/round, paired diff vs {names[0]} "
              f"{statistics.median(diffs):+.3f} ms (faster in {sum(d < 0 for d in diffs)} of {len(diffs)}), "
              f"range {min(r['ms']):.3f}-{max(r['ms']):.3f}, same tokens: "
              f"{out['variants'][name]['same_tokens_as_first']}", flush=True)
    if args.profile:
        out["profiles"] = {}
        for name in names:
            r = runs[name]
            d = f"{args.profile}/{name}"
            state = jax.block_until_ready(timing.reset(r["state"], args.prompt))
            with jax.profiler.trace(d):
                r["state"] = jax.block_until_ready(r["compiled"](r["tp"], r["dp"], state, jnp.int32(5)))
            path = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
            out["profiles"][name] = analysis.profile_summary(path, top=60)
            print(f"{name}: profile {path}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
