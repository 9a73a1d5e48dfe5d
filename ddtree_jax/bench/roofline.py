"""Rooflines of ``bench models``: what the device can do (copy bandwidth, GEMV read bandwidth, matmul rate,
measured on random data) and the least an AR step or a speculative round must cost on it (the bytes it must read,
the FLOPs it must do)."""

from __future__ import annotations

import statistics
import time


def measure_ceilings(quick: bool) -> dict:
    """Copy bandwidth (read + write bytes), bf16 GEMV read bandwidth, bf16 matmul rate, on random data: 4 GiB and
    1 GiB buffers on a GPU, 1/16 of that elsewhere (a CPU machine's memory), tiny ones when ``quick``."""
    import jax
    import jax.numpy as jnp

    def med_ms(fn, arg_sets, k):
        fn(*arg_sets[0]).block_until_ready()
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(k):
                r = fn(*arg_sets[i % len(arg_sets)])
            r.block_until_ready()
            out.append(1e3 * (time.perf_counter() - t0) / k)
        return statistics.median(out)

    small = 1 if jax.default_backend() == "gpu" else 16  # the buffers' divisor off a GPU
    n = (1 << 24) if quick else (1 << 31) // small  # bf16 elements: 4 GiB on a GPU
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (n,), jnp.float32).astype(jnp.bfloat16)
    copy_ms = med_ms(jax.jit(lambda a: a + jnp.bfloat16(1)), [(x,)], 5)
    copy_gbps = 2 * x.nbytes / copy_ms / 1e6
    del x
    d, f = (256, 512) if quick else (8192, 65536 // small)  # 1 GiB of weights on a GPU
    w = jax.random.normal(keys[1], (d, f), jnp.float32).astype(jnp.bfloat16)
    gemv = {}
    for b in (1, 8):
        v = jax.random.normal(keys[2], (b, d), jnp.float32).astype(jnp.bfloat16)
        ms = med_ms(jax.jit(lambda a, m: jnp.dot(a, m, preferred_element_type=jnp.float32)), [(v, w)], 10)
        gemv[f"batch{b}_gbps"] = w.nbytes / ms / 1e6
    del w
    m = 256 if quick else 8192 // (4 if small > 1 else 1)
    a = jax.random.normal(keys[3], (m, m), jnp.float32).astype(jnp.bfloat16)
    mm_ms = med_ms(jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
                   [(a, a)], 10)
    return {"copy_gbps": copy_gbps, "copy_bytes": 2 * n * 2, "gemv": gemv,
            "matmul_tflops": 2 * m**3 / mm_ms / 1e9, "matmul_n": m}


def nbytes(tree) -> int:
    """Bytes of every array of a pytree."""
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def kv_bytes(cfg, batch: int, prefix: int, dtype) -> int:
    """Bytes of the K and V caches of ``cfg``'s layers over ``prefix`` positions, ``batch`` sequences."""
    import jax.numpy as jnp

    item = jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * batch * prefix * cfg.num_kv_heads * cfg.head_dim * item


def step_weight_bytes(tp, batch: int, routed: dict | None = None) -> int:
    """Weights one target step must read: every layer (of an MoE target's experts, those ``routed`` reports
    touched: moe_cost), the final norm, lm_head; B embedding rows."""
    from ddtree_jax import moe_cost

    return (moe_cost.layer_bytes(tp.layers, routed and routed["distinct"]) + nbytes(tp.final_norm)
            + nbytes(tp.lm_head) + batch * tp.embed.shape[1] * tp.embed.dtype.itemsize)


def round_floor(spec, tcfg, dcfg, tp, dp, batch: int, prefix: int, dtype, ceilings: dict,
                routed: dict | None = None) -> dict:
    """max(bytes / copy bandwidth, flops / matmul rate) of one speculative round (both models; an MoE target's
    bytes with the experts ``routed`` reports touched, its FLOPs with each token's k experts), under ``ceilings``
    (``measure_ceilings``)."""
    from ddtree_jax import moe_cost

    t = 1 + spec.budget
    bs = dcfg.block_size
    dl = dcfg.layers
    kv_t = kv_bytes(tcfg, batch, prefix, dtype)
    kv_d = kv_bytes(dl, batch, prefix, dtype)
    lm = nbytes(tp.lm_head)
    bytes_ = step_weight_bytes(tp, batch, routed) + nbytes(dp) + lm + kv_t + kv_d
    active = [tcfg.experts_per_token] * len(tcfg.sparse_layers) if tcfg.num_experts else None
    p_t = (moe_cost.layer_bytes(tp.layers, active) + lm) / 2  # parameters touched per token (bf16)
    p_d = nbytes(dp.layers) / 2
    att_t = 4 * tcfg.num_layers * batch * t * (prefix + t) * tcfg.num_heads * tcfg.head_dim
    att_d = 4 * dl.num_layers * batch * bs * (prefix + bs) * dl.num_heads * dl.head_dim
    flops = 2 * p_t * batch * t + 2 * p_d * batch * bs + 2 * lm / 2 * batch * (bs - 1) + att_t + att_d
    bw, rate = ceilings.get("copy_gbps"), ceilings.get("matmul_tflops")
    mem_ms = bytes_ / bw / 1e6 if bw else None
    cmp_ms = flops / rate / 1e9 if rate else None
    return {"bytes": bytes_, "flops": flops, "memory_ms": mem_ms, "compute_ms": cmp_ms,
            "floor_ms": max(mem_ms or 0, cmp_ms or 0) or None}
