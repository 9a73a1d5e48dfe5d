"""The twenty-second run's fault and its cause (benchmarks/PERF.md, twenty-second and twenty-third runs): on the GPU an
input-major drafter gave wrong round statistics. Traced in the twenty-third run to prefill's donated buffers: jax
paired them with outputs after pruning the arguments prefill never reads, shifting the pairs, and XLA on the H200
returned n_rounds = prompt_len. ``decode.donating_jit`` (keep_unused) avoids the shifted pairing; this script stays as
the check. It lays the drafter out itself and keeps ``decode.generate`` from laying it out again.

    PYTHONPATH=. python benchmarks/drafter_layout_fault.py [--draft-layout stacked-fused] [--attention xla]
        [--xla KEY=VALUE ...] [--xla-drop KEY ...] [--stages [--hlo DIR]]

The fixture pair (float32), its first prompt, dflash and ddtree 16: prints, per method, whether the tokens are the
reference's, or the decode-fault error (every row matches on CPU, and on the H200 since the fix; before it the H200
faulted with an input-major drafter unless ``xla_gpu_enable_dynamic_slice_fusion`` was off). ``--xla`` / ``--xla-drop``
change ``decode.XLA_OPTIONS`` (every compile of the rounds and prefill) for the run. ``--stages`` compares the drafter
as laid out against the output-major fused one on the same inputs: the draft cache and the scalars after prefill, the
first round's draft logits, then the rounds one at a time (ddtree 16), printing the largest differences and the first
round whose statistics are impossible; ``--hlo DIR`` also writes the compiled prefill and run_rounds (their
input_output_alias line shows which buffer each output takes)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ddtree_jax import decode, weights  # noqa: E402
from ddtree_jax import params as params_lib  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                        "ddtree_reference")
REFERENCE_LAYOUT = "stacked-out-major-fused"


def lay_drafter(params, layout: str):
    """The drafter in ``layout`` (stacked only), as given: decode.device_layout would lay it out output-major on GPU."""
    params = params_lib.output_major(params) if "out-major" in layout else params_lib.input_major(params)
    return params_lib.fuse_projections(params) if layout.endswith("-fused") else params


def option_value(text: str):
    """An XLA option's value from the command line: true/false, an integer, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def host(state: decode.State) -> decode.State:
    """The state on the host (its PRNG keys dropped): what the comparisons read, safe from donation."""
    return jax.tree.map(np.asarray, dataclasses.replace(state, keys=None))


def stages(target, dcfg, dparams, layout: str, attention: str, prompt: list[int], rounds: int, hlo: str | None):
    """Stage by stage, the drafter in ``layout`` against REFERENCE_LAYOUT on the same inputs (ddtree 16)."""
    tcfg, tparams = target
    tparams = decode.device_layout(tparams, method="ddtree")
    opts = decode.GenerateOptions(method="ddtree", tree_budget=16, max_new_tokens=rounds, attention=attention)
    spec = decode.make_spec(tcfg, dcfg, opts)
    p_pad, capacity, out_len = decode.layout(spec, [len(prompt)], opts.max_new_tokens)
    tokens = jnp.asarray(np.pad(np.asarray([prompt], np.int32), [(0, 0), (0, p_pad - len(prompt))]))
    print(f"stages: attention {spec.attention}, verify rows {spec.verify_len}, XLA options {decode.XLA_OPTIONS}",
          flush=True)

    def fresh():
        return decode.init_state(spec, [len(prompt)], [opts], capacity, out_len, tparams.embed.dtype)

    drafters = {name: lay_drafter(dparams, name) for name in (REFERENCE_LAYOUT, layout)}
    prefilled, logits, per_round = {}, {}, {}
    draft_fn = jax.jit(decode.draft_logits, static_argnums=0)
    for name, dp in drafters.items():
        prefill = decode.compiled(decode.prefill, spec, tparams, dp, fresh(), tokens)
        state = prefill(tparams, dp, fresh(), tokens)
        prefilled[name] = host(state)
        if hlo:
            os.makedirs(hlo, exist_ok=True)
            with open(os.path.join(hlo, f"prefill_{name}.txt"), "w") as f:
                f.write(prefill.as_text())
        lg, _ = decode.compiled(draft_fn, spec, tparams, dp, state)(tparams, dp, state)
        logits[name] = np.asarray(lg)
        one = jnp.int32(1)
        step = decode.compiled(decode.run_rounds, spec, tparams, dp, state, one)
        if hlo:
            with open(os.path.join(hlo, f"run_rounds_{name}.txt"), "w") as f:
                f.write(step.as_text())
        seen = []
        for _ in range(rounds):
            state = step(tparams, dp, state, one)
            seen.append((int(state.n_out[0]), int(state.n_rounds[0]), int(state.accept_hist[0, len(seen)]),
                         int(state.dcache.length[0]), int(state.cache.length[0])))
            if bool(state.done[0]):
                break
        per_round[name] = (seen, host(state))
    ref, got = prefilled[REFERENCE_LAYOUT], prefilled[layout]
    n = len(prompt)
    print(f"prefill: draft cache k {max_diff(ref.dcache.k[:, :, :n], got.dcache.k[:, :, :n]):.3g}, "
          f"v {max_diff(ref.dcache.v[:, :, :n], got.dcache.v[:, :, :n]):.3g}; first token {int(ref.bonus[0])} / "
          f"{int(got.bonus[0])}", flush=True)
    for name, st in prefilled.items():
        print(f"{name} after prefill: " + ", ".join(f"{k} {getattr(st, k).tolist()}" for k in (
            "n_rounds", "n_out", "prompt_len", "limit", "done", "stop_at", "context_count", "bonus")), flush=True)
    print(f"round 1 draft logits: {max_diff(logits[REFERENCE_LAYOUT], logits[layout]):.3g} (scale "
          f"{float(np.max(np.abs(logits[REFERENCE_LAYOUT]))):.3g}); argmax equal per depth: "
          f"{(logits[REFERENCE_LAYOUT].argmax(-1) == logits[layout].argmax(-1)).astype(int).tolist()}", flush=True)
    for name in drafters:
        seen, final = per_round[name]
        # each round commits its accepted path (1..path_len nodes); the draft cache appends the previous round's path
        bounds = [(n + 1, n)] + [(r[0], r[4]) for r in seen[:-1]]  # (n_out, target length) before each round
        bad = next((i for i, ((n_out, _, length, dl, tl), (n_out0, tl0)) in enumerate(zip(seen, bounds))
                    if not 1 <= length <= spec.path_len or n_out - n_out0 != length or tl - tl0 != length
                    or dl != tl0), None)
        print(f"{name}: rounds (n_out, n_rounds, accepted, draft length, target length) {seen}", flush=True)
        print(f"{name}: first impossible round {bad}; tokens {final.out[0, n:final.n_out[0]].tolist()}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft-layout", default="stacked-fused",
                   choices=["stacked", "stacked-fused", "stacked-out-major", "stacked-out-major-fused"])
    p.add_argument("--attention", default="auto", help="decode.GenerateOptions.attention (auto, xla, pallas-inplace)")
    p.add_argument("--xla", action="append", default=[], metavar="KEY=VALUE",
                   help="set an XLA option of decode.XLA_OPTIONS for this run (repeatable)")
    p.add_argument("--xla-drop", action="append", default=[], metavar="KEY",
                   help="remove an option from decode.XLA_OPTIONS for this run (repeatable)")
    p.add_argument("--stages", action="store_true", help="compare the stages against the output-major drafter")
    p.add_argument("--hlo", metavar="DIR", help="with --stages: write the compiled prefill and run_rounds HLO there")
    args = p.parse_args(argv)
    options = {k: v for k, v in decode.XLA_OPTIONS.items() if k not in args.xla_drop}
    for item in args.xla:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--xla takes KEY=VALUE, got {item!r}")
        options[key] = option_value(value)
    decode.XLA_OPTIONS = options  # decode.compiled reads the module's options at each compile
    target = weights.load_target(os.path.join(FIXTURES, "target"), dtype=jnp.float32)
    dcfg, dparams = weights.load_draft(os.path.join(FIXTURES, "draft"), dtype=jnp.float32)
    run = json.load(open(os.path.join(FIXTURES, "generate.json")))["runs"][0]
    if args.stages:
        return stages(target, dcfg, dparams, args.draft_layout, args.attention, run["prompt"], run["max_new_tokens"],
                      args.hlo)
    draft = (dcfg, lay_drafter(dparams, args.draft_layout))
    own = decode.device_layout

    def target_only(params, backend=None, layout=None, method=None):  # the drafter stays as laid out above
        return params if isinstance(params, params_lib.DraftParams) else own(params, backend, layout, method)

    decode.device_layout = target_only
    print(f"XLA options {decode.XLA_OPTIONS}", flush=True)
    for method, budget in (("dflash", 1), ("ddtree", 16)):
        opts = decode.GenerateOptions(method=method, max_new_tokens=run["max_new_tokens"], tree_budget=budget,
                                      attention=args.attention)
        try:
            res = decode.generate(target, [run["prompt"]], opts, draft=draft)
            same = res.output_ids[0] == run["ar"][: len(res.output_ids[0])]
            print(f"{method}: {'the reference tokens' if same else 'OTHER TOKENS'}", flush=True)
        except RuntimeError as e:
            print(f"{method}: {str(e)[:160]}", flush=True)


if __name__ == "__main__":
    main()
