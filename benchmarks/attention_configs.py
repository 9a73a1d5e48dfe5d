"""The tree attention kernel's configurations at given shapes: every (compute warpgroups, splits) at key block 128
beside ``tree_attention.default_config``'s choice, timed on the GPU (docs/KERNELS.md, "Configuration").

    PYTHONPATH=. python benchmarks/attention_configs.py --shapes 1x512x72,1x2048x72,8x512x16 --json OUT.json

A shape is BATCHxPREFIXxT (T: the verify's tokens, padded to 8, budget + 1 rounded up; Qwen3's heads, 32 query and
8 KV, head_dim 128; the cache S = prefix + T rounded up to 8, as ``bench_kernels`` sizes it). Each config is timed by
``bench_kernels._time_kernel`` (CUPTI): ``kernel_us`` every kernel of the call (q's packing, the mask words, the kernel,
the split merge), ``pallas_us`` the Mosaic GPU kernel alone. Configs that would need more than three waves of CTAs or
more splits than key tiles are skipped; ``--deadline-s`` stops starting new ones (what was timed is written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddtree_jax import cli  # noqa: E402
from pallas_kernels import bench_kernels as bk, tree_attention as tat  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SPLITS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def shape(text: str) -> tuple[int, int, int]:
    try:
        b, prefix, t = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BATCHxPREFIXxT, e.g. 1x512x72, got {text!r}") from None
    if min(b, t) < 1 or prefix < 0:
        raise argparse.ArgumentTypeError(f"batch and T must be >= 1 and the prefix >= 0, got {text!r}")
    return b, prefix, t


def configs(b: int, s: int, t: int) -> list[tuple[int, int, int, int]]:
    """(wgs, 128, 2, splits) for one and two compute warpgroups, at most three waves of CTAs on the SMs."""
    rows, tiles, out = t * (HEADS // KV_HEADS), -(-s // 128), []
    for wgs in (1, 2):
        ctas = b * KV_HEADS * -(-rows // (tat._BQ * wgs))
        out += [(wgs, 128, 2, sp) for sp in SPLITS if sp <= tiles and ctas * sp <= 3 * tat._NUM_SMS]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", type=lambda x: [shape(s) for s in x.split(",")], default=[(1, 512, 72)],
                    help="comma-separated BATCHxPREFIXxT (default 1x512x72: a budget-64 verify over a 512 prefix)")
    ap.add_argument("--json", help="write {shape: {default, rows}} here after each shape")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="stop starting configs after this many seconds")
    ap.add_argument("--iters", type=cli.positive_int, default=12, help="timed calls per config (default 12)")
    args = ap.parse_args(argv)
    deadline, out = time.time() + args.deadline_s, {}
    for b, prefix, t in args.shapes:
        s = bk._round8(prefix + t)
        default = tat.default_config(b, t, HEADS, KV_HEADS, s, HEAD_DIM)
        sets = bk._shape_sets(prefix, t, b, n_sets=4 if prefix * b >= 8192 else 8)
        rows = []
        for cfg in [None] + configs(b, s, t):
            if time.time() > deadline:
                break
            r = bk._time_kernel(prefix, t, b, cfg, iters=args.iters, sets=sets)
            rows.append({"config": list(cfg or default), "default": cfg is None,
                         "kernel_us": round(r["kernel_us"], 2), "pallas_us": round(r["pallas_us"], 2)})
            print(f"{b}x{prefix}x{t} {rows[-1]}", flush=True)
        out[f"{b}x{prefix}x{t}"] = {"default": list(default), "rows": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        del sets
    return 0


if __name__ == "__main__":
    sys.exit(main())
