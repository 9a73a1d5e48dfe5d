"""A drafter measured with the real decode loop: acceptance on the shipped held-out prompt sets, and the speed of
ar / dflash / ddtree against each other.

``python -m ddtree_jax.training.evaluate`` is the check anyone can run on a CPU: for each held-out set it runs
``python -m ddtree_jax.generate --json`` on the set's prompts (greedy, ddtree, budget 64, 128 new tokens, all the
set's prompts as one batch) and prints the mean acceptance length per set (accepted nodes per round, the root
included, pooled over every round of the set's prompts), also by the band of output tokens where each round started,
as one JSON object on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from typing import Any, Sequence

import numpy as np

from ddtree_jax import cli
from ddtree_jax.training import prompts as P

BUDGET, NEW_TOKENS = 64, 128  # the held-out check's decoding
BAND = 128  # output tokens per band of the check's breakdown by position


def acceptance(target, draft, prompts: list[list[int]], *, budget: int = BUDGET, max_new_tokens: int = NEW_TOKENS,
               stop_ids: Sequence[int] = (), method: str = "ddtree", attention: str = "auto") -> list[list[int]]:
    """Per prompt, the acceptance length of every round of greedy speculative decoding (one batch)."""
    from ddtree_jax import decode
    from ddtree_jax.spec import GenerateOptions

    opts = GenerateOptions(method=method, tree_budget=budget, max_new_tokens=max_new_tokens,
                           stop_token_ids=tuple(stop_ids), attention=attention)
    return decode.generate(target, prompts, opts, draft=draft).acceptance_lengths


def held_out_acceptance(target, draft, tokenizer, *, budget: int = BUDGET, max_new_tokens: int = NEW_TOKENS,
                        stop_ids: Sequence[int] = (), attention: str = "auto") -> dict[str, float]:
    """{set name: mean acceptance length} over the shipped held-out sets, every set's prompts in one batch (one
    compilation for every evaluation of a training run)."""
    sets = P.held_out_sets()
    prompts = [P.chat_ids(tokenizer, m) for ps in sets.values() for m in ps]
    lengths = acceptance(target, draft, prompts, budget=budget, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                         attention=attention)
    out, at = {}, 0
    for name, ps in sets.items():
        rounds = [a for seq in lengths[at:at + len(ps)] for a in seq]
        out[name] = round(float(np.mean(rounds)), 3) if rounds else None
        at += len(ps)
    return out


def benchmark(target, draft, prompts: list[list[int]], *, budgets: Sequence[int], max_new_tokens: int,
              stop_ids: Sequence[int] = (), attention: str = "auto", check: bool = False, log=print,
              tuning=None) -> dict[str, Any]:
    """Greedy ar / dflash / ddtree(budget) on the prompts as one batch (one compilation per method): mean
    acceptance length and decode tokens/s (generated tokens / the on-device decode loop's time: no prefill,
    no compilation, no streaming round trips), speedup over ar. ``tuning`` (``ddtree_jax.tuning.Tuning``, default
    the backend's defaults) applies to every method.

    check: also compare each method's tokens with ar's (ar's own kept as ``out["ar"]["output_ids"]``; ``same_as_ar``:
    prompts whose outputs are equal;
    ``first_divergence``: the earliest generated position where one differs) and run it again traced, replaying
    every round's walk on the host from the traced tree and target choices (``walk_mismatches``: rounds whose
    accepted path differs from :func:`accept.walk_host`'s). Greedy speculative decoding in bf16 may part from
    ar where two logits nearly tie (the verify's matrix shapes differ from ar's); a walk mismatch is a fault."""
    from ddtree_jax import decode
    from ddtree_jax.spec import GenerateOptions
    from ddtree_jax.tuning import Tuning
    from ddtree_jax.weight_layout import device_layout

    tuning = tuning or Tuning()
    # laid out for the backend once here, for the rounds, not in each decode.generate call below
    target, draft = ((cfg, device_layout(p, layout=tuning.layout)) for cfg, p in (target, draft))
    runs = [("ar", 0), ("dflash", 0)] + [("ddtree", b) for b in budgets]
    out: dict[str, Any] = {}
    ar_ids = None
    for method, budget in runs:
        opts = GenerateOptions(method=method, tree_budget=budget or 1, max_new_tokens=max_new_tokens,
                               stop_token_ids=tuple(stop_ids), attention=attention)
        res = decode.generate(target, prompts, opts, draft=None if method == "ar" else draft, tuning=tuning)
        acc = [a for seq in res.acceptance_lengths for a in seq]
        tokens = sum(res.num_generated)
        name = method if method != "ddtree" else f"ddtree-{budget}"
        # every round accepts at least the root (decode.generate raises 'decode fault' otherwise); the smallest round
        # is kept in the record
        out[name] = {"mean_acceptance_length": float(np.mean(acc)) if acc else None,
                     "min_acceptance_length": int(min(acc)) if acc else None, "rounds": len(acc),
                     "tokens_per_s": tokens / res.decode_s if res.decode_s > 0 else None,
                     "attention": res.attention}  # the path that ran ("auto" resolved)
        if name != "ar" and out["ar"]["tokens_per_s"] and out[name]["tokens_per_s"]:
            out[name]["speedup"] = out[name]["tokens_per_s"] / out["ar"]["tokens_per_s"]
        if method == "ar":
            ar_ids = res.output_ids
        elif check:
            out[name].update(check_against_ar(res, ar_ids, prompts, target, draft,
                                              dataclasses.replace(opts, trace=True), tuning))
        log(f"{name}: {json.dumps(out[name])}")
    if check:
        out["ar"]["output_ids"] = ar_ids
    return out


def check_against_ar(res, ar_ids, prompts, target, draft, traced_opts, tuning, **generate_kw) -> dict[str, Any]:
    """``benchmark``'s check of one method (and ``bench pair``'s of auto): its outputs ``res`` against ar's
    ``ar_ids``, and a run with ``traced_opts`` (``generate_kw`` passed on to decode.generate) whose walks are
    replayed on the host."""
    from ddtree_jax import accept, decode

    starts = [len(p) for p in prompts]
    firsts = [next((i - s for i, (x, y) in enumerate(zip(mine, theirs)) if i >= s and x != y),
                   None if len(mine) == len(theirs) else min(len(mine), len(theirs)) - s)
              for mine, theirs, s in zip(res.output_ids, ar_ids, starts)]
    traced = decode.generate(target, prompts, traced_opts, draft=draft, tuning=tuning, **generate_kw)
    rounds = [r for seq in traced.rounds for r in seq]
    bad = sum(accept.walk_host(r["tree"]["node_token_ids"], r["tree"]["parents"], r["target_choices"])
              != r["accepted_indices"] for r in rounds)
    return {"same_as_ar": sum(f is None for f in firsts), "prompts": len(prompts),
            "first_divergence": min((f for f in firsts if f is not None), default=None),
            "walk_mismatches": bad, "traced_rounds": len(rounds),
            "traced_same_as_untraced": traced.output_ids == res.output_ids}


# ---------------------------------------------------------------------------------------------- the CPU check


def generate_command(target: str, draft: str, messages: Sequence[str], *, budget: int, max_new_tokens: int,
                     dtype: str) -> list[str]:
    """The ``generate --json`` command line of one held-out set."""
    argv = [sys.executable, "-m", "ddtree_jax.generate", "--target", target, "--draft", draft, "--method", "ddtree",
            "--tree-budget", str(budget), "--max-new-tokens", str(max_new_tokens), "--dtype", dtype, "--json"]
    for m in messages:
        argv += ["--prompt", m]
    return argv


def by_position(lengths: Sequence[Sequence[int]], band: int = BAND) -> dict[str, dict]:
    """Rounds pooled by the band of ``band`` output tokens where each started ({"0-127": {mean_acceptance_length,
    rounds}, "128-255": ...}), from each sequence's acceptance lengths in order: acceptance early in an answer
    apart from later."""
    bands: dict[int, list[int]] = {}
    for seq in lengths:
        at = 0
        for a in seq:
            bands.setdefault(at // band, []).append(a)
            at += a
    return {f"{b * band}-{(b + 1) * band - 1}": {"mean_acceptance_length": round(float(np.mean(v)), 3),
                                                 "rounds": len(v)} for b, v in sorted(bands.items())}


def set_acceptance(report: dict) -> dict:
    """From ``generate --json``'s object: the pooled mean over every round, the mean of the prompts' means, the
    rounds and tokens behind them, and the rounds by output position (:func:`by_position`)."""
    results = report["results"]
    rounds = [a for r in results for a in r["acceptance_lengths"]]
    return {"mean_acceptance_length": round(float(np.mean(rounds)), 3) if rounds else None,
            "mean_of_prompts": round(float(np.mean([r["mean_acceptance_length"] for r in results
                                                    if r["mean_acceptance_length"] is not None])), 3),
            "rounds": len(rounds), "generated_tokens": sum(r["num_generated"] for r in results),
            "prompts": len(results), "by_output_position": by_position([r["acceptance_lengths"] for r in results])}


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m ddtree_jax.training.evaluate",
        description="Mean acceptance length of a drafter on the held-out prompt sets shipped in "
                    "ddtree_jax/data/prompts (questions a new user would type, never trained on): one "
                    "`python -m ddtree_jax.generate --json` per set, greedy, method ddtree. Prints one JSON object "
                    "on stdout: per set, the mean over every round of its prompts (mean_acceptance_length), the "
                    "mean of the prompts' means, the rounds by the band of 128 output tokens where they started "
                    "(by_output_position: pass --max-new-tokens 512 to see later bands), and the command that "
                    "measured it.")
    p.add_argument("--target", default="default", metavar="PATH",
                   help="target directory (default: SmolLM2-135M-Instruct, the default pair's target)")
    p.add_argument("--draft", default=None, metavar="PATH",
                   help="drafter directory (default: the drafter shipped with the package)")
    p.add_argument("--sets", default=",".join(P.HELD_OUT_SETS), metavar="NAME,...",
                   help=f"held-out sets to run (of {', '.join(P.HELD_OUT_SETS)}) (default: all)")
    p.add_argument("--tree-budget", type=cli.positive_int, default=BUDGET, help="ddtree budget (default: 64)")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=NEW_TOKENS,
                   help="tokens per prompt (default: 128)")
    p.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16", help="(default: bfloat16, as generate)")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from ddtree_jax import defaults

    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    bad = [s for s in sets if s not in P.HELD_OUT_SETS]
    if not sets or bad:
        raise cli.UsageError(f"unknown held-out set {', '.join(bad) or args.sets!r} "
                             f"(choose from {', '.join(P.HELD_OUT_SETS)})")
    target = defaults.target_path() if args.target == "default" else cli.existing_dir("--target", args.target)
    draft = cli.existing_dir("--draft", args.draft or defaults.draft_path())
    out: dict[str, Any] = {"target": target, "draft": draft, "tree_budget": args.tree_budget,
                           "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "sets": {}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), os.environ.get("PYTHONPATH")])))
    for name in sets:
        messages = P.held_out_set(name)
        cmd = generate_command(target, draft, messages, budget=args.tree_budget, max_new_tokens=args.max_new_tokens,
                               dtype=args.dtype)
        cli.info(f"{name}: {len(messages)} prompts, python -m ddtree_jax.generate ... --json")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no message)"])[-1].removeprefix("error: ")
            # bad input (a drafter directory without weights, ...) is the user's one line, anything else a failure
            raise (ValueError if proc.returncode == cli.EXIT_USAGE else RuntimeError)(
                f"generate failed on the {name} set: {last}")
        report = json.loads(proc.stdout)
        out["sets"][name] = {**set_acceptance(report), "decode_tokens_per_s": report["timing"]["decode_tokens_per_s"],
                             "command": shlex.join(["python", *cmd[1:cmd.index("--prompt")]])
                             + f" --prompt ... (each of ddtree_jax/data/prompts/{name}.json)"}
        cli.info(f"{name}: mean acceptance length {out['sets'][name]['mean_acceptance_length']}")
    with cli.stdout_to_stderr() as stdout:
        stdout.write(json.dumps(out, indent=2) + "\n")
    return cli.EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
