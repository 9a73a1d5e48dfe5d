"""Random inputs of the shapes DDTree gives the kernels: trees (random, chain, star), their ancestor masks,
tree-attention problems, tree walks and a layer's q|k|v rows with caches (``qkv_write``). Shared by the kernels'
validation and benchmarks (bench_kernels), the tests, and the once-per-process GPU probe
(``ddtree_jax.kernels.pallas_kernels_work``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.bitmask import pack_bits


def random_parents(rng: np.random.Generator, n1: int, kind: str, max_depth: int | None = None) -> np.ndarray:
    """Parents [n1] (index 0 = root, -1) of a tree: 'random', 'chain' or 'star'; depth <= max_depth."""
    if kind == "chain":
        return np.arange(-1, n1 - 1, dtype=np.int32)
    if kind == "star":
        return np.concatenate([[-1], np.zeros(n1 - 1, np.int32)]).astype(np.int32)
    max_depth = n1 if max_depth is None else max_depth
    par = np.zeros(n1, np.int32)
    depth = np.zeros(n1, np.int32)
    par[0] = -1
    for j in range(1, n1):  # bias toward recent nodes: deeper trees, like best-first ones
        lo = max(0, j - 1 - int(rng.integers(0, 8)) ** 2)
        cand = int(rng.integers(lo, j))
        while depth[cand] >= max_depth:
            cand = par[cand]
        par[j], depth[j] = cand, depth[cand] + 1
    return par


def ancestor_mask(par: np.ndarray) -> np.ndarray:
    """[n1, n1] bool: row j sees column a iff a is j or an ancestor of j."""
    n1 = len(par)
    vis = np.zeros((n1, n1), bool)
    for j in range(n1):
        vis[j] = vis[par[j]] if j else vis[j]
        vis[j, j] = True
    return vis


def tree_bits(rng, b: int, t: int, kind: str) -> jax.Array:
    return pack_bits(jnp.asarray(np.stack([ancestor_mask(random_parents(rng, t, kind)) for _ in range(b)])))


def attention_inputs(seed, b, t, h, kv, s, hd, plens, kind="random", dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    kq, kk, kvv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, hd), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (b, s, kv, hd), jnp.float32).astype(dtype)
    v = jax.random.normal(kvv, (b, s, kv, hd), jnp.float32).astype(dtype)
    return q, k, v, jnp.asarray(plens, jnp.int32), tree_bits(rng, b, t, kind)


def qkv_write_inputs(seed, b, t, h, kv, hd, layers, slots, start, normed=True, layer=1, theta=1e6):
    """``qkv_write``'s arguments: q|k|v rows [B, T, H + 2K, hd] (x3, so norms matter), q/k norm weights about 1 (or
    None), RoPE tables at positions start[b] + t, random stacked caches [layers, B, slots, K, hd] (the rows at
    slots >= ``slots`` are the ones dropped), ``layer`` and start. bf16."""
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((b, t, h + 2 * kv, hd)) * 3, jnp.bfloat16)
    qn, kn = ((jnp.asarray(1 + 0.3 * rng.standard_normal(hd), jnp.bfloat16) for _ in range(2)) if normed
              else (None, None))
    f = (np.asarray(start)[:, None] + np.arange(t))[..., None] / (theta ** (np.arange(0, hd, 2) / hd))
    emb = np.concatenate([f, f], -1).astype(np.float32)
    k_all, v_all = (jnp.asarray(rng.standard_normal((layers, b, slots, kv, hd)), jnp.bfloat16) for _ in range(2))
    return (qkv, qn, kn, jnp.asarray(np.cos(emb)), jnp.asarray(np.sin(emb)), k_all, v_all, jnp.int32(layer),
            jnp.asarray(start, jnp.int32))


def accept_inputs(rng, b, n1, kind, max_depth=None):
    """Random trees (depth <= max_depth) whose siblings carry distinct tokens; targets mostly agree."""
    toks, pars, tgts = [], [], []
    for _ in range(b):
        par = random_parents(rng, n1, kind, max_depth)
        tok = np.full(n1, -1, np.int32)
        for j in range(1, n1):  # siblings: distinct tokens (child rank within its parent)
            tok[j] = int(np.sum(par[1:j] == par[j]))
        tgt = np.where(rng.random(n1) < 0.7, 0, rng.integers(0, 4, n1)).astype(np.int32)
        toks.append(tok), pars.append(par), tgts.append(tgt)
    return tuple(jnp.asarray(np.stack(x)) for x in (toks, pars, tgts))
