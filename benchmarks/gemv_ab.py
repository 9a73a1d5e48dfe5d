"""A/B of the few-row projection (AR's GEMV) over stacked layer weights under ``lax.scan``.

With stacked weights, XLA slices each layer's weights out of the stack; whether that slice is copied or fused
into the consumer decides whether an AR step reads the weights once or three times. This times one Qwen3-8B
layer's seven projections (q, k, v, o, gate, up, down), 36 layers, M rows, as:

  dot        jnp.einsum on [K, N] weights (what the model does)
  reduce_kn  f32 multiply + sum over K of [K, N] weights (a column reduction; can fuse the slice)
  reduce_nk  f32 multiply + sum over K of [N, K] weights, output [N, M] (a row reduction; can fuse the slice)
  unstacked  jnp.einsum on 36 separate arrays, unrolled (the reference: no slicing at all)

and prints ms per 36 layers and the weight-read bandwidth. XLA flags are per process: run it once per setting.

    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python benchmarks/gemv_ab.py --rows 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

SHAPES = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 12288), (4096, 12288), (12288, 4096)]


def project(kind: str, x, w):
    """x [M, K] bf16; w [K, N] (or [N, K] for reduce_nk) -> [M, N] bf16."""
    if kind in ("dot", "unstacked"):
        return jnp.einsum("mk,kn->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if kind == "reduce_kn":
        return jnp.sum(x[:, :, None].astype(jnp.float32) * w[None].astype(jnp.float32), axis=1).astype(x.dtype)
    if kind == "reduce_nk":
        y = jnp.sum(w[:, None, :].astype(jnp.float32) * x[None].astype(jnp.float32), axis=2)  # [N, M]
        return y.T.astype(x.dtype)
    raise ValueError(kind)


def layer(kind, x, ws):
    """x [M, 4096] -> x + a little of every projection's output (keeps the chain dependent, nothing hoisted)."""
    inputs = {4096: x, 12288: jnp.tile(x, (1, 3))}
    acc = jnp.zeros((x.shape[0], 4096), jnp.float32)
    for (k, n), w in zip(SHAPES, ws):
        y = project(kind, inputs[k], w).astype(jnp.float32)
        acc = acc + (y[:, :4096] if n >= 4096 else jnp.pad(y, ((0, 0), (0, 4096 - n))))
    return (x.astype(jnp.float32) + 1e-3 * acc).astype(x.dtype)


def build(kind: str, layers: int, key):
    ws = []
    for i, (k, n) in enumerate(SHAPES):
        shape = (n, k) if kind == "reduce_nk" else (k, n)
        w = jax.random.normal(jax.random.fold_in(key, i), (layers, *shape), jnp.bfloat16) * 0.02
        ws.append([w[j] for j in range(layers)] if kind == "unstacked" else w)
    return ws


def step_fn(kind: str, layers: int):
    if kind == "unstacked":
        def f(x, ws):
            for j in range(layers):
                x = layer(kind, x, [w[j] for w in ws])
            return x
    else:
        def f(x, ws):
            x, _ = jax.lax.scan(lambda x, w: (layer(kind, x, w), None), x, ws)
            return x
    return jax.jit(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8")
    p.add_argument("--kinds", default="dot,reduce_kn,reduce_nk,unstacked")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out = []
    nbytes = a.layers * sum(k * n for k, n in SHAPES) * 2
    for kind in a.kinds.split(","):
        ws = build(kind, a.layers, jax.random.PRNGKey(0))
        f = step_fn(kind, a.layers)
        for m in (int(r) for r in a.rows.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(m), (m, 4096), jnp.bfloat16)
            t0 = time.time()
            y = f(x, ws).block_until_ready()
            cs = time.time() - t0
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    y = f(y, ws)
                y.block_until_ready()
                ts.append((time.perf_counter() - t0) / a.iters * 1e3)
            ms = sorted(ts)[1]
            rec = {"kind": kind, "rows": m, "ms": ms, "tbps": nbytes / ms / 1e9, "compile_s": cs,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": jax.devices()[0].device_kind}
            print(json.dumps(rec), flush=True)
            out.append(rec)
        del ws
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
