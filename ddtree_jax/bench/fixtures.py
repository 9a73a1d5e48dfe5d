"""``bench fixtures``: the tiny reference pair of tests/fixtures/ddtree_reference (any backend; float32) on the
fixture prompts: ar, dflash and ddtree at a few budgets through decode.generate; per-round time (decode time /
rounds, compilation excluded), acceptance length, and whether the output equals the reference AR output."""

from __future__ import annotations

import json
import os
import statistics
import time

from ddtree_jax import cli
from ddtree_jax.bench.records import command, log, now, print_table, write_json


def run(args) -> int:
    """``bench fixtures``: each method (ddtree at each budget) on each prompt (and all as one batch with
    --batched); exit status 1 if an output differs from the reference's."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import decode, weights
    from ddtree_jax.spec import GenerateOptions

    root = args.fixtures
    cli.existing_dir("--fixtures", root)
    target = weights.load_target(os.path.join(root, "target"), dtype=jnp.float32)
    draft = weights.load_draft(os.path.join(root, "draft"), dtype=jnp.float32)
    with open(os.path.join(root, "generate.json")) as f:
        runs = json.load(f)["runs"][: args.prompts]
    mesh = None
    if args.mesh:  # the weights placed once (decode.generate would place them again on every call)
        from ddtree_jax import sharding

        mesh = sharding.make_mesh(args.mesh)
        target, draft = sharding.shard_model(target, mesh), sharding.shard_model(draft, mesh)
    configs = []
    for m in args.methods:
        if m == "ddtree":
            configs += [("ddtree", b) for b in args.budgets]
        else:
            configs.append((m, None))
    groups = [[r] for r in runs] + ([runs] if args.batched and len(runs) > 1 else [])
    records = []
    for method, budget in configs:
        for group in groups:
            n = min(r["max_new_tokens"] for r in group) if args.max_new_tokens is None else args.max_new_tokens
            opts = GenerateOptions(method=method, max_new_tokens=n, tree_budget=budget or 1)
            prompts = [r["prompt"] for r in group]
            dr = draft if method != "ar" else None
            t0 = time.perf_counter()
            decode.generate(target, prompts, opts, draft=dr, mesh=mesh, tuning=args.tuning)  # compiles
            compile_s = time.perf_counter() - t0
            per_round, res = [], None
            for _ in range(args.repeats):
                res = decode.generate(target, prompts, opts, draft=dr, mesh=mesh, tuning=args.tuning)
                rounds = max(len(a) for a in res.acceptance_lengths) if method != "ar" else max(res.num_generated)
                per_round.append(1e3 * res.decode_s / max(rounds, 1))
            acc = [a for seq in res.acceptance_lengths for a in seq]
            parity = all(out == r["ar"][: len(out)] and len(out) == len(r["prompt"]) + n
                         for out, r in zip(res.output_ids, group))
            rec = {
                "model": "fixture-tiny", "method": method, "budget": budget, "batch": len(group),
                "prompt_len": max(len(p) for p in prompts), "max_new_tokens": n,
                "ms_per_round": statistics.median(per_round),
                "rounds": rounds, "mean_acceptance_length": (sum(acc) / len(acc)) if acc else None,
                "tokens_per_round": sum(res.num_generated) / len(group) / max(rounds, 1),
                "matches_reference": parity, "attention": res.attention, "compile_s": compile_s,
                "mesh": args.mesh, "device": jax.devices()[0].device_kind, "date": now(), "command": command(),
            }
            records.append(rec)
            log(f"{method:6s} budget={budget} batch={len(group)}: {rec['ms_per_round']:.2f} ms/round, "
                 f"acceptance {rec['mean_acceptance_length']}, parity {parity}")
    print_table(records, ["method", "budget", "batch", "prompt_len", "ms_per_round", "mean_acceptance_length",
                           "tokens_per_round", "matches_reference"])
    if args.json:
        write_json(args.json, records)
    if not all(r["matches_reference"] for r in records):
        cli.warn("some outputs differ from the reference AR output")
        return 1
    return 0
