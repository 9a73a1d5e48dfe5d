"""Reproduce the twenty-second run's fault: an input-major drafter gives wrong rounds on the GPU (benchmarks/PERF.md,
twenty-second run, item 5; "For the lead" item 15). ``decode.device_layout`` refuses such a drafter on GPU, so this
script lays the drafter out itself and keeps ``decode.generate`` from laying it out again.

    PYTHONPATH=. python benchmarks/drafter_layout_fault.py [--draft-layout stacked-fused] [--attention xla]

The fixture pair (float32), its first prompt, dflash and ddtree 16: prints, per method, whether the tokens are the
reference's, or the decode-fault error. On CPU (and on the H200 with an output-major drafter) every row matches; on
the H200 with an input-major drafter both faulted (twenty-second run)."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402

from ddtree_jax import decode, weights  # noqa: E402
from ddtree_jax import params as params_lib  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "fixtures",
                        "ddtree_reference")


def lay_drafter(params, layout: str):
    """The drafter in ``layout`` (stacked only) without device_layout's GPU check."""
    params = params_lib.output_major(params) if "out-major" in layout else params_lib.input_major(params)
    return params_lib.fuse_projections(params) if layout.endswith("-fused") else params


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft-layout", default="stacked-fused",
                   choices=["stacked", "stacked-fused", "stacked-out-major", "stacked-out-major-fused"])
    p.add_argument("--attention", default="auto", help="decode.GenerateOptions.attention (auto, xla, pallas-inplace)")
    args = p.parse_args(argv)
    target = weights.load_target(os.path.join(FIXTURES, "target"), dtype=jnp.float32)
    dcfg, dparams = weights.load_draft(os.path.join(FIXTURES, "draft"), dtype=jnp.float32)
    draft = (dcfg, lay_drafter(dparams, args.draft_layout))
    run = json.load(open(os.path.join(FIXTURES, "generate.json")))["runs"][0]
    own = decode.device_layout

    def target_only(params, backend=None, layout=None, method=None):  # the drafter stays as laid out above
        return params if isinstance(params, params_lib.DraftParams) else own(params, backend, layout, method)

    decode.device_layout = target_only
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
