"""``bench pair``: a trained pair (default: the default pair) on the shipped held-out Python prompts, one at a
time or as one batch: mean acceptance length and decode tokens/s of ar, dflash and ddtree at fixed budgets and
under --tree-budget auto, optionally checked against ar's tokens and a host replay of every round's walk."""

from __future__ import annotations

import collections
import dataclasses
import statistics

from ddtree_jax import cli
from ddtree_jax.bench.records import command, now, write_json


def run(args) -> int:
    """training.evaluate.benchmark on held-out prompts, one at a time (batch 1) or as one batch; per method the mean
    acceptance length over all rounds and the mean decode tokens/s, compilation excluded."""
    import jax.numpy as jnp

    from ddtree_jax import defaults, weights
    from ddtree_jax.spec import AUTO
    from ddtree_jax.tokenizer import load_tokenizer
    from ddtree_jax.training import evaluate, prompts as curated
    from ddtree_jax.weight_layout import device_layout

    target_path = defaults.target_path() if args.target == "default" else cli.existing_dir("--target", args.target)
    draft_path = cli.existing_dir("--draft", args.draft or defaults.draft_path())
    dtype = jnp.dtype(args.dtype)
    # laid out once for the backend here, for the rounds (device_layout is idempotent: each dflash / ddtree call below
    # then has nothing to do; on GPU each ar call turns the target output-major again, before its timed decode), not
    # once per prompt
    target, draft = ((cfg, device_layout(p, layout=args.tuning.layout))
                     for cfg, p in (weights.load_target(target_path, dtype), weights.load_draft(draft_path, dtype)))
    tok = load_tokenizer(target_path)
    if tok is None:
        raise cli.UsageError(f"{target_path} has no tokenizer: the held-out prompts are text")
    held_out = [curated.chat_ids(tok, m) for m in curated.held_out_set("python")]
    prompts = held_out[: args.prompts]
    stop = tuple(dict.fromkeys(tok.eos_token_ids + target[0].eos_token_ids))
    groups = [prompts] if args.batched else [[p] for p in prompts]
    fixed = [b for b in args.budgets if b != AUTO]
    runs = []
    for g in groups:  # every method on a prompt before the next prompt: a machine's drift over minutes (2 CPU cores'
        # speed halves at times) falls on every method alike, not on the ones timed last
        run = evaluate.benchmark(target, draft, g, budgets=fixed, max_new_tokens=args.max_new_tokens,
                                 stop_ids=stop, attention=args.attention, check=args.check, log=lambda m: None,
                                 tuning=args.tuning)
        ar_ids = run["ar"].pop("output_ids", None)  # with --check: AR's tokens, which auto's check reuses
        if AUTO in args.budgets:
            run["ddtree-auto"] = _auto_run(target, draft, g, args, stop, run["ar"]["tokens_per_s"], ar_ids)
        runs.append(run)
        table = _table(runs, args)
        cli.info(f"prompt {len(runs)}/{len(groups)}: " + ", ".join(
            f"{name} {row['tokens_per_s'] or 0:.1f} tok/s"
            + (f" (τ {row['mean_acceptance_length']:.2f})" if row["mean_acceptance_length"] else "")
            for name, row in run.items()))
        if args.json:  # after every prompt: a run cut short (a device call's time limit) keeps what it measured
            write_json(args.json, _record(table, runs, groups, prompts, args, target_path, draft_path))
    extra = f" {'min':>4} {'same-as-ar':>10} {'diverges at':>11} {'walk mismatches':>15}" if args.check else ""
    print(f"{'method':<12} {'acceptance':>10} {'tok/s':>8} {'vs ar':>6}{extra}")
    for name, row in table.items():
        acc = "-" if row["mean_acceptance_length"] is None or name == "ar" else f"{row['mean_acceptance_length']:.2f}"
        line = f"{name:<12} {acc:>10} {row['tokens_per_s']:>8.1f} {row['speedup']:>5.2f}x"
        if args.check and name != "ar":
            div = "-" if row["first_divergence"] is None else str(row["first_divergence"])
            line += (f" {row['min_acceptance_length']:>4} {row['same_as_ar']:>4}/{len(prompts):<5} {div:>11} "
                     f"{row['walk_mismatches']:>6}/{row['traced_rounds']:<8}")
        print(line)
    if "ddtree-auto" in table:
        print("ddtree-auto's rounds: " + ", ".join(f"{f} x{n}" for f, n in table["ddtree-auto"]["forms"].items())
              + f"; device calls a decode: {statistics.fmean(table['ddtree-auto']['calls']):.1f}")
        print("ddtree-auto's costs, ms a round (median over prompts, as timed before its decodes / as they left them): "
              + ", ".join(f"{f} {statistics.median(c['timed']):.3f} / {statistics.median(c['decode']):.3f}"
                          for f, c in table["ddtree-auto"]["costs_ms"].items()))
    return 0


def _table(runs: list[dict], args) -> dict:
    """Per method, over the prompts run so far: the mean acceptance length over all rounds, the mean decode tokens/s
    and its ratio to AR's; auto's forms, calls and costs; with --check, the checks summed."""
    table = {}
    for name in runs[0]:
        acc = [r[name]["mean_acceptance_length"] for r in runs if r[name]["mean_acceptance_length"] is not None]
        tps = [r[name]["tokens_per_s"] for r in runs if r[name]["tokens_per_s"]]
        mins = [r[name]["min_acceptance_length"] for r in runs if r[name]["min_acceptance_length"] is not None]
        table[name] = {"mean_acceptance_length": statistics.fmean(acc) if acc else None,
                       "min_acceptance_length": min(mins) if mins else None,  # >= 1: generate checks it
                       "tokens_per_s": statistics.fmean(tps) if tps else None,
                       "attention": sorted({r[name]["attention"] for r in runs})}
        if name == "ddtree-auto":  # the forms its rounds took, over every prompt; each form's ms a round as timed
            # before each decode and as the decode left it, per prompt (the costs its choices weighed)
            table[name]["forms"] = dict(sum((collections.Counter(r[name]["forms"]) for r in runs),
                                            collections.Counter()).most_common())
            table[name]["calls"] = [r[name]["calls"] for r in runs]  # device calls of each decode (its groups)
            table[name]["costs_ms"] = {f: {"timed": [r[name]["costs_ms"][f][0] for r in runs],
                                           "decode": [r[name]["costs_ms"][f][1] for r in runs]}
                                       for f in runs[0][name]["costs_ms"]}
        if args.check and name != "ar":
            firsts = [r[name]["first_divergence"] for r in runs if r[name]["first_divergence"] is not None]
            table[name].update({k: sum(r[name][k] for r in runs) for k in ("same_as_ar", "walk_mismatches",
                                                                             "traced_rounds")})
            table[name]["first_divergence"] = min(firsts, default=None)
            table[name]["traced_same_as_untraced"] = all(r[name]["traced_same_as_untraced"] for r in runs)
    for name, row in table.items():
        ar = table["ar"]["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / ar if ar and row["tokens_per_s"] else None
    return table


def _record(table: dict, runs: list, groups: list, prompts: list, args, target_path: str, draft_path: str) -> dict:
    """The JSON record of ``bench pair``: the run's conditions, the prompts done so far and the table."""
    import jax

    return {"date": now(), "command": command(), "device": jax.devices()[0].device_kind,
            "backend": jax.default_backend(), "target": target_path, "draft": draft_path, "dtype": args.dtype,
            "prompts": len(prompts), "prompts_done": sum(len(g) for g in groups[: len(runs)]),
            "batch": len(prompts) if args.batched else 1, "max_new_tokens": args.max_new_tokens,
            "attention": args.attention, "tuning": dataclasses.asdict(args.tuning), "methods": table}


def _auto_run(target, draft, prompts, args, stop, ar_tokens_per_s, ar_ids) -> dict:
    """``bench pair``'s ddtree under --tree-budget auto (the cost table of the cache directory, kept there): what
    training.evaluate.benchmark records of a fixed budget, and the forms the rounds took ({form: rounds}); with
    --check, checked against ``ar_ids`` (AR's tokens of the same prompts)."""
    from ddtree_jax import decode
    from ddtree_jax.spec import AUTO, GenerateOptions
    from ddtree_jax.training import evaluate

    opts = GenerateOptions(method="ddtree", tree_budget=AUTO, max_new_tokens=args.max_new_tokens,
                           stop_token_ids=stop, attention=args.attention, forms=args.forms or ())
    res = decode.generate(target, prompts, opts, draft=draft, persist_costs=True, tuning=args.tuning)
    acc = [a for seq in res.acceptance_lengths for a in seq]
    tps = sum(res.num_generated) / res.decode_s if res.decode_s > 0 else None
    row = {"mean_acceptance_length": statistics.fmean(acc) if acc else None,
           "min_acceptance_length": min(acc) if acc else None, "rounds": len(acc), "tokens_per_s": tps,
           "attention": res.attention,
           "forms": dict(collections.Counter(f for seq in res.round_forms for f in seq).most_common()),
           "costs_ms": res.form_costs_ms, "calls": len(res.groups)}
    if tps and ar_tokens_per_s:
        row["speedup"] = tps / ar_tokens_per_s
    if args.check:  # as training.evaluate.benchmark's check: AR's tokens (its run's), each traced walk replayed
        row.update(evaluate.check_against_ar(res, ar_ids, prompts, target, draft, dataclasses.replace(opts, trace=True),
                                             args.tuning, persist_costs=True))
    return row
