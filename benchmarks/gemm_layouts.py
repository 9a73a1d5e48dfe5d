"""The layer products at a few rows, in place in a stacked layer loop: which weight layout and GEMM library XLA
reads fastest, per matrix (docs/PERFORMANCE.md).

    PYTHONPATH=. python benchmarks/gemm_layouts.py --rows 8,16,72,264 --json OUT.json

For each Qwen3-8B / 4B layer matrix (q|k|v, o, gate|up, down), each row count and each layout of the stacked weights
(output-major [L, N, K], ``weight_layout.GPU_AR_LAYOUT``'s; input-major [L, K, N], ``weight_layout.GPU_LAYOUT``'s), one
``lax.scan`` over the model's 36 layers computes x [R, K] times each layer's matrix (each layer's slice read in place by
dynamic-slice fusion, as the decoder's layer loop does), compiled with ``decode.XLA_OPTIONS`` and with cuBLASLt on top.
Reports the GEMM kernels' device time per layer (CUPTI; the loop's other kernels left out) and the weight-read
bandwidth: 36 layers' weights never fit the L2, so every layer is read from HBM, as in a round. One row (``--rows 1``)
also times the two reductions a GEMV can be written as (a row reduction over output-major weights, ``model.linear``'s
form, and a column reduction over input-major ones), counting every kernel of the loop. ``--splits 2,4`` also times each
GEMM split over its contraction (split-K by hand: one batched GEMM of s partial products [s, R, N] in f32, then their
sum), counting every kernel, for products whose N alone gives cuBLAS too few tiles to fill the SMs."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax import decode  # noqa: E402
from ddtree_jax.shapes import SHAPES  # noqa: E402

GEMM_MARKS = ("nvjet", "gemm", "cublas", "splitk", "xmma", "cutlass")


def matrices(shape):
    """(name, N, K) of one layer's products, q|k|v and gate|up fused as the GPU layout fuses them."""
    d, hd = shape.hidden, shape.head_dim
    return [("qkv", (shape.heads + 2 * shape.kv_heads) * hd, d), ("o", d, shape.heads * hd),
            ("gate_up", 2 * shape.intermediate, d), ("down", d, shape.intermediate)]


def gemm_us(fn, args, iters, every_kernel=False):
    """Median per-call sum of the GEMM kernels' (``every_kernel``: all kernels') CUPTI durations (us), and their
    names."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    jax.block_until_ready(fn(*args))
    ext._cupti_init()
    try:
        jax.block_until_ready([fn(*args) for _ in range(iters)])
    finally:
        timings = ext._cupti_get_timings(True)
    per = len(timings) // iters
    if per * iters != len(timings):
        raise RuntimeError(f"{len(timings)} kernel timings for {iters} calls")
    calls, names = [], set()
    for i in range(iters):
        ks = timings[i * per:(i + 1) * per]
        gem = [(n, ms) for n, ms in ks if every_kernel or any(m in n.lower() for m in GEMM_MARKS)]
        names.update(n[:70] for n, _ in gem)
        calls.append(sum(ms for _, ms in gem))
    return float(np.median(calls)) * 1e3, sorted(names)


def run(args):
    options = {"base": dict(decode.XLA_OPTIONS), "cublaslt": {**decode.XLA_OPTIONS, "xla_gpu_enable_cublaslt": True}}
    rows_list = [int(r) for r in args.rows.split(",")]
    splits = [int(s) for s in args.splits.split(",") if s] if args.splits else []
    out = {"device": jax.devices()[0].device_kind, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "command": "python benchmarks/gemm_layouts.py " + " ".join(sys.argv[1:]), "rows": []}
    for model in args.models.split(","):
        shape = SHAPES[model]
        for name, n, k in [m for m in matrices(shape) if m[0] in args.matrices.split(",")]:
            layers = shape.layers
            key = jax.random.key(n * 7 + k)
            w_out = jax.jit(lambda kk: (jax.random.normal(kk, (layers, n, k), jnp.float32) * 0.02).astype(
                jnp.bfloat16))(key)
            w_in = jax.jit(lambda w: jnp.swapaxes(w, 1, 2))(w_out)
            jax.block_until_ready(w_in)
            nbytes = n * k * 2
            for rows in rows_list:
                x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)), jnp.bfloat16)
                ref = None
                forms = [("out-major", w_out, "rk,nk->rn"), ("in-major", w_in, "rk,kn->rn")]
                if rows == 1:  # what model.linear does with one row: a row reduction over output-major weights;
                    # against it, a column reduction over input-major ones (one XLA fusion either way)
                    forms = [("out-major-rowsum", w_out, "rowsum"), ("in-major-colsum", w_in, "colsum")] + forms
                if rows > 1:
                    forms += [(f"{lay}-split{sp}", w, f"split{sp}:{eq}") for sp in splits if k % sp == 0
                              for lay, w, eq in forms[:2]]
                for layout, w, eq in forms:
                    for opt_name, opts in options.items():
                        if (rows > 128 or rows == 1 or "split" in layout) and opt_name != "base":
                            continue

                        def layer_loop(x, w, eq=eq):
                            def body(c, wl):
                                if eq == "rowsum":
                                    y = jnp.sum(wl.astype(jnp.float32) * x.astype(jnp.float32), axis=-1)[None]
                                elif eq == "colsum":
                                    y = jnp.sum(wl.astype(jnp.float32) * x.reshape(-1, 1).astype(jnp.float32), axis=0)
                                    y = y[None]
                                elif eq.startswith("split"):  # s partial products over K slices, then their sum
                                    sp, form = eq[5:].split(":")
                                    sp, xs = int(sp), x.reshape(x.shape[0], int(sp), -1)
                                    ws = (wl.reshape(wl.shape[0], int(sp), -1) if form == "rk,nk->rn"
                                          else wl.reshape(int(sp), -1, wl.shape[-1]))
                                    part = "rsk,nsk->srn" if form == "rk,nk->rn" else "rsk,skn->srn"
                                    y = jnp.einsum(part, xs, ws, preferred_element_type=jnp.float32).sum(0)
                                else:
                                    y = jnp.einsum(eq, x, wl, preferred_element_type=jnp.float32)
                                return c, y.astype(x.dtype)
                            return jax.lax.scan(body, 0, w)[1]

                        f = jax.jit(layer_loop).lower(x, w).compile(opts)
                        y = f(x, w)
                        # same products whatever the layout or library (to bf16 rounding of f32 sums)
                        ref = y if ref is None else ref
                        err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))
                        us, kernels = gemm_us(f, (x, w), args.iters, every_kernel=rows == 1 or bool(splits))
                        row = {"model": model, "matrix": name, "n": n, "k": k, "rows": rows, "layout": layout,
                               "options": opt_name, "us_per_layer": us / layers,
                               "tbps": nbytes * layers / us / 1e6, "kernels": kernels, "max_abs_diff_vs_first": err}
                        out["rows"].append(row)
                        print(f"{model:9s} {name:8s} {rows:4d} rows {layout:16s} {opt_name:8s} "
                              f"{us / layers:7.2f} us/layer {row['tbps']:.2f} TB/s  {kernels[:2]}", flush=True)
            del w_out, w_in
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-8b,qwen3-4b", help="comma-separated names of ddtree_jax.shapes.SHAPES")
    p.add_argument("--rows", default="8,16,72,264", help="comma-separated row counts (264: a ddtree-256 verify)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per case")
    p.add_argument("--splits", default="", help="comma-separated split-K factors to time as well (e.g. 2,4); none "
                   "by default")
    p.add_argument("--matrices", default="qkv,o,gate_up,down", help="comma-separated matrices to time")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    out = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
