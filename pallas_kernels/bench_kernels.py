"""Validate and benchmark the Pallas kernels on a GPU (one script, several stages, JSON out).

    PYTHONPATH=. python -m pallas_kernels.bench_kernels --stages smoke,validate,sweep,bench,accept --out DIR

Stages
  smoke     one small call of tree_attention in each of SMOKE_CONFIGS and of tree_accept (compiles; catches a
            hang early when run under `timeout`)
  validate  tree_attention vs the reference computed in f32 (highest precision) on upcast inputs, over
            a grid of prefixes (0..32k, ragged), budgets (T 1..1025), batch 1..16, head_dim 64/128,
            GQA 1..8, random / chain / star trees; max abs error, relative L2 error, NaN, determinism.
            tree_accept vs its reference (exact) on random trees and the golden fixtures.
  sweep     tree_attention's default config (wgs, block_kv, stages, splits) against the other warpgroup count
            and half and twice the splits, at a few shapes
  bench     Qwen3-8B heads (32 q, 8 kv, hd 128), batch 1, prefixes 1k..32k, budgets 16..512: kernel
            vs the XLA reference path vs jax.nn.dot_product_attention with a dense mask; device time
            (CUPTI, sum of kernel durations), K/V bandwidth and its share of the measured copy
            roofline, and the share of the two-number floor max(bytes / copy BW, flops / matmul rate)
  accept    tree_accept against its XLA form (batch 1 and 8, 65..1025 nodes), and the walk with the cache commit at
            batch 1, budget 256, over a Qwen3-8B cache
  decode    decode_attention (one query row per sequence, the stacked cache in place) at Qwen3-8B's heads, batch 1
            and 8, prefixes 0..32k: error against the f32 reference, device time against the tree kernel at T = 1,
            at 1-32 splits, and for the models grid's cache at batch 1 at other tilings (block, warps, stages)
  qkv       qkv_write (q/k norm, RoPE and the K/V cache write) at Qwen3-8B's heads, batch x rows 1x1 .. 8x72:
            against its per-operation-rounded definition computed in numpy (values off, in bf16 ulps), slots
            untouched, and device time per layer against XLA's form (split, norms, RoPE, two scatters)
Each stage writes DIR/kernels_<stage>.json as it goes and prints a line per item.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys
import time

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels import tree_accept as ta
from pallas_kernels import tree_attention as tat
from pallas_kernels.inputs import accept_inputs, attention_inputs, qkv_write_inputs

QWEN3_8B = dict(h=32, kv=8, hd=128)
LAST_BREAKDOWN: list = []  # (kernel name, median us) of the last CUPTI measurement
KW: dict = {}  # extra kernel kwargs ({"interpret": True} under --dry-run, a CPU rehearsal of the script)


def reference_f32(q, k, v, p, bits):
    with jax.default_matmul_precision("highest"):
        f = jax.jit(tat.tree_attention_reference)
        return f(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), p, bits)


# ------------------------------------------------------------------------------------------ timing
def device_time_us(fn, arg_sets, iters=20):
    """Median per-call device time (sum of the kernels' CUPTI durations), rotating over arg_sets."""
    jax.block_until_ready(fn(*arg_sets[0]))
    for a in arg_sets:
        jax.block_until_ready(fn(*a))
    try:
        from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

        ext = mosaic_gpu_lib._mosaic_gpu_ext
        ext._cupti_init()
        try:
            outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(iters)]
            jax.block_until_ready(outs)
        finally:
            timings = ext._cupti_get_timings(True)
        per = len(timings) // iters
        if per * iters != len(timings) or per == 0:
            raise RuntimeError(f"{len(timings)} kernel timings for {iters} calls")
        calls = [sum(ms for _, ms in timings[i * per : (i + 1) * per]) for i in range(iters)]
        LAST_BREAKDOWN[:] = [(name[:60], float(np.median([timings[i * per + j][1] for i in range(iters)])) * 1e3)
                             for j, (name, _) in enumerate(timings[:per])]
        return float(np.median(calls)) * 1e3, "cupti", per
    except Exception as e:  # noqa: BLE001  fall back to wall clock over back-to-back calls
        print(f"  (cupti unavailable: {e!r:.120}; wall clock)")
        jax.block_until_ready(fn(*arg_sets[0]))
        t0 = time.perf_counter()
        outs = [fn(*arg_sets[i % len(arg_sets)]) for i in range(iters)]
        jax.block_until_ready(outs)
        return (time.perf_counter() - t0) / iters * 1e6, "wall", None


def measure_copy_gbps() -> dict:
    n = (1 << 30) if not KW else (1 << 20)  # 1 Gi bf16 elements = 2 GiB read + 2 GiB written
    x = jax.random.normal(jax.random.key(1), (n,), jnp.float32).astype(jnp.bfloat16)
    variants = {
        "neg_bf16": lambda a: -a,
        "xor_u32": lambda a: jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(a.reshape(-1, 2), jnp.uint32) ^ jnp.uint32(0x80008000), jnp.bfloat16
        ).reshape(-1),
        "neg_2d": lambda a: -a.reshape(-1, 4096),
    }
    res = {}
    for name, fn in variants.items():
        try:
            us, how, _ = device_time_us(jax.jit(fn), [(x,)], iters=10)
            res[name] = 4 * n / us / 1e3
        except Exception as e:  # noqa: BLE001
            res[name + "_error"] = repr(e)[:200]
    del x
    best = max((v, k) for k, v in res.items() if not k.endswith("_error"))
    return {"bytes": 4 * n, "gbps": best[0], "best": best[1], "variants_gbps": res, "timer": how}


def measure_matmul_tflops() -> dict:
    n = 8192 if not KW else 256
    a = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (n, n), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    us, how, _ = device_time_us(f, [(a, b)], iters=10)
    return {"n": n, "time_us": us, "tflops": 2 * n**3 / us / 1e6, "timer": how}


# ------------------------------------------------------------------------------------------ stages
class Recorder:
    def __init__(self, out_dir, stage, meta):
        self.path = os.path.join(out_dir, f"kernels_{stage}.json")
        self.data = {"stage": stage, **meta, "rows": []}

    def add(self, row):
        self.data["rows"].append(row)
        self.flush()

    def flush(self):
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


def _err(out, ref):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    return {
        "max_abs_err": float(np.nanmax(np.abs(out - ref))),
        "rel_l2_err": float(np.linalg.norm(out - ref) / np.linalg.norm(ref)),
        "nan": bool(np.isnan(out).any()),
    }


SMOKE_CONFIGS = {  # name -> (wgs, block_kv, stages, splits): two warpgroups run ping-pong; splits > 1 stage their
    "2wg": (2, 128, 2, 1),  # partials in the K/V ring
    "2wg_split": (2, 128, 2, 3),
    "2wg_block64_split": (2, 64, 3, 3),
    "1wg": (1, 64, 3, 1),
    "1wg_split": (1, 128, 2, 2),
}


def stage_smoke(rec, args):
    q, k, v, p, bits = attention_inputs(0, 2, 33, 8, 2, 304, 128, [100, 37])
    ref = reference_f32(q, k, v, p, bits)
    for name, cfg in SMOKE_CONFIGS.items():
        t0 = time.time()
        try:
            out = jax.block_until_ready(tat.tree_attention(q, k, v, p, bits, config=cfg, **KW))
            row = {"kernel": "tree_attention", "name": name, "config": cfg, "s": time.time() - t0, **_err(out, ref)}
            row["ok"] = (not row["nan"]) and row["rel_l2_err"] < 1e-2
        except Exception as e:  # noqa: BLE001
            row = {"kernel": "tree_attention", "name": name, "config": cfg, "error": repr(e)[:1000], "ok": False}
        rec.add(row)
        print("smoke attention", row)
    rng = np.random.default_rng(0)
    tok, par, tgt = accept_inputs(rng, 3, 65, "random", 15)
    out = ta.tree_accept(tok, par, tgt, max_depth=15, **KW)
    ref = ta.tree_accept_reference(tok, par, tgt, max_depth=15)
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(out, ref))
    rec.add({"kernel": "tree_accept", "equal": same})
    print("smoke accept equal", same)


VALIDATION_CASES = [
    # (b, t, h, kv, hd, prefixes, tree kind, config or None)
    (1, 1, 32, 8, 128, [31999], "chain", None),  # AR step, long prefix
    (2, 2, 8, 8, 64, [0, 4097], "random", None),  # budget 1, G = 1, empty prefix
    (16, 17, 32, 8, 128, "ragged32k", "random", None),  # batch 16 ragged up to 32k
    (16, 17, 16, 4, 64, "ragged8k", "chain", (2, 64, 3, 8)),
    (4, 65, 32, 8, 128, "ragged8k", "random", None),
    (4, 65, 32, 8, 128, "ragged8k", "star", (2, 128, 2, 1)),
    (3, 65, 4, 4, 64, [0, 5, 4093], "random", (1, 64, 3, 4)),
    (2, 129, 16, 2, 128, [1, 2048], "random", None),  # G = 8
    (2, 257, 32, 8, 128, [8191, 777], "random", None),
    (2, 257, 16, 8, 64, [8, 16000], "chain", (2, 64, 3, 2)),
    (1, 513, 32, 8, 128, [32000], "random", None),
    (2, 513, 8, 4, 64, [100, 3000], "star", None),
    (1, 1025, 8, 1, 128, [32768], "random", None),  # T = 1025, G = 8
    (1, 1025, 4, 2, 64, [0], "chain", (2, 128, 2, 1)),  # depth-1024 chain, empty prefix
]


def _round8(n):
    return -(-n // 8) * 8


def _prefixes(spec, b, rng):
    if isinstance(spec, list):
        return spec
    top = {"ragged32k": 32768, "ragged8k": 8192}[spec]
    return [int(x) for x in rng.integers(0, top, size=b)]


def stage_validate(rec, args, deadline):
    rng = np.random.default_rng(7)
    for i, (b, t, h, kv, hd, pspec, kind, cfg) in enumerate(VALIDATION_CASES):
        if args.cases and i not in args.cases:
            continue
        if time.time() > deadline:
            rec.add({"case": i, "skipped": "deadline"})
            continue
        plens = _prefixes(pspec, b, rng)
        # S a multiple of 8 (the in-place path): the last tile reads past the end (TMA zero fill).
        # Case 1 keeps an odd S: the padded path.
        s = max(plens) + t if i == 1 else _round8(max(plens) + t)
        row = {"case": i, "b": b, "t": t, "h": h, "kv": kv, "hd": hd, "s": s, "prefixes": plens,
               "tree": kind, "config": cfg or list(tat.default_config(b, t, h, kv, s, hd))}
        try:
            q, k, v, p, bits = attention_inputs(100 + i, b, t, h, kv, s, hd, plens, kind)
            f = jax.jit(functools.partial(tat.tree_attention, config=cfg, **KW))
            out = jax.block_until_ready(f(q, k, v, p, bits))
            again = jax.block_until_ready(f(q, k, v, p, bits))
            ref = reference_f32(q, k, v, p, bits)
            row.update(_err(out, ref))
            row["deterministic"] = bool(jnp.array_equal(out, again))
            xla = jax.jit(tat.tree_attention_reference)(q, k, v, p, bits)  # the bf16 XLA path, for scale
            row["xla_bf16"] = _err(xla, ref)
            row["ok"] = (not row["nan"]) and row["rel_l2_err"] < 1e-2 and row["deterministic"]
            del ref, xla
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:2000]
            row["ok"] = False
        rec.add(row)
        print("validate", {k: row.get(k) for k in ("case", "b", "t", "h", "kv", "hd", "config", "max_abs_err",
                                                  "rel_l2_err", "deterministic", "ok", "error")})
    # tree_accept: random batches (distinct sibling tokens) and the golden fixtures
    rows = []
    for n1, kind, md in [(257, "random", 15), (257, "chain", 256), (1025, "star", 15), (65, "random", 7),
                         (2, "chain", 1), (1025, "random", 31)]:
        tok, par, tgt = accept_inputs(rng, 16, n1, kind, md)
        out = ta.tree_accept(tok, par, tgt, max_depth=md, **KW)
        ref = ta.tree_accept_reference(tok, par, tgt, max_depth=md)
        rows.append({"n1": n1, "tree": kind, "max_depth": md,
                     "equal": all(bool(jnp.array_equal(a, b)) for a, b in zip(out, ref)),
                     "mean_len": float(jnp.mean(out[1]))})
    rows.append({"fixtures": golden_accept_check()})
    rec.add({"kernel": "tree_accept", "cases": rows})
    print("validate accept", rows)


def golden_accept_check() -> dict:
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "ddtree_reference", "tree_walk.npz")
    d = np.load(path)
    n = len([k for k in d.files if k.startswith("accepted_")])
    n1 = max(len(d[f"parents_{i}"]) for i in range(n))
    toks, pars, tgts = [], [], []
    for i in range(n):
        m = len(d[f"parents_{i}"])
        toks.append(np.pad(np.concatenate([[-1], d[f"node_token_ids_{i}"]]), (0, n1 - m), constant_values=-1))
        pars.append(np.pad(d[f"parents_{i}"], (0, n1 - m), constant_values=0))
        tgts.append(np.pad(d[f"posterior_{i}"], (0, n1 - m), constant_values=-2))
    args = [jnp.asarray(np.stack(x).astype(np.int32)) for x in (toks, pars, tgts)]
    path_k, len_k, bonus_k = ta.tree_accept(*args, max_depth=15, **KW)
    good = 0
    for i in range(n):
        acc = d[f"accepted_{i}"]
        good += int(len_k[i]) == len(acc) and list(np.asarray(path_k[i, : len(acc)])) == list(acc) and int(
            bonus_k[i]) == int(d[f"next_token_{i}"])
    return {"cases": n, "equal": good}


SWEEP_SHAPES = [(8192, 16), (8192, 64), (8192, 256), (32768, 64)]
SWEEP_CONFIGS: list = []  # extra fixed configs to time at every sweep shape


def stage_sweep(rec, args, deadline):
    for prefix, budget in SWEEP_SHAPES:
        t = budget + 1
        sets = _shape_sets(prefix, t, 1)
        d = tat.default_config(1, t, QWEN3_8B["h"], QWEN3_8B["kv"], _round8(prefix + t), QWEN3_8B["hd"])
        around = [(3 - d[0],) + d[1:], d[:3] + (max(1, d[3] // 2),), d[:3] + (d[3] * 2,)]  # other wgs, splits
        for cfg in [None] + around + SWEEP_CONFIGS:
            if time.time() > deadline:
                break
            row = {"prefix": prefix, "budget": budget, "config": cfg}
            try:
                row.update(_time_kernel(prefix, t, 1, cfg, iters=10, sets=sets))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:300]
            rec.add(row)
            print("sweep", row)


def _shape_sets(prefix, t, b, n_sets=None):
    h, kv, hd = QWEN3_8B["h"], QWEN3_8B["kv"], QWEN3_8B["hd"]
    s = _round8(prefix + t)  # a cache capacity, as the model allocates it: a multiple of 8
    kv_bytes = 2 * b * (prefix + t) * kv * hd * 2  # the visible K/V, each byte read once
    n_sets = n_sets or max(2, min(64, math.ceil(240e6 / kv_bytes)))  # rotate past the 60 MB L2
    sets = [attention_inputs(1000 + i, b, t, h, kv, s, hd, [prefix] * b) for i in range(n_sets)]
    flops = 4 * b * h * t * (prefix + t) * hd  # QK^T and PV over the visible slots
    return sets, kv_bytes, flops


def _time_kernel(prefix, t, b, cfg, iters=20, sets=None):
    sets, kv_bytes, flops = sets or _shape_sets(prefix, t, b)
    f = jax.jit(functools.partial(tat.tree_attention, config=cfg, **KW))
    us, how, nk = device_time_us(f, sets, max(iters, len(sets)))
    return {"kernel_us": us, "timer": how, "launches": nk, "kv_gbps": kv_bytes / us / 1e3,
            "breakdown_us": list(LAST_BREAKDOWN), "pallas_us": sum(u for n, u in LAST_BREAKDOWN if "mosaic" in n)}


BENCH_PREFIXES = [1024, 4096, 8192, 16384, 32768]
BENCH_BUDGETS = [16, 64, 128, 256, 512]
ACCEPT_SHAPES = [(1, 257, 15), (1, 65, 15), (8, 257, 15), (1, 1025, 15)]


def stage_bench(rec, args, deadline):
    copy = measure_copy_gbps()
    mm = measure_matmul_tflops()
    rec.data["copy_roofline"] = copy
    rec.data["matmul_roofline"] = mm
    print("copy", copy, "matmul", mm)
    prefixes, budgets = BENCH_PREFIXES, BENCH_BUDGETS
    if args.quick:
        prefixes, budgets = [8192, 32768], [16, 64, 256]
    for prefix in prefixes:
        for budget in budgets:
            if time.time() > deadline:
                rec.add({"prefix": prefix, "budget": budget, "skipped": "deadline"})
                continue
            t = budget + 1
            b = 1
            sets, kv_bytes, flops = _shape_sets(prefix, t, b)
            floor_us = max(kv_bytes / copy["gbps"] / 1e3, flops / mm["tflops"] / 1e6)
            row = {"prefix": prefix, "budget": budget, "batch": b, "kv_bytes": kv_bytes, "flops": flops,
                   "hbm_floor_us": kv_bytes / copy["gbps"] / 1e3, "mma_floor_us": flops / mm["tflops"] / 1e6,
                   "floor_us": floor_us, "n_sets": len(sets),
                   "config": list(tat.default_config(b, t, 32, 8, _round8(prefix + t), 128))}
            try:
                row.update(_time_kernel(prefix, t, b, None, sets=(sets, kv_bytes, flops)))
                row["hbm_share"] = kv_bytes / row["kernel_us"] / 1e3 / copy["gbps"]
                row["floor_share"] = floor_us / row["kernel_us"]
            except Exception as e:  # noqa: BLE001
                row["kernel_error"] = repr(e)[:300]
            if prefix >= args.baselines_from:
                try:
                    us, _, _ = device_time_us(jax.jit(tat.tree_attention_reference), sets, max(10, len(sets)))
                    row["xla_us"] = us
                except Exception as e:  # noqa: BLE001
                    row["xla_error"] = repr(e)[:300]
                row.update(_time_dpa(sets))
            if "kernel_us" in row:
                for name in ("xla_us", "dpa_us"):
                    if name in row:
                        row["speedup_vs_" + name[:-3]] = row[name] / row["kernel_us"]
            rec.add(row)
            print("bench", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
            del sets


def _time_dpa(sets):
    """jax.nn.dot_product_attention with a dense [B, 1, T, S] mask (built outside the timing)."""
    masked = []
    for q, k, v, p, bits in sets:
        mask = tat.visibility(p, bits, q.shape[1], k.shape[1])[:, None]
        masked.append((q, k, v, mask))
    out = {}
    for impl in ("cudnn", None):
        try:
            g = jax.jit(lambda q, k, v, m, impl=impl: jax.nn.dot_product_attention(q, k, v, mask=m,
                                                                                  implementation=impl))
            us, _, _ = device_time_us(g, masked, max(10, len(masked)))
            out.update({"dpa_us": us, "dpa_impl": impl or "xla"})
            break
        except Exception as e:  # noqa: BLE001
            out["dpa_error_" + (impl or "xla")] = repr(e)[:200]
    return out


def stage_accept(rec, args, deadline):
    rng = np.random.default_rng(3)
    for b, n1, md in ACCEPT_SHAPES:
        sets = [accept_inputs(rng, b, n1, "random", md) for _ in range(3)]
        row = {"batch": b, "n1": n1, "max_depth": md}
        for name, fn in (("kernel", functools.partial(ta.tree_accept, **KW)), ("xla", ta.tree_accept_reference)):
            f = jax.jit(functools.partial(fn, max_depth=md))
            row[name + "_us"], _, row[name + "_launches"] = device_time_us(f, sets, 20)
        rec.add(row)
        print("accept", row)
    # walk + commit (Qwen3-8B cache: 36 layers, 8 kv heads, hd 128, 8k prefix), batch 1, budget 256
    try:
        from ddtree_jax import cache as kvcache

        layers, cap, prefix, n1, md = (36, 8192 + 512, 8192, 257, 15) if not KW else (2, 128, 40, 65, 7)
        c = kvcache.KVCache(
            jax.random.normal(jax.random.key(5), (layers, 1, cap, 8, 128), jnp.float32).astype(jnp.bfloat16),
            jax.random.normal(jax.random.key(6), (layers, 1, cap, 8, 128), jnp.float32).astype(jnp.bfloat16),
            jnp.full((1,), prefix, jnp.int32))
        sets = [accept_inputs(rng, 1, n1, "random", md) for _ in range(3)]
        for name, fn in (("kernel", functools.partial(ta.tree_accept, **KW)), ("xla", ta.tree_accept_reference)):
            def step(c, tok, par, tgt, fn=fn):
                path, length, bonus = fn(tok, par, tgt, max_depth=md)
                c = kvcache.compact(c, path, length)
                return kvcache.KVCache(c.k, c.v, c.length - length), bonus  # same prefix every call

            f = jax.jit(step, donate_argnums=0)
            state = {"c": c}

            def call(tok, par, tgt, f=f, state=state):
                state["c"], bonus = f(state["c"], tok, par, tgt)
                return bonus

            us, _, nk = device_time_us(call, sets, 20)
            c = state["c"]
            rec.add({"walk_commit": name, "batch": 1, "n1": n1, "layers": layers, "us": us, "launches": nk})
            print("walk+commit", name, us, nk)
    except Exception as e:  # noqa: BLE001
        rec.add({"walk_commit_error": repr(e)[:500]})


# decode_attention's (block, warps, stages) timed where the cache has the models grid's 2,880 slots at batch 1
DECODE_TILINGS = [(64, 4, 2), (64, 4, 3), (64, 8, 3), (64, 2, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
                  (32, 4, 3), (256, 8, 2)]
DECODE_TILING_SLOTS = 2880
# Layers of the stacked caches, timed one after another so that a layer's K/V has left the L2 (50 MB) before it is
# read again, as in a model's step (one layer timed alone reads its K/V from the L2: a shorter time than a model sees).
DECODE_LAYERS = 8
# (batch, prefix, cache slots: None for the prefix + 321, an AR step's own slot and a round's scratch; 2880 is the
# models grid's capacity at prompts 512 and 2048)
DECODE_CASES = [(1, 0, None), (1, 511, None), (1, 511, 2880), (1, 2047, None), (1, 2047, 2880), (1, 8191, None),
                (1, 32767, None), (8, 511, None), (8, 511, 2880), (8, 2047, None), (8, 2047, 2880)]


def stage_decode(rec, args, deadline):
    """decode_attention against the f32 reference (relative L2 error) and its device time against the tree kernel
    on the same one-row problem (its pad, Mosaic kernel and combine), layer 1 of an 8-layer stacked cache, timed over
    the 8 layers in turn; its device time at 1-32 splits and in ``DECODE_TILINGS``, all kernels and the attention
    kernel alone (each checked against the reference)."""
    from pallas_kernels import decode_attention as da

    h, kv, hd = QWEN3_8B["h"], QWEN3_8B["kv"], QWEN3_8B["hd"]
    rng = np.random.default_rng(5)
    for b, prefix, slots in DECODE_CASES:
        if time.time() > deadline:
            rec.add({"stopped": "budget"})
            return
        slots = slots or prefix + 1 + 320
        q = jnp.asarray(rng.standard_normal((b, 1, h, hd)), jnp.bfloat16)
        k, v = (jax.random.normal(jax.random.key(i), (DECODE_LAYERS, b, slots, kv, hd), jnp.float32)
                .astype(jnp.bfloat16) for i in range(2))
        p = jnp.full((b,), prefix, jnp.int32)
        bits = jnp.ones((b, 1, 1), jnp.uint32)
        layer = jnp.int32(1)
        cold = [(q, k, v, p, bits, jnp.int32(i)) for i in range(DECODE_LAYERS)]  # timed over the layers in turn
        fn = jax.jit(functools.partial(da.decode_attention, **KW))
        tree = jax.jit(lambda q, k, v, p, bits, layer: tat.tree_attention(q, k, v, p, bits, layer=layer, **KW))
        row = {"batch": b, "prefix": prefix, "slots": slots, "splits": da.default_splits(slots, b * kv),
               **_err(fn(q, k, v, p, bits, layer), reference_f32(q, k[1], v[1], p, bits))}
        row["kernel_us"], _, _ = device_time_us(fn, cold, 24)
        row["kernel_breakdown"] = LAST_BREAKDOWN[:]
        row["by_splits"] = {}  # other splits: us, all kernels and the attention kernel alone (the same output)
        for n in (1, 2, 4, 8, 16, 32):
            other = jax.jit(functools.partial(da.decode_attention, splits=n, **KW))
            assert _err(other(q, k, v, p, bits, layer), reference_f32(q, k[1], v[1], p, bits))["rel_l2_err"] < 5e-3
            total = device_time_us(other, cold, 24)[0]
            row["by_splits"][n] = [total, sum(t for name, t in LAST_BREAKDOWN if "decode_attention" in name)]
        if b == 1 and slots == DECODE_TILING_SLOTS:  # the models grid's AR steps: other tilings, default splits
            row["by_tiling"] = {}  # "block,warps,stages": [us all kernels, us the attention kernel]
            for block, warps, stages in DECODE_TILINGS:
                other = jax.jit(functools.partial(da.decode_attention, block=block, warps=warps, stages=stages, **KW))
                assert _err(other(q, k, v, p, bits, layer), reference_f32(q, k[1], v[1], p, bits))["rel_l2_err"] < 5e-3
                total = device_time_us(other, cold, 24)[0]
                row["by_tiling"][f"{block},{warps},{stages}"] = [
                    total, sum(t for name, t in LAST_BREAKDOWN if "decode_attention" in name)]
            print("  by tiling (block,warps,stages: us all (kernel)): " + " ".join(
                f"{name}: {t:.2f} ({k:.2f})" for name, (t, k) in row["by_tiling"].items()), flush=True)
        row["tree_kernel_us"], _, _ = device_time_us(tree, cold, 24)
        row["tree_breakdown"] = LAST_BREAKDOWN[:]
        rec.add(row)
        print(f"decode b={b} prefix={prefix} slots={slots}: err {row['rel_l2_err']:.1e} | "
              f"kernel {row['kernel_us']:.2f} us "
              f"({len(row['kernel_breakdown'])} kernels: "
              + " ".join(f"{n} {t:.2f}" for n, t in row["kernel_breakdown"])
              + f") vs tree kernel {row['tree_kernel_us']:.2f} us "
              f"({len(row['tree_breakdown'])}); by splits "
              + " ".join(f"{n}: {t:.2f} ({k:.2f})" for n, (t, k) in row["by_splits"].items()), flush=True)


QKV_CASES = [(1, 1), (1, 16), (1, 72), (8, 72)]  # (batch, rows)


def _qkv_numpy(qkv, qn, kn, cos, sin, heads, eps):
    """qkv_write's q, k, v rows by its definition (each operation rounded to bf16), in numpy float32."""
    import ml_dtypes

    rnd = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    x = np.asarray(qkv.astype(jnp.float32))
    kv = (x.shape[2] - heads) // 2
    c, s = rnd(cos)[:, :, None], rnd(sin)[:, :, None]
    half = x.shape[-1] // 2

    def norm_rope(a, w):
        r = (1.0 / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + np.float32(eps))).astype(np.float32)
        a = rnd(np.asarray(w.astype(jnp.float32)) * (a * r))
        rot = np.concatenate([-a[..., half:], a[..., :half]], axis=-1)
        return rnd(rnd(a * c) + rnd(rot * s))

    return norm_rope(x[:, :, :heads], qn), norm_rope(x[:, :, heads:heads + kv], kn), x[:, :, heads + kv:]


def stage_qkv(rec, args, deadline):
    """qkv_write at Qwen3-8B's heads: exactness against its numpy definition, the slots it must not touch, and
    device time per layer in a jitted loop over 8 layers against XLA's form (a copy of the caches into the loop,
    the same for both, is left out of the sums)."""
    from ddtree_jax import cache as kvcache, model
    from pallas_kernels import qkv_write as qw

    h, kv, hd = QWEN3_8B["h"], QWEN3_8B["kv"], QWEN3_8B["hd"]
    layers, slots, eps, loop = 4, 1024, 1e-6, 8
    rng = np.random.default_rng(3)
    for b, t in QKV_CASES:
        if time.time() > deadline:
            rec.add({"stopped": "budget"})
            return
        start = rng.integers(0, slots - t, b).astype(np.int32)
        start[-1] = slots - max(1, t // 2)  # the last sequence's last rows fall past the cache: dropped
        layer = 2
        qkv, qn, kn, cos, sin, k_all, v_all, _, start_j = qkv_write_inputs(b * 100 + t, b, t, h, kv, hd, layers, slots,
                                                                           start, layer=layer)
        kernel = jax.jit(functools.partial(qw.qkv_write, heads=h, eps=eps, **KW))
        q, k2, v2 = kernel(qkv, qn, kn, cos, sin, k_all, v_all, jnp.int32(layer), start_j)
        wq, wk, wv = _qkv_numpy(qkv, qn, kn, cos, sin, h, eps)
        k_old, v_old = np.asarray(k_all.astype(jnp.float32)), np.asarray(v_all.astype(jnp.float32))
        k_new, v_new = np.asarray(k2.astype(jnp.float32)), np.asarray(v2.astype(jnp.float32))
        ulp = lambda a, w: np.abs(a - w) / np.maximum(np.abs(w), 1e-30) * 256  # noqa: E731 - bf16: 8 bits
        row = {"batch": b, "rows": t, "q_values_off": int((np.asarray(q.astype(jnp.float32)) != wq).sum()),
               "q_max_ulps": float(ulp(np.asarray(q.astype(jnp.float32)), wq).max())}
        touched = np.zeros(k_old.shape, bool)
        koff = voff = 0
        for bi in range(b):
            for ti in range(t):
                sl = start[bi] + ti
                if sl < slots:
                    touched[layer, bi, sl] = True
                    koff += int((k_new[layer, bi, sl] != wk[bi, ti]).sum())
                    voff += int((v_new[layer, bi, sl] != wv[bi, ti]).sum())
        row.update(k_values_off=koff, v_values_off=voff,
                   untouched_slots_equal=bool((k_new[~touched] == k_old[~touched]).all()
                                              and (v_new[~touched] == v_old[~touched]).all()))

        def xla_form(qkv, qn, kn, cos, sin, k_all, v_all, layer, start):
            q, k, v = jnp.split(qkv, [h, h + kv], axis=2)
            q, k = (model.apply_rope(model.rms_norm(a, w, eps), cos, sin) for a, w in ((q, qn), (k, kn)))
            return q, kvcache.write_layer(k_all, layer, k, start), kvcache.write_layer(v_all, layer, v, start)

        for name, form in (("kernel", functools.partial(qw.qkv_write, heads=h, eps=eps, **KW)), ("xla", xla_form)):
            def many(qkv, qn, kn, cos, sin, k_all, v_all, start, form=form):
                def body(i, c):
                    k_all, v_all, acc = c
                    q, k_all, v_all = form(qkv, qn, kn, cos, sin, k_all, v_all, i % layers, start)
                    return k_all, v_all, acc + q[0, 0, 0, 0].astype(jnp.float32)
                k_all, v_all, acc = jax.lax.fori_loop(0, loop, body, (k_all, v_all, jnp.float32(0)))
                return acc + k_all[0, 0, 0, 0, 0] + v_all[0, 0, 0, 0, 0]

            us, how, _ = device_time_us(jax.jit(many), [(qkv, qn, kn, cos, sin, k_all, v_all, start_j)], 20)
            kept = [(n, u) for n, u in LAST_BREAKDOWN if "copy" not in n]
            row[f"{name}_us_per_layer"] = sum(u for _, u in kept) / loop if how == "cupti" else us / loop
            row[f"{name}_kernels_per_layer"] = len(kept) / loop
            row[f"{name}_breakdown"] = LAST_BREAKDOWN[:]
        rec.add(row)
        print(f"qkv b={b} t={t}: q off {row['q_values_off']} (max {row['q_max_ulps']:.2f} ulp), k off {koff}, "
              f"v off {voff}, untouched {row['untouched_slots_equal']} | kernel {row['kernel_us_per_layer']:.2f} us "
              f"({row['kernel_kernels_per_layer']:.1f} kernels) vs xla {row['xla_us_per_layer']:.2f} us "
              f"({row['xla_kernels_per_layer']:.1f}) per layer", flush=True)


def _shrink_for_dry_run():
    global VALIDATION_CASES, SWEEP_SHAPES, SWEEP_CONFIGS, BENCH_PREFIXES, BENCH_BUDGETS, ACCEPT_SHAPES
    global QKV_CASES, DECODE_CASES, DECODE_TILINGS, DECODE_TILING_SLOTS
    QKV_CASES, DECODE_CASES = [(2, 3)], [(2, 70, None), (1, 70, 200)]
    DECODE_TILINGS, DECODE_TILING_SLOTS = [(64, 4, 2), (32, 4, 3)], 200
    KW["interpret"] = True
    QWEN3_8B.update(h=4, kv=2, hd=64)
    VALIDATION_CASES = [(2, 5, 4, 2, 64, [3, 70], "random", None),
                        (1, 9, 2, 2, 128, "ragged8k", "chain", (1, 64, 3, 2))]
    SWEEP_SHAPES, SWEEP_CONFIGS = [(64, 8)], [(1, 64, 3, 2)]
    BENCH_PREFIXES, BENCH_BUDGETS = [64], [8]
    ACCEPT_SHAPES = [(1, 65, 15)]


STAGES = {"smoke": stage_smoke, "validate": stage_validate, "sweep": stage_sweep, "bench": stage_bench,
          "accept": stage_accept, "decode": stage_decode, "qkv": stage_qkv}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m pallas_kernels.bench_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="smoke,validate,sweep,bench,accept",
                    help=f"comma-separated stages, run in order, of {','.join(STAGES)} (default: %(default)s)")
    ap.add_argument("--out", default=".", help="directory for kernels_<stage>.json (default: the current one)")
    ap.add_argument("--quick", action="store_true", help="bench stage: prefixes 8k and 32k, budgets 16, 64, 256 only")
    ap.add_argument("--dry-run", action="store_true", help="CPU rehearsal: interpret mode, tiny shapes")
    ap.add_argument("--cases", type=lambda x: [int(c) for c in x.split(",")], default=None,
                    help="validation case indices (default: all)")
    ap.add_argument("--baselines-from", type=int, default=0,
                    help="bench stage: time XLA and jax.nn.dot_product_attention from this prefix on (default: 0)")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="seconds after which no new item starts (default: %(default)s)")
    args = ap.parse_args(argv)
    unknown = [name for name in args.stages.split(",") if name not in STAGES]
    if unknown:
        ap.error(f"unknown stage {unknown[0]!r}; the stages are {','.join(STAGES)}")
    os.makedirs(args.out, exist_ok=True)
    if args.dry_run:
        _shrink_for_dry_run()
    t_start = time.time()
    dev = jax.devices()[0]
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python -m pallas_kernels.bench_kernels"] + (argv or sys.argv[1:])),
    }
    print(meta)
    for name in args.stages.split(","):
        rec = Recorder(args.out, name, meta)
        t0 = time.time()
        try:
            if name == "smoke":
                STAGES[name](rec, args)
            else:
                STAGES[name](rec, args, t_start + args.budget_s)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            rec.data["error"] = repr(e)[:2000]
        rec.data["stage_s"] = time.time() - t0
        rec.flush()
        print(f"== stage {name} done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
