"""Pallas kernels vs their jnp references, on CPU: the Mosaic GPU kernels (tree_attention, tree_accept) run in its
interpreter, the Triton ones in the Pallas interpreter.

Small shapes (the interpreter simulates every warpgroup, barrier and copy), but each tree-attention case exercises
a different path: GQA ratios 1/2/4, head_dim 64/128, budget 1 and the single AR token, an empty prefix, ragged
prefixes with every value of p % 8, split-K with its merge, one and two compute warpgroups, random / chain (full
depth) / star trees. The GPU grid (prefixes to 32k, T to 1025, batch 16) is
``python -m pallas_kernels.bench_kernels --stages validate``; its results: docs/KERNELS.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from ddtree_jax import shapes, tree as trees
from ddtree_jax.tuning import Tuning
from pallas_kernels import ancestor_bits, best_first as bf, selection, tree_accept as ta
from pallas_kernels import vocab_top_k
from pallas_kernels import tree_attention as tat
from pallas_kernels import inputs
from pallas_kernels.inputs import accept_inputs, ancestor_mask, qkv_write_inputs, random_parents
from pallas_kernels.bitmask import pack_bits, unpack_bits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ddtree_reference")


def attention_inputs(*args, **kw):
    """pallas_kernels.inputs.attention_inputs traced into one program (its arguments are all static: the numpy tree
    masks are built while tracing): the same arrays as eagerly, without compiling each jax.random and bit-packing
    op on its own for every new shape."""
    return jax.jit(lambda: inputs.attention_inputs(*args, **kw))()


# The references and the kernels' wrappers jitted, one program per shape (as the model calls them), rather than
# dispatched op by op, each op compiled on its own for every new shape
@jax.jit
def _f32_reference(q, k, v, p, bits):
    with jax.default_matmul_precision("highest"):
        return tat.tree_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), p, bits)


_xla_reference = jax.jit(tat.tree_attention_reference)


# ------------------------------------------------------------------------------------ tree attention
ATTENTION_CASES = [
    # id, (b, t, h, kv, hd, prefixes, tree, config)
    ("budget1-gqa1-hd64-emptyprefix", (2, 2, 2, 2, 64, [0, 70], "random", None)),
    ("gqa2-hd128-splitk", (2, 5, 4, 2, 128, [13, 100], "random", (1, 64, 3, 2))),
    ("gqa4-hd64-chain-2wgs", (1, 17, 4, 1, 64, [3], "chain", (2, 128, 2, 1))),
    ("gqa4-hd64-1wg-2rowblocks-splitk", (1, 20, 4, 1, 64, [150], "random", (1, 128, 2, 2))),  # 80 rows: 2 CTAs of 64
    ("gqa4-hd128-star-aligned-splitk", (2, 9, 4, 1, 128, [0, 64], "star", (2, 64, 3, 3))),
    ("ar-token-gqa4", (1, 1, 8, 2, 64, [77], "chain", None)),
    ("ragged3-gqa2", (3, 7, 4, 2, 64, [5, 130, 71], "random", None)),
]


@pytest.mark.parametrize("case", [c for _, c in ATTENTION_CASES], ids=[i for i, _ in ATTENTION_CASES])
def test_tree_attention_interpret_matches_reference(case):
    b, t, h, kv, hd, plens, kind, cfg = case
    s = max(plens) + t + 64  # slack: the interpreter need not emulate TMA's zero fill past the end
    q, k, v, p, bits = attention_inputs(sum(plens) + t, b, t, h, kv, s, hd, plens, kind)
    out = jax.jit(functools.partial(tat.tree_attention, interpret=True, config=cfg))(q, k, v, p, bits)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out, np.float32)
    ref = np.asarray(_f32_reference(q, k, v, p, bits))
    xla = np.asarray(_xla_reference(q, k, v, p, bits), np.float32)  # the bf16 XLA path
    assert not np.isnan(out).any()
    err = np.abs(out - ref).max()
    # bf16 output rounding dominates: the kernel must be about as close to f32 as the XLA path is
    assert err <= max(2 * np.abs(xla - ref).max(), 1e-2), err
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-2


def test_tree_attention_reads_a_layer_of_the_stacked_cache_in_place():
    """With ``layer`` (traced, as inside the layer scan) the kernel reads that layer of the stacked [L, B, S, K, hd]
    cache through a [L * B, ...] view: exactly what it computes on the sliced layer, and the reference's answer."""
    import jax

    b, t, h, kv, hd, plens = 2, 5, 4, 2, 64, [9, 70]
    s = max(plens) + t + 64
    q, k1, v1, p, bits = attention_inputs(1, b, t, h, kv, s, hd, plens, "random")
    k0, v0, k2, v2 = (x[::-1] for x in (k1, v1, k1[:, ::-1], v1[:, ::-1]))  # other layers, other values
    k, v = jnp.stack([k0, k1, k2]), jnp.stack([v0, v1, v2])
    run = jax.jit(lambda q, k, v, p, bits, layer: tat.tree_attention(q, k, v, p, bits, interpret=True, layer=layer))
    got = run(q, k, v, p, bits, jnp.int32(1))
    want = jax.jit(functools.partial(tat.tree_attention, interpret=True))(q, k1, v1, p, bits)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(_xla_reference(q, k, v, p, bits, layer=2), np.float32),
                                  np.asarray(_xla_reference(q, k2, v2, p, bits), np.float32))
    with pytest.raises(ValueError, match="L, B, S, K, hd"):
        tat.tree_attention(q, k1, v1, p, bits, interpret=True, layer=0)


def test_tree_attention_takes_q_packed_in_its_row_layout():
    """A ``PackedQ`` (q already in the kernel's [B, K, R_pad, hd] rows, as qkv_write writes it; the unused rows any
    values, here NaN) gives q's output exactly: as the kernel's operand where R_pad is the configuration's, unpacked
    where it is not (another configuration), and through the model's attention function's reference path."""
    from ddtree_jax import model

    b, t, h, kv, hd, plens = 2, 5, 4, 2, 64, [9, 70]
    s = max(plens) + t + 64
    q, k, v, p, bits = attention_inputs(1, b, t, h, kv, s, hd, plens, "random")
    g = h // kv
    rows = tat.packed_rows(b, t, h, kv, s, hd)
    assert rows % 64 == 0 and rows >= t * g
    packed_rows = jnp.full((b, kv, rows, hd), jnp.nan, q.dtype).at[:, :, : t * g].set(tat._pack_rows(q, kv))
    packed = tat.PackedQ(packed_rows, t, h)
    np.testing.assert_array_equal(np.asarray(packed.unpack(), np.float32), np.asarray(q, np.float32))
    run = jax.jit(functools.partial(tat.tree_attention, interpret=True))
    want = np.asarray(run(q, k, v, p, bits), np.float32)
    np.testing.assert_array_equal(np.asarray(run(packed, k, v, p, bits), np.float32), want)
    other = jax.jit(functools.partial(tat.tree_attention, interpret=True, config=(2, 64, 3, 2)))
    np.testing.assert_array_equal(np.asarray(other(packed, k, v, p, bits), np.float32),
                                  np.asarray(other(q, k, v, p, bits), np.float32))
    attend = model.attention_fn("pallas-interpret")  # not in place: unpacked for the kernel on the sliced layer
    np.testing.assert_array_equal(np.asarray(jax.jit(attend)(packed, k, v, p, bits), np.float32), want)
    reference = jax.jit(functools.partial(attend, extra_mask=jnp.ones((b, t, s), bool)))  # the reference path
    np.testing.assert_array_equal(np.asarray(reference(packed, k, v, p, bits), np.float32),
                                  np.asarray(reference(q, k, v, p, bits), np.float32))


def test_tree_attention_takes_its_mask_operand_made_once():
    """A ``KernelMask`` (tree_bits with the kernel's mask words made from them by ``kernel_mask``) gives the raw bits'
    output exactly, in the default configuration (which reads the words) and in another (which makes its own); the
    model's attention function's reference path reads its tree_bits."""
    from ddtree_jax import model

    b, t, h, kv, hd, plens = 2, 5, 4, 2, 64, [9, 70]
    s = max(plens) + t + 64
    q, k, v, p, bits = attention_inputs(1, b, t, h, kv, s, hd, plens, "random")
    mask = tat.kernel_mask(bits, p, q.shape, k.shape)
    assert mask.words.shape == (b, 4, tat.packed_rows(b, t, h, kv, s, hd)) and mask.words.dtype == jnp.uint32
    run = jax.jit(functools.partial(tat.tree_attention, interpret=True))
    want = np.asarray(run(q, k, v, p, bits), np.float32)
    np.testing.assert_array_equal(np.asarray(run(q, k, v, p, mask), np.float32), want)
    wrong = tat.KernelMask(bits, mask.words ^ jnp.uint32(0xFFFF))  # the words are what the kernel reads
    assert not np.array_equal(np.asarray(run(q, k, v, p, wrong), np.float32), want)
    other = jax.jit(functools.partial(tat.tree_attention, interpret=True, config=(2, 64, 3, 2)))  # 128 rows
    np.testing.assert_array_equal(np.asarray(other(q, k, v, p, wrong), np.float32),
                                  np.asarray(other(q, k, v, p, bits), np.float32))
    reference = jax.jit(functools.partial(model.attention_fn("pallas-interpret"), extra_mask=jnp.ones((b, t, s), bool)))
    np.testing.assert_array_equal(np.asarray(reference(q, k, v, p, wrong), np.float32),
                                  np.asarray(reference(q, k, v, p, bits), np.float32))


def test_the_layer_index_reaches_the_kernel_inside_the_lengths_operand():
    """With ``layer`` the kernel call's one integer operand is the lengths with the layer index appended, [B + 1],
    computed (a concatenation), never a bare slice of the layer loop's index array. As an operand of its own, an
    int32 [1] that XLA sliced asynchronously out of the layer loop's indices, the compiled prefill returned the state's
    round counter set to the prompt length at batch 1 on an H200 (jaxlib 0.11.2: every such decode faulted)."""
    import jax

    def kernel_int_operands(b, layer):
        q = jnp.zeros((b, 5, 4, 64), jnp.bfloat16)
        k = jnp.zeros((3, b, 128, 2, 64) if layer else (b, 128, 2, 64), jnp.bfloat16)
        p, bits = jnp.zeros((b,), jnp.int32), jnp.zeros((b, 5, 1), jnp.uint32)
        fn = (lambda q, k, p, bits, i: tat.tree_attention(q, k, k, p, bits, layer=i)) if layer else (
            lambda q, k, p, bits, i: tat.tree_attention(q, k, k, p, bits))
        jaxpr = jax.make_jaxpr(fn)(q, k, p, bits, jnp.int32(1))
        (call,) = [e for e in jaxpr.eqns if len(e.invars) >= 5 and e.invars[1].aval.shape == k.reshape(
            -1, *k.shape[-3:]).shape]  # the kernel: q, k, v (the [L * B, S, K, hd] view), lengths, mask words
        return [tuple(v.aval.shape) for v in call.invars if jnp.issubdtype(v.aval.dtype, jnp.signedinteger)]

    for b in (1, 3):
        assert kernel_int_operands(b, layer=True) == [(b + 1,)]
        assert kernel_int_operands(b, layer=False) == [(b,)]


def test_tree_attention_no_races_pingpong_ring_split():
    """The interpreter's happy-before race detector over ping-pong + split-K partials in the K/V ring."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    q, k, v, p, bits = attention_inputs(3, 1, 9, 4, 1, 160, 64, [70], "random")
    out = tat.tree_attention(q, k, v, p, bits, config=(2, 128, 2, 2),
                             interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not gpu_callbacks.get_races().races_found
    ref = np.asarray(_f32_reference(q, k, v, p, bits))
    assert np.abs(np.asarray(out, np.float32) - ref).max() < 2e-2


def test_default_config_shapes():
    """The cost model: one CTA wave at least; splits for few rows, none when rows fill the GPU; one compute warpgroup
    for a ddtree-64 verify's 288 rows over a short prefix (faster on an H200), two over a long one."""
    wgs, bkv, stages, splits = tat.default_config(1, 17, 32, 8, 8192 + 24, 128)
    assert (wgs, bkv, stages) == (2, 128, 2) and splits > 8
    assert tat.default_config(1, 1, 32, 8, 32768, 128)[0] == 1  # 4 rows: one compute warpgroup
    assert tat.default_config(16, 17, 32, 8, 33000, 128)[3] == 1  # 128 CTAs already
    assert tat.default_config(1, 72, 32, 8, 584, 128) == (1, 128, 2, 3)  # 5 CTAs of 64 rows a KV head, 3 splits
    assert tat.default_config(1, 72, 32, 8, 8264, 128) == (2, 128, 2, 5)
    assert tat.packed_rows(1, 72, 32, 8, 584, 128) == 320  # q's packed rows follow the configuration
    assert tat.packed_rows(1, 72, 32, 8, 8264, 128) == 384


def test_tree_attention_rejects_unsupported():
    q = jnp.zeros((1, 2, 2, 32), jnp.bfloat16)
    with pytest.raises(ValueError):
        tat.tree_attention(q, q, q, jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2, 1), jnp.uint32))


@pytest.mark.parametrize("n,t", [(5, 5), (5, 8), (31, 40), (65, 72), (33, 96)])
def test_pad_rows_adds_rows_that_see_themselves_only(n, t):
    """A verify block padded from n to t rows (round.verify): the old rows see exactly what they saw, the new
    rows only themselves."""
    from pallas_kernels.bitmask import pad_rows

    vis = np.random.default_rng(n).random((2, n, n)) < 0.5
    padded = jax.jit(lambda x: pad_rows(pack_bits(x), t))(jnp.asarray(vis))
    got = np.asarray(jax.jit(unpack_bits, static_argnums=1)(padded, t))
    want = np.zeros((2, t, t), bool)
    want[:, :n, :n] = vis
    want[:, np.arange(n, t), np.arange(n, t)] = True
    np.testing.assert_array_equal(got, want)
    assert padded.shape == (2, t, -(-t // 32))


@pytest.mark.parametrize("t", [1, 31, 33, 100])
def test_shifted_bits(t):
    """The kernel's mask rows: shifted left by p % 8, low bits (prefix slots base..p-1) set."""
    rng = np.random.default_rng(t)
    b = 8
    vis = rng.random((b, t, t)) < 0.5
    plens = np.arange(b) * 13 + 5  # every residue mod 8
    words = tat._tree_tiles(t, 64) * 2
    got = jax.jit(lambda x, p: unpack_bits(tat._shifted_bits(pack_bits(x), p, t, words), 32 * words))(
        jnp.asarray(vis), jnp.asarray(plens, jnp.int32))
    want = np.zeros((b, t, 32 * words), bool)
    for i, p in enumerate(plens):
        off = p % 8
        want[i, :, :off] = True
        want[i, :, off : off + t] = vis[i]
    np.testing.assert_array_equal(np.asarray(got), want)


# ------------------------------------------------------------------------------------ tree accept
def _golden_cases():
    d = np.load(os.path.join(FIXTURES, "tree_walk.npz"))
    n = len([k for k in d.files if k.startswith("accepted_")])
    cases = []
    for i in range(n):
        tok = np.concatenate([[-1], d[f"node_token_ids_{i}"]]).astype(np.int32)
        cases.append((tok, d[f"parents_{i}"].astype(np.int32), d[f"posterior_{i}"].astype(np.int32),
                      d[f"accepted_{i}"], int(d[f"next_token_{i}"])))
    return cases


def _golden_batch():
    cases = _golden_cases()
    n1 = max(len(c[1]) for c in cases)
    pad = lambda x, v: np.pad(x, (0, n1 - len(x)), constant_values=v)  # noqa: E731  (padding: leaves)
    tok = jnp.asarray(np.stack([pad(c[0], -1) for c in cases]))
    par = jnp.asarray(np.stack([pad(c[1], 0) for c in cases]))
    tgt = jnp.asarray(np.stack([pad(c[2], -2) for c in cases]))
    return tok, par, tgt, cases


def _check_golden(path, length, bonus, cases):
    assert len(cases) == 12
    for i, (_, _, _, acc, nxt) in enumerate(cases):
        assert int(length[i]) == len(acc)
        np.testing.assert_array_equal(np.asarray(path[i, : len(acc)]), acc)
        assert (np.asarray(path[i, len(acc) :]) == acc[-1]).all()  # padded with the last accepted index
        assert int(bonus[i]) == nxt


def test_tree_accept_reference_golden():
    tok, par, tgt, cases = _golden_batch()
    _check_golden(*jax.jit(functools.partial(ta.tree_accept_reference, max_depth=7))(tok, par, tgt), cases)


def test_tree_accept_interpret_golden():
    tok, par, tgt, cases = _golden_batch()
    _check_golden(*jax.jit(functools.partial(ta.tree_accept, max_depth=7, interpret=True))(tok, par, tgt), cases)


@pytest.mark.parametrize("n1,kind,max_depth", [(65, "random", 7), (33, "chain", 32), (40, "star", 3),
                                               (2, "chain", 1), (130, "random", 15)])
def test_tree_accept_interpret_matches_reference(n1, kind, max_depth):
    rng = np.random.default_rng(n1)
    tok, par, tgt = accept_inputs(rng, 4, n1, kind, max_depth)
    got = jax.jit(functools.partial(ta.tree_accept, max_depth=max_depth, interpret=True))(tok, par, tgt)
    want = jax.jit(functools.partial(ta.tree_accept_reference, max_depth=max_depth))(tok, par, tgt)
    for g, w in zip(got, want):
        assert g.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_tree_accept_reference_is_the_walk():
    """The loop-free reference equals a literal host walk of the official algorithm."""
    rng = np.random.default_rng(0)
    tok, par, tgt = accept_inputs(rng, 32, 50, "random", 6)
    path, length, bonus = jax.jit(functools.partial(ta.tree_accept_reference, max_depth=6))(tok, par, tgt)
    from ddtree_jax import accept

    tok, par, tgt = np.asarray(tok), np.asarray(par), np.asarray(tgt)
    for i in range(32):
        walk = accept.walk_host(tok[i, 1:], par[i], tgt[i])  # tok[:, 0] is the root's (unused) slot
        cur = walk[-1]
        assert int(length[i]) == len(walk) and int(bonus[i]) == tgt[i, cur]
        np.testing.assert_array_equal(np.asarray(path[i]), walk + [cur] * (7 - len(walk)))


def test_random_trees_respect_depth():
    rng = np.random.default_rng(1)
    par = random_parents(rng, 300, "random", 5)
    depth = np.zeros(300, int)
    for j in range(1, 300):
        depth[j] = depth[par[j]] + 1
    assert depth.max() <= 5 and (par[1:] < np.arange(1, 300)).all()
    assert ancestor_mask(par)[7, 0] and ancestor_mask(par)[7, 7]


def test_the_gpu_probe_passes_in_the_interpreter():
    """kernels.kernel_mismatch, behind --attention auto on a GPU: both kernels (in the Mosaic GPU interpreter here)
    match their references on its problems, and its walks go deep (it checks more than the root)."""
    from ddtree_jax import kernels

    assert kernels.kernel_mismatch("pallas-interpret") is None
    tok, par, tgt = accept_inputs(np.random.default_rng(0), 8, 65, "random", 15)
    assert int(np.max(np.asarray(ta.tree_accept_reference(tok, par, tgt, max_depth=15)[1]))) >= 4


def test_the_in_place_probe_passes_and_catches_a_wrong_layer(monkeypatch):
    """The probe behind auto's choice of 'pallas-inplace' passes in the interpreter, and it fails when the kernel
    reads another layer of the stacked cache than the one asked for, or when qkv_write writes another layer."""
    from ddtree_jax import kernels
    from pallas_kernels import qkv_write as qw

    assert kernels.kernel_mismatch("pallas-inplace-interpret") is None
    right = tat.tree_attention
    monkeypatch.setattr(tat, "tree_attention", lambda *a, layer=None, **kw: right(*a, layer=layer + 1, **kw))
    assert "pallas-inplace" in kernels.kernel_mismatch("pallas-inplace-interpret")
    monkeypatch.undo()
    right_qkv = qw.qkv_write
    monkeypatch.setattr(qw, "qkv_write", lambda *a, **kw: right_qkv(*a[:7], a[7] - 1, *a[8:], **kw))
    assert "qkv_write" in kernels.kernel_mismatch("pallas-inplace-interpret")


def test_auto_prefers_in_place_then_sliced_then_xla_on_a_gpu(monkeypatch):
    from ddtree_jax import kernels

    monkeypatch.setattr(kernels.jax, "default_backend", lambda: "gpu")
    for works, want in [({"pallas-inplace", "pallas"}, "pallas-inplace"), ({"pallas"}, "pallas"), (set(), "xla")]:
        monkeypatch.setattr(kernels, "pallas_kernels_work", lambda impl, works=works: impl in works)
        assert kernels.resolve_attention("auto") == want
    monkeypatch.setattr(kernels.jax, "default_backend", lambda: "cpu")
    assert kernels.resolve_attention("auto") == "xla"
    assert kernels.resolve_attention("pallas-inplace") == "pallas-inplace-interpret"


# the tiny shape with two target layers: enough to tell the layers of a stacked cache or weight apart (the Pallas
# interpreter's time grows with every kernel call)
_TWO_LAYERS = dataclasses.replace(shapes.SHAPES["tiny"], layers=2)


@functools.cache
def _block_on_a_filled_cache(tcfg, b: int, t: int, seed: int, prefix: int = 21):
    """(a bf16 cache of 128 slots [L, B, 128, K, hd] filled with random K/V up to ``prefix``, random tokens [B, T],
    their positions [B, T] after the prefix): the input of one forward over a block of T new tokens."""
    from ddtree_jax import cache as kvcache

    rng = np.random.default_rng(seed)
    cache = kvcache.init(tcfg.num_layers, b, 128, tcfg.num_kv_heads, tcfg.head_dim, jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal(cache.k.shape), jnp.bfloat16) for _ in range(2))
    cache = kvcache.KVCache(k, v, jnp.full((b,), prefix, jnp.int32))
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, (b, t)), jnp.int32)
    return cache, tokens, prefix + jnp.arange(t)[None].repeat(b, 0)


def _two_layer_target():
    """(target config, its random bf16 parameters) of _TWO_LAYERS, built once for the tests that read them (building
    compiles the random initialisation of every leaf: seconds)."""
    tcfg, dcfg = shapes.model_configs(_TWO_LAYERS)
    return tcfg, shapes.build_params(tcfg, dcfg, jnp.bfloat16)[0]


def test_the_model_reads_the_stacked_cache_in_place_with_pallas_inplace():
    """model.forward with the attention reading each layer's K/V in place ('pallas-inplace') computes exactly what
    the kernel on copied slices does ('pallas'), on a bf16 model of head_dim 64 with a cache holding a prefix."""
    from ddtree_jax import cache as kvcache, model
    from pallas_kernels.bitmask import causal_bits

    tcfg, tparams = _two_layer_target()
    b, t, prefix, capacity = 2, 4, 21, 128
    rng = np.random.default_rng(0)
    cache = kvcache.init(tcfg.num_layers, b, capacity, tcfg.num_kv_heads, tcfg.head_dim, jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal(cache.k.shape), jnp.bfloat16) for _ in range(2))
    cache = kvcache.KVCache(k, v, jnp.full((b,), prefix, jnp.int32))
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, (b, t)), jnp.int32)
    positions = prefix + jnp.arange(t)[None].repeat(b, 0)
    outs = {impl: jax.jit(lambda p, c, impl=impl: model.forward(p, tcfg, tokens, positions, c, causal_bits(b, t),
                                                                attention=impl))(tparams, cache)
            for impl in ("pallas-interpret", "pallas-inplace-interpret", "xla")}
    sliced, in_place, xla = (np.asarray(outs[i][0], np.float32) for i in outs)
    np.testing.assert_array_equal(in_place, sliced)
    np.testing.assert_array_equal(np.asarray(outs["pallas-inplace-interpret"][1].v, np.float32),
                                  np.asarray(outs["pallas-interpret"][1].v, np.float32))
    assert np.abs(in_place - xla).max() < 0.1 * np.abs(xla).max()


# ------------------------------------------------------------------------------------ one-row (AR) attention
@pytest.mark.parametrize("b,h,kv,hd,slots,prefixes,bit,splits", [
    (2, 8, 2, 64, 200, [0, 150], 1, 3),  # an empty prefix (the row sees itself only); a split with no slots
    (1, 32, 8, 128, 300, [257], 1, None),  # Qwen3's heads, default splits
    (3, 4, 4, 64, 130, [5, 64, 128], 0, 2),  # GQA 1; the row's own slot masked out (bit 0 clear)
    (2, 8, 2, 64, 200, [0, 150], 1, 1),  # one split: the kernel writes the output itself
    (1, 9, 3, 64, 700, [600], 1, None),  # SmolLM2's heads (the default pair): 3 query heads per KV head
    (1, 32, 8, 128, 1100, [1000], 1, None),  # Qwen3's heads, 8 default splits, the last one short
])
def test_decode_attention_matches_the_reference(b, h, kv, hd, slots, prefixes, bit, splits):
    """decode_attention (Pallas interpreter) on layer 1 of a stacked cache whose other layers differ: the tree
    attention reference's output for one row (f32, highest precision) within bf16's error."""
    from pallas_kernels import decode_attention as da

    rng = np.random.default_rng(b * 10 + h)
    q = jnp.asarray(rng.standard_normal((b, 1, h, hd)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((3, b, slots, kv, hd)), jnp.bfloat16) for _ in range(2))
    p = jnp.asarray(prefixes, jnp.int32)
    bits = jnp.full((b, 1, 1), bit, jnp.uint32)
    kernel = jax.jit(functools.partial(da.decode_attention, splits=splits, interpret=True))
    got = np.asarray(kernel(q, k, v, p, bits, jnp.int32(1)), np.float32)
    want = np.asarray(_f32_reference(q, k[1], v[1], p, bits))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
    with pytest.raises(ValueError, match="decode_attention takes"):
        da.decode_attention(jnp.concatenate([q, q], axis=1), k, v, p, bits, jnp.int32(1), interpret=True)


@pytest.mark.parametrize("block", [16, 128])
def test_decode_attention_block_sizes_give_the_same_output(block):
    """decode_attention's ``block`` (keys per step; its tiling knob besides warps and stages, which the interpreter
    ignores) changes the steps, not the output: the f32 reference's within bf16's error; a block that is not a power
    of two of at least 16 is a one-line error."""
    from pallas_kernels import decode_attention as da

    rng = np.random.default_rng(block)
    b, h, kv, hd, slots = 2, 8, 2, 64, 300
    q = jnp.asarray(rng.standard_normal((b, 1, h, hd)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((2, b, slots, kv, hd)), jnp.bfloat16) for _ in range(2))
    p, bits = jnp.asarray([40, 250], jnp.int32), jnp.ones((b, 1, 1), jnp.uint32)
    got = np.asarray(da.decode_attention(q, k, v, p, bits, jnp.int32(1), splits=3, block=block, interpret=True),
                     np.float32)
    want = np.asarray(_f32_reference(q, k[1], v[1], p, bits))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 5e-3
    with pytest.raises(ValueError, match="a block of a power of two >= 16, .* block 48"):
        da.decode_attention(q, k, v, p, bits, jnp.int32(1), block=48, interpret=True)


def test_decode_attention_splits_follow_the_cache_and_the_batch(monkeypatch):
    """One split per 128 cache slots (SLOTS_PER_SPLIT, read when traced), 2 to 32, at most 512 programs (batch x KV
    heads x splits) unless under 2."""
    from pallas_kernels import decode_attention as da

    assert [da.default_splits(s, 8) for s in (321, 832, 2880, 8512, 33088)] == [2, 6, 22, 32, 32]
    assert da.default_splits(2880, 64) == 8 and da.default_splits(33088, 1024) == 2  # batch 8 / 128, 8 KV heads
    monkeypatch.setattr(da, "SLOTS_PER_SPLIT", 64)
    assert [da.default_splits(s, 8) for s in (321, 832, 2880)] == [5, 13, 32]


def test_split_merge_is_the_softmax_over_all_splits_and_one_fused_kernel():
    """merge_splits: the partials of a row's key splits give softmax(s) . v over all its keys (a split that saw no key,
    max -inf and sum 0, weighs nothing; base 2 as tree_attention stores its log-sum-exp), and it lowers to no
    reduction, so that XLA fuses it with its consumer."""
    from pallas_kernels.split_merge import merge_splits

    rng = np.random.default_rng(0)
    n, splits, per, hd = 3, 5, 7, 4
    s = rng.normal(size=(n, splits, per)) * 4
    v = rng.normal(size=(n, splits, per, hd))
    s[1, 2] = -np.inf  # row 1's third split saw no key
    m = s.max(-1)
    p = np.exp(s - np.where(np.isfinite(m), m, 0)[..., None])
    acc, l = np.einsum("nsk,nskd->nsd", p, v), p.sum(-1)
    e = np.exp(s.reshape(n, -1) - s.reshape(n, -1).max(-1, keepdims=True))  # softmax over all keys of a row
    want = np.einsum("nk,nkd->nd", e, v.reshape(n, -1, hd)) / e.sum(-1, keepdims=True)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    np.testing.assert_allclose(merge_splits(f32(acc), f32(m), f32(l)), want, rtol=2e-5, atol=2e-6)
    lse2 = m / np.log(2) + np.log2(np.where(l > 0, l, 1))  # base-2 log-sum-exp, normalised partials, sums 1
    lse2[1, 2] = -np.inf
    norm = acc / np.where(l > 0, l, 1)[..., None]
    np.testing.assert_allclose(merge_splits(f32(norm), f32(lse2), jnp.ones((n, splits)), jnp.exp2), want, rtol=2e-5,
                               atol=2e-6)
    hlo = jax.jit(merge_splits).lower(f32(acc), f32(m), f32(l)).as_text()
    assert "reduce" not in hlo


def test_split_merge_kernel_is_merge_splits_in_the_attention_layout():
    """merge_splits_kernel (Pallas interpreter): merge_splits' answer (an empty split weighs nothing), written at
    [batch, 1, KV head x group + head, hd] from the partials of each (sequence, KV head)."""
    from pallas_kernels.split_merge import merge_splits, merge_splits_kernel

    rng = np.random.default_rng(1)
    splits, b, kv, g, hd = 5, 2, 3, 4, 16
    acc = jnp.asarray(rng.normal(size=(splits, b * kv, g, hd)), jnp.float32)
    m = jnp.asarray(rng.normal(size=(splits, b * kv, g)) * 4, jnp.float32).at[3, 1].set(-jnp.inf)
    l = jnp.asarray(rng.uniform(1, 3, size=(splits, b * kv, g)), jnp.float32).at[3, 1].set(0)
    want = merge_splits(*(jnp.moveaxis(x, 0, 1) for x in (acc, m, l))).reshape(b, 1, kv * g, hd)
    got = merge_splits_kernel(acc, m, l, batch=b, dtype=jnp.float32, interpret=True)
    assert got.shape == (b, 1, kv * g, hd)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert np.isfinite(np.asarray(got)).all()


def test_ar_steps_take_the_one_row_kernel_with_pallas_inplace():
    """'pallas-inplace' attention of one row per sequence over the stacked cache runs decode_attention (and the tree
    kernel with Tuning(decode_attention=False), for a longer block, or past MAX_KEYS batch x slots): the same
    output within bf16's error."""
    from ddtree_jax import model
    from pallas_kernels import decode_attention as da

    q, k, v, prefix, _ = attention_inputs(0, 2, 1, 8, 2, 96, 64, [3, 70])  # S 96, head_dim 64
    stacked = [jnp.stack([-x, x]) for x in (k, v)]
    one = jnp.ones((2, 1, 1), jnp.uint32)
    off = Tuning(decode_attention=False)
    attend = {t: model.attention_fn("pallas-inplace-interpret", t) for t in (Tuning(), off)}
    run = lambda t=Tuning(): jax.jit(lambda *a: attend[t](*a[:5], layer=a[5]))  # noqa: E731
    args = (q, *stacked, prefix, one, jnp.int32(1))
    assert "decode_attention" in run().lower(*args).as_text()
    out = np.asarray(run()(*args), np.float32)
    assert "decode_attention" not in run(off).lower(*args).as_text()
    tree = np.asarray(run(off)(*args), np.float32)
    assert np.linalg.norm(out - tree) / np.linalg.norm(tree) < 5e-3
    q2 = jnp.zeros((2, 1, 2, 16), jnp.bfloat16)
    big = jnp.zeros((1, 2, da.MAX_KEYS // 2 + 1, 1, 16), jnp.bfloat16)  # batch 2: past MAX_KEYS
    assert model.decode_attention_applies(q2[:1], big) and not model.decode_attention_applies(q2, big)  # MAX_KEYS
    assert not model.decode_attention_applies(q2[:1], big, off)
    assert not model.decode_attention_applies(jnp.zeros((1, 2, 2, 16), jnp.bfloat16), big)  # two rows: a block


# ------------------------------------------------------------------------------------ q/k norm, RoPE, K/V write
@pytest.mark.parametrize("b,t,h,kv,hd,start,normed", [
    (1, 1, 8, 2, 64, [30], True),  # an AR step
    (2, 5, 6, 2, 32, [14, 3], True),  # heads not a multiple of the 8 per program; rows past the cache dropped
    (2, 3, 16, 1, 64, [0, 38], False),  # no q/k norm (Llama); 16 q heads: two programs
])
def test_qkv_write_is_its_definition(b, t, h, kv, hd, start, normed):
    """qkv_write (Pallas interpreter) gives its reference exactly: q normed and rotated, the layer's slots start[b] + t
    of both caches written (rows past the cache dropped), every other slot and layer untouched."""
    from pallas_kernels import qkv_write as qw

    slots = 40
    args = qkv_write_inputs(b * 100 + t, b, t, h, kv, hd, layers=3, slots=slots, start=start, normed=normed)
    kernel = jax.jit(functools.partial(qw.qkv_write, heads=h, eps=1e-6, interpret=True))
    got = kernel(*args)
    want = jax.jit(functools.partial(qw.reference, heads=h, eps=1e-6))(*args)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    k_old, k_new = np.asarray(args[5], np.float32), np.asarray(got[1], np.float32)
    written = np.zeros(k_old.shape, bool)
    for bi, s0 in enumerate(start):
        written[1, bi, s0:min(s0 + t, slots)] = True
    assert (k_new[~written] == k_old[~written]).all() and (k_new[written] != k_old[written]).any()
    with pytest.raises(ValueError, match="does not match the cache"):
        qw.qkv_write(args[0][:, :, 1:], *args[1:], heads=h, eps=1e-6, interpret=True)
    # q in the tree kernel's row layout (q_rows): row t * G + g of KV head kh holds head kh * G + g; caches the same
    g, rows = h // kv, t * (h // kv) + 3
    packed, k_p, v_p = jax.jit(functools.partial(qw.qkv_write, heads=h, eps=1e-6, interpret=True, q_rows=rows))(*args)
    assert isinstance(packed, tat.PackedQ) and packed.rows.shape == (b, kv, rows, hd) and packed.shape == got[0].shape
    want_rows = np.asarray(got[0], np.float32).reshape(b, t, kv, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv, -1, hd)
    np.testing.assert_array_equal(np.asarray(packed.rows[:, :, : t * g], np.float32), want_rows)
    np.testing.assert_array_equal(np.asarray(packed.unpack(), np.float32), np.asarray(got[0], np.float32))
    for x, y in zip((k_p, v_p), got[1:]):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    with pytest.raises(ValueError, match="q_rows"):
        qw.qkv_write(*args, heads=h, eps=1e-6, interpret=True, q_rows=t * g - 1)
    if normed:  # every layer's norm weights, read at the layer in place: the same result
        qn, kn, layer = args[1], args[2], int(args[7])
        q_all, k_all = (jnp.stack([w if i == layer else -w for i in range(3)]) for w in (qn, kn))
        stacked = kernel(args[0], q_all, k_all, *args[3:])
        for x, y in zip(stacked, got):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
        with pytest.raises(ValueError, match="both be"):
            qw.qkv_write(args[0], q_all, kn, *args[3:], heads=h, eps=1e-6, interpret=True)


@pytest.mark.parametrize("shape", [(1, 1, 2560), (2, 3, 100)])  # an AR row of Qwen3-4B; D not a power of two
def test_add_norm_is_the_residual_add_and_rms_norm(shape):
    """add_norm (Pallas interpreter): the sum exactly, the normalised row as model.rms_norm's to a last bf16 bit."""
    from ddtree_jax import model
    from pallas_kernels import add_norm

    rng = np.random.default_rng(shape[-1])
    x, d = (jnp.asarray(rng.standard_normal(shape) * 4, jnp.float32) for _ in range(2))
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(shape[-1]), jnp.bfloat16)
    kernel = jax.jit(functools.partial(add_norm.add_norm, eps=1e-6, interpret=True))
    s, h = kernel(x, d, w)
    want_s, want_h = jax.jit(functools.partial(add_norm.reference, eps=1e-6))(x, d, w)
    normed = jax.jit(lambda x, d, w: model.rms_norm(x + d, w, 1e-6))(x, d, w)
    np.testing.assert_array_equal(np.asarray(want_h, np.float32), np.asarray(normed, np.float32))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(want_h, np.float32), rtol=2**-7, atol=0)
    assert h.dtype == jnp.bfloat16 and h.shape == shape
    with pytest.raises(ValueError, match="add_norm takes float32"):
        add_norm.add_norm(x.astype(jnp.bfloat16), d, w, eps=1e-6, interpret=True)
    w_all = jnp.stack([-w, w, 2 * w])  # every layer's weights, read at the layer (in the lengths operand) in place;
    lens = jnp.zeros((shape[0],), jnp.int32)  # a kernel reading a prefix length as the layer would take row 0
    s2, h2 = kernel(x, d, w_all, jnp.int32(1), lens)
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(s))
    np.testing.assert_array_equal(np.asarray(h2, np.float32), np.asarray(h, np.float32))
    with pytest.raises(ValueError, match="with layer and prefix_len"):
        add_norm.add_norm(x, d, w_all, eps=1e-6, interpret=True)
    # the tap: s, cast to the taps' dtype, written in place at slots[layer] (here slot 2); the other slots kept
    taps = jnp.asarray(rng.standard_normal((3, *shape)), jnp.bfloat16)
    slots = jnp.asarray([0, 2, 1], jnp.int32)
    s3, h3, taps3 = kernel(x, d, w_all, jnp.int32(1), lens, tap=(taps, slots))
    np.testing.assert_array_equal(np.asarray(s3), np.asarray(s))
    np.testing.assert_array_equal(np.asarray(h3, np.float32), np.asarray(h, np.float32))
    want = jax.lax.dynamic_update_index_in_dim(taps, s.astype(jnp.bfloat16), 2, 0)
    np.testing.assert_array_equal(np.asarray(taps3, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="tap takes stacked w"):
        add_norm.add_norm(x, d, w, eps=1e-6, tap=(taps, slots), interpret=True)
    with pytest.raises(ValueError, match="tap takes stacked w"):
        add_norm.add_norm(x, d, w_all, jnp.int32(1), lens, eps=1e-6, tap=(taps, slots[:2]), interpret=True)
    # delta as partial sums [P, ...] (a split product): added up in order, then as one delta
    parts = jnp.asarray(rng.standard_normal((3, *shape)) * 4, jnp.float32)
    whole = parts[0] + parts[1] + parts[2]
    for args in ((w,), (w_all, jnp.int32(1), lens)):
        s4, h4 = kernel(x, parts, *args)
        s5, h5 = kernel(x, whole, *args)
        np.testing.assert_array_equal(np.asarray(s4), np.asarray(s5))
        np.testing.assert_array_equal(np.asarray(h4, np.float32), np.asarray(h5, np.float32))
    np.testing.assert_array_equal(np.asarray(add_norm.reference(x, parts, w, eps=1e-6)[0]), np.asarray(s4))
    with pytest.raises(ValueError, match=r"or \[P, \*x.shape\]"):
        add_norm.add_norm(x, parts[None], w, eps=1e-6, interpret=True)


def test_the_verify_splits_the_products_add_norm_sums(monkeypatch):
    """At B x T within model.SPLIT_ROWS (NARROW_SPLIT_ROWS for outputs up to NARROW_WIDTH columns, as this model's),
    with the layer kernels, the attention's output projection and the MLP's down projection come back as two partial
    products each, which the next add_norm (the layer's second norm; the next layer's first, or the final one) adds
    up: the layer loop carries the MLP's, the norms read [2, B x T, D], and hidden states, caches and taps are those
    of the unsplit products (to the f32 sums' order; in the rounds' layout, input-major: both layouts' partials are
    test_output_projection_splits_over_heads'). O_SPLITS = 1 leaves o whole; outside the rows, or with XLA's norms,
    one product each."""
    from ddtree_jax import decode, model
    from pallas_kernels.bitmask import causal_bits

    tcfg, plain = _two_layer_target()
    b, t = 2, 4
    cache, tokens, positions = _block_on_a_filled_cache(tcfg, b, t, seed=1)
    impl, d = "pallas-inplace-interpret", tcfg.hidden_size
    depth_o = tcfg.num_heads * tcfg.head_dim

    def forward(p, c):
        return model.forward(p, tcfg, tokens, positions, c, causal_bits(b, t), taps=(0, 1), attention=impl)

    def norm_deltas(p):  # the delta operand of every add_norm call
        return [c[2] for c in _pallas_calls(jax.make_jaxpr(lambda p, c: forward(p, c))(p, cache)) if c[0] == "add_norm"]

    one, two = (1, b * t, d), (2, b * t, d)
    for layout in ("stacked-fused", "stacked-out-major-fused"):
        params = decode.device_layout(plain, layout=layout)
        numbers = layout == "stacked-fused"  # the rounds' layout; both layouts' partials: the test below
        want = jax.jit(lambda p, c: forward(p, c))(params, cache) if numbers else None
        assert norm_deltas(params) == [one] * 3  # 8 rows: below NARROW_SPLIT_ROWS
        assert d <= model.NARROW_WIDTH
        monkeypatch.setattr(model, "SPLIT_ROWS", (b * t, b * t))
        assert norm_deltas(params) == [one] * 3  # a wide output's rows: not this model's
        monkeypatch.setattr(model, "NARROW_SPLIT_ROWS", (b * t, b * t))
        assert model.product_splits(impl, b * t, tcfg.intermediate_size, d, model.DOWN_SPLITS) == 2
        assert model.product_splits(impl, b * t, depth_o, d, model.O_SPLITS) == 2
        assert model.product_splits(impl, b * t, depth_o, d, 3) == 1  # 3 does not divide the depth
        assert norm_deltas(params) == [two] * 3  # o's partials to the scan body's second norm, down's to the rest
        got = jax.jit(lambda p, c: forward(p, c))(params, cache) if numbers else None
        monkeypatch.setattr(model, "O_SPLITS", 1)
        assert norm_deltas(params) == [two, one, two]  # the o product whole
        if numbers:
            got_down = jax.jit(lambda p, c: forward(p, c))(params, cache)
            for res in (got, got_down):
                for x, y in ((res[0], want[0]), (res[1].k, want[1].k), (res[1].v, want[1].v), (res[2], want[2])):
                    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=2**-7,
                                               atol=1e-5)
            assert not np.array_equal(np.asarray(got[2], np.float32), np.zeros(got[2].shape))
        xla_norms = Tuning(add_norm=False)  # XLA's norms: one product
        assert model.product_splits(impl, b * t, tcfg.intermediate_size, d, model.DOWN_SPLITS, xla_norms) == 1
        assert model.product_splits("xla", b * t, tcfg.intermediate_size, d, model.DOWN_SPLITS) == 1
        monkeypatch.undo()


def test_the_split_rows_depend_on_the_output_width():
    """The verify splits o and down at 128-384 rows for outputs wider than model.NARROW_WIDTH (Qwen3-8B's 4096), at
    16-384 up to it (Qwen3-4B's 2560: measured faster from 16 rows, 8B not), with the layer kernels only."""
    from ddtree_jax import model

    impl, depth = "pallas-inplace-interpret", 12288
    got = {(w, r): model.product_splits(impl, r, depth, w, 2) for w in (2560, 4096) for r in (8, 16, 72, 128, 384, 385)}
    assert got == {(2560, 8): 1, (2560, 16): 2, (2560, 72): 2, (2560, 128): 2, (2560, 384): 2, (2560, 385): 1,
                   (4096, 8): 1, (4096, 16): 1, (4096, 72): 1, (4096, 128): 2, (4096, 384): 2, (4096, 385): 1}
    assert model.product_splits("xla", 72, depth, 2560, 2) == 1


def test_output_projection_splits_over_heads():
    """model.output_projection's partial sums, over halves of the heads, add up to the whole product in both weight
    layouts, and are the products of each half's heads."""
    from ddtree_jax import model

    rng = np.random.default_rng(3)
    b, t, h, hd, d = 2, 3, 4, 8, 16
    o = jnp.asarray(rng.standard_normal((b, t, h, hd)), jnp.float32)
    wo = jnp.asarray(rng.standard_normal((h, hd, d)), jnp.float32)
    for om in (False, True):
        w = types.SimpleNamespace(wo=jnp.transpose(wo, (2, 0, 1)) if om else wo, output_major=om)
        whole = model.output_projection(o, w)
        parts = model.output_projection(o, w, splits=2)
        assert parts.shape == (2, b, t, d)
        np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(whole), rtol=1e-5, atol=1e-5)
        first = jnp.einsum("bthk,hkd->btd", o[:, :, : h // 2], wo[: h // 2])
        np.testing.assert_allclose(np.asarray(parts[0]), np.asarray(first), rtol=1e-5, atol=1e-5)


def _pallas_eqns(closed) -> list:
    """Every pallas_call equation of a closed jaxpr, nested ones included."""
    out = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                out.append(e)
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return out


def _pallas_calls(closed) -> list[tuple]:
    """(name, operand shapes...) of every pallas_call in a closed jaxpr, nested ones included."""
    return [(e.params["name"], *(tuple(v.aval.shape) for v in e.invars)) for e in _pallas_eqns(closed)]


def _pallas_outputs(closed, name: str) -> tuple[tuple, ...]:
    """The output shapes of the first pallas_call named ``name`` in a closed jaxpr (nested ones included)."""
    return [tuple(tuple(v.aval.shape) for v in e.outvars) for e in _pallas_eqns(closed) if e.params["name"] == name][0]


def test_the_model_writes_q_k_v_by_the_kernel_with_pallas_inplace():
    """model.forward with 'pallas-inplace' attention and fused q|k|v weights takes the qkv_write kernel and the
    add_norm kernel, which read every layer's norm weights in place (no slice of them per layer), the first norm of
    a layer also writing the previous layer's output into the taps (Tuning(qkv_write=False, add_norm=False), or
    unfused weights for the first, XLA's forms); both give the same hidden states, caches and taps (on CPU to the
    bit here; on a GPU XLA may keep f32 between the operations qkv_write rounds, and sums a mean square in another
    order)."""
    from ddtree_jax import decode, model
    from pallas_kernels.bitmask import causal_bits

    tcfg, plain = _two_layer_target()
    fused = decode.device_layout(plain, layout="stacked-out-major-fused")
    b, t = 2, 4
    cache, tokens, positions = _block_on_a_filled_cache(tcfg, b, t, seed=0)
    layer0 = jax.tree.map(lambda x: x[0], fused.layers)
    impl = "pallas-inplace-interpret"

    # both layers tapped: layer 0 by layer 1's first norm, layer 1 after the last
    def forward(p, c, taps=(0, 1), tuning=Tuning()):
        return model.forward(p, tcfg, tokens, positions, c, causal_bits(b, t), taps=taps, attention=impl,
                             tuning=tuning)

    def run(params, tuning=Tuning()):
        fn = jax.jit(lambda p, c: forward(p, c, tuning=tuning))
        return fn(params, cache), fn.lower(params, cache).as_text()

    (hk, ck, fk), text = run(fused)
    assert model.qkv_kernel_applies(impl, layer0, hk.astype(jnp.bfloat16), cache.k) and "qkv_write" in text
    assert "add_norm" in text  # the residual adds and norms: pallas_kernels.add_norm
    calls = _pallas_calls(jax.make_jaxpr(forward)(fused, cache))
    layers, d, hd = tcfg.num_layers, tcfg.hidden_size, tcfg.head_dim  # the layers' norm weights read in place:
    assert [c[3] for c in calls if c[0] == "add_norm"] == [(layers, d), (layers, d), (d,)]  # every layer's, final
    norms = [c for c in calls if c[0] == "add_norm"]  # the first norm also writes the taps (+ a spare slot) in place
    assert norms[0][5:] == ((layers,), (3, b * t, d)) and (len(norms[1]), len(norms[2])) == (5, 4)
    untapped = _pallas_calls(jax.make_jaxpr(functools.partial(forward, taps=()))(fused, cache))
    assert len([c for c in untapped if c[0] == "add_norm"][0]) == 5  # no taps: no taps operand
    assert [c[2:4] for c in calls if c[0] == "qkv_write"] == [((layers, hd), (layers, hd))]
    assert not model.qkv_kernel_applies("xla", layer0, hk.astype(jnp.bfloat16), cache.k)
    rows = tat.packed_rows(b, t, tcfg.num_heads, tcfg.num_kv_heads, cache.k.shape[2], hd)  # q in the tree kernel's
    assert _pallas_outputs(jax.make_jaxpr(forward)(fused, cache), "qkv_write")[0] == (b, tcfg.num_kv_heads, rows, hd)
    (hx, cx, fx), text = run(fused, Tuning(qkv_write=False, add_norm=False))
    assert "qkv_write" not in text and "add_norm" not in text
    assert "qkv_write" not in run(plain)[1]  # unfused weights: XLA's form
    np.testing.assert_array_equal(np.asarray(hk, np.float32), np.asarray(hx, np.float32))
    np.testing.assert_array_equal(np.asarray(fk, np.float32), np.asarray(fx, np.float32))
    assert fk.shape == (b, t, 2 * d) and np.abs(np.asarray(fk[..., :d], np.float32)).max() > 0  # layer 0 written
    for a, c in ((ck.k, cx.k), (ck.v, cx.v)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


def _primitives(jaxpr) -> set[str]:
    """The primitive names of a jaxpr's equations, nested ones included."""
    names = set()
    for e in jaxpr.eqns:
        names.add(e.primitive.name)
        for v in e.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    names |= _primitives(inner)
    return names


def test_the_layer_loop_makes_the_tree_kernels_mask_once():
    """model.forward with 'pallas-inplace' attention makes the tree kernel's mask operand (model.layer_mask) before
    its layer loop: no shift of the mask words inside the loop's body (the kernel given the bits would make it in
    every layer). An AR step (decode_attention) and XLA's attention take the bits as they are."""
    from ddtree_jax import model
    from pallas_kernels.bitmask import causal_bits

    tcfg, tparams = _two_layer_target()
    b, t = 2, 4
    cache, tokens, positions = _block_on_a_filled_cache(tcfg, b, t, seed=1)
    bits = causal_bits(b, t)

    fn = lambda c: model.forward(tparams, tcfg, tokens, positions, c, bits, taps=(0,),  # noqa: E731
                                 attention="pallas-inplace-interpret")
    (scan,) = [e for e in jax.make_jaxpr(fn)(cache).jaxpr.eqns if e.primitive.name == "scan"]
    body = _primitives(scan.params["jaxpr"].jaxpr)
    assert "shift_left" not in body and "pallas_call" in body
    mask = model.layer_mask("pallas-inplace", bits, cache.length, tcfg.num_heads, cache.k)
    assert isinstance(mask, tat.KernelMask)
    assert model.layer_mask("xla", bits, cache.length, tcfg.num_heads, cache.k) is bits
    one = causal_bits(b, 1)  # an AR step: decode_attention reads the bits
    assert model.layer_mask("pallas-inplace", one, cache.length, tcfg.num_heads, cache.k) is one


def test_the_drafter_reads_its_q_k_norms_in_place_with_pallas_inplace():
    """draft.propose with the GPU's fused output-major drafter and 'pallas-inplace' attention: qkv_write takes every
    layer's q/k norm weights, and the logits are the unstacked drafter's (each layer's own weights) to the bit, and
    XLA's within bf16's error."""
    from ddtree_jax import cache as kvcache, draft, params as params_lib, shapes, weight_layout

    tcfg, dcfg = shapes.model_configs(shapes.SHAPES["tiny"])
    tparams, dparams = shapes.build_params(tcfg, dcfg, jnp.bfloat16)
    fused = weight_layout.device_layout(dparams, layout=weight_layout.DRAFT_GPU_LAYOUT)
    lc, b = dcfg.layers, 2
    rng = np.random.default_rng(3)
    cache = kvcache.init(lc.num_layers, b, 96, lc.num_kv_heads, lc.head_dim, jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal(cache.k.shape), jnp.bfloat16) for _ in range(2))
    cache = kvcache.KVCache(k, v, jnp.asarray([17, 40], jnp.int32))
    bonus = jnp.asarray([3, 5], jnp.int32)
    impl = "pallas-inplace-interpret"
    run = jax.jit(lambda p, a: draft.propose(p, dcfg, tparams, cache, bonus, attention=a), static_argnums=1)
    calls = _pallas_calls(jax.make_jaxpr(lambda p: run(p, impl))(fused))
    norms = [c[2:4] for c in calls if c[0] == "qkv_write"]
    assert norms == [((lc.num_layers, lc.head_dim), (lc.num_layers, lc.head_dim))]
    stacked, unstacked, xla = (np.asarray(run(p, a), np.float32) for p, a in (
        (fused, impl), (params_lib.unstack_layers(fused), impl), (fused, "xla")))
    np.testing.assert_array_equal(stacked, unstacked)
    assert np.linalg.norm(stacked - xla) / np.linalg.norm(xla) < 1e-2


# ------------------------------------------------------------------------------------ the tree build's kernels
@pytest.mark.parametrize("rows,vocab,k,dtype", [
    (3, 1000, 10, jnp.float32),  # a partial last chunk
    (2, 4096, 64, jnp.float32),  # exactly k chunks of 64: every chunk selected
    (2, 2000, 16, jnp.bfloat16),  # bf16 logits, values returned exactly as float32
    (1, 20000, 300, jnp.float32),  # above k = 256: chunks of 32, k not a power of two
])
def test_vocab_top_k_is_lax_top_k_exactly(rows, vocab, k, dtype):
    """The four vocabulary top-k kernels (Pallas interpreter): lax.top_k's values, ids and tie order, with heavy
    ties (rounded values), -inf and both zeros (-0.0 below +0.0), on continuous values, and on constant rows (every
    entry of the k chunks a candidate: k * 64 of them ranked, all tied)."""
    rng = np.random.default_rng(vocab + k)
    x = np.round(2 * rng.standard_normal((rows, vocab))).astype(np.float32)
    x[:, ::7], x[:, 3::11], x[:, 5::13] = -0.0, 0.0, -np.inf
    reference = jax.jit(lambda a: jax.lax.top_k(a.astype(jnp.float32), k))
    kernel = jax.jit(lambda a: vocab_top_k.top_k(a, k, interpret=True))  # one program for the three arrays
    for arr in (x, rng.standard_normal((rows, vocab)).astype(np.float32), np.full((rows, vocab), 1.5, np.float32)):
        arr = jnp.asarray(arr).astype(dtype)
        want = reference(arr)
        got = kernel(arr)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            assert g.dtype == w.dtype


def test_vocab_top_k_refuses_rows_too_short_for_its_chunks():
    assert vocab_top_k.supports(64 * 16, 16) and not vocab_top_k.supports(64 * 16 - 64, 16)
    with pytest.raises(ValueError, match="at least 16 chunks of 64"):
        vocab_top_k.top_k(jnp.zeros((2, 960)), 16, interpret=True)
    with pytest.raises(ValueError, match="int32"):
        vocab_top_k.top_k(jnp.zeros((2, 4096), jnp.int32), 16, interpret=True)


@pytest.mark.parametrize("seed", range(4))
def test_selection_takes_lax_top_k_s_entries(seed):
    """selection.select (plain jnp, as the kernels trace it): lax.top_k's k entries and their places in index order;
    heavy ties, -inf, both zeros and values over seven decades."""
    rng = np.random.default_rng(seed)
    n = (37, 300)[seed % 2]
    select = jax.jit(selection.select)  # k traced: one program per n
    for _ in range(8):
        k = int(rng.integers(1, n + 1))
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
        if seed < 2:
            x = np.round(x)
        x[rng.integers(0, n, 3)] = -np.inf
        x[rng.integers(0, n, 3)] = -0.0
        key = selection.order_key(jnp.asarray(x))
        vals, ids = jax.lax.top_k(jnp.asarray(x), k)
        want = np.zeros(n, bool)
        want[np.asarray(ids)] = True
        sel, slot = (np.asarray(a) for a in select(key, k))
        np.testing.assert_array_equal(sel, want)
        np.testing.assert_array_equal(slot[np.sort(np.asarray(ids))], np.arange(k))
        assert np.all(slot[~want] == k)


@pytest.mark.parametrize("b,depths,budget,vocab,case", [
    (2, 15, 16, 300, "continuous"),  # DFlash's 15 depths
    (2, 6, 64, 300, "ties"),  # heavy ties, a depth of -inf past its second token
    (1, 5, 24, 10, "ties"),  # K < budget, a budget not a power of two
    (1, 4, 7, 7, "zeros"),  # every log-prob 0: all paths tie
    (1, 1, 8, 20, "continuous"),  # one depth: no scan
])
def test_best_first_kernel_builds_the_xla_scan_s_tree(b, depths, budget, vocab, case):
    """The best_first kernels (Pallas interpreter) give tree._best_first_one's tokens, depths and parents, and
    tree.ancestor_bits' words for them."""
    rng = np.random.default_rng(budget + depths)
    x = rng.standard_normal((b, depths, vocab)).astype(np.float32) * 2
    x = {"ties": np.round(x), "zeros": np.zeros_like(x)}.get(case, x)
    lp, ids = jax.jit(trees.top_log_probs, static_argnums=1)(jnp.asarray(x), min(budget, vocab))
    if case == "ties" and depths > 3:
        lp = lp.at[:, 3, 2:].set(-jnp.inf)
    want = jax.jit(jax.vmap(lambda lp_, ids_: trees._best_first_one(lp_, ids_, budget, select="sort")))(lp, ids)
    *got, bits = jax.jit(functools.partial(bf.best_first, budget=budget, interpret=True))(lp, ids)
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape == (b, budget)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), want[2]], axis=1)
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(trees.ancestor_bits(parents, depths)))


def test_best_first_kernel_refuses_lists_longer_than_the_budget_and_too_many_pairs():
    with pytest.raises(ValueError, match="0 < K <= budget"):
        bf.best_first(jnp.zeros((1, 3, 9)), jnp.zeros((1, 3, 9), jnp.int32), 8, interpret=True)
    assert bf.supports(1024, 1024, 15) and not bf.supports(2048, 2048, 15)  # 16,8xx pairs: 32768 padded
    with pytest.raises(ValueError, match="at most 8192 candidate pairs"):
        bf.best_first(jnp.zeros((1, 15, 2048)), jnp.zeros((1, 15, 2048), jnp.int32), 2048, interpret=True)
    assert [bf.own_per_program(n) for n in (280, 1024, 1025, 1466, 3280)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="at most 32767 keys"):
        selection.select(jnp.zeros((2**15,), jnp.int32), 4)


def test_kernel_sizes_beyond_the_selection_s_limit_fall_back_to_xla_s_forms(monkeypatch):
    """The vocabulary top-k kernels need k chunks (of 32 above k = 256) and at most selection.MAX_KEYS chunk maxima;
    beyond them top_k_by_kernel takes its fallback, the same result; tree_from_lists takes rank counting where
    select='kernel' is beyond the kernel."""
    assert vocab_top_k.supports(151936, 1024) and not vocab_top_k.supports(32 * 1023, 1024)
    assert not vocab_top_k.supports(64 * 2**15, 16)  # 32768 chunk maxima: one more than a selection takes
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40000)).astype(np.float32))
    for g, w in zip(jax.jit(trees.top_k_by_kernel, static_argnums=1)(x, 2000),
                    jax.jit(jax.lax.top_k, static_argnums=1)(x, 2000)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="at least 2000 chunks of 32"):
        vocab_top_k.top_k(x, 2000, interpret=True)
    calls = []
    lp, ids = jax.jit(trees.top_log_probs, static_argnums=1)(x.reshape(1, 4, 10000), 16)
    want = jax.jit(functools.partial(trees.tree_from_lists, budget=16, select="count"))(lp, ids)
    monkeypatch.setattr(bf, "supports", lambda *a: calls.append(a) or False)  # as if beyond the kernel's sizes
    got = jax.jit(functools.partial(trees.tree_from_lists, budget=16, select="kernel"))(lp, ids)
    assert calls == [(16, 16, 4)]
    for name in ("tokens", "depths", "parents", "bits"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))


@pytest.mark.parametrize("n1,kind,max_depth", [(17, "random", 15), (65, "random", 15), (257, "random", 15),
                                               (40, "star", 1), (33, "chain", 32)])
def test_ancestor_bits_kernel_is_the_xla_form(n1, kind, max_depth):
    """The ancestor-bits kernel (Pallas interpreter) gives tree.ancestor_bits' words: one and several 32-bit
    words, a budget-256 tree, stars and a full-depth chain."""
    rng = np.random.default_rng(n1)
    parents = jnp.asarray(np.stack([random_parents(rng, n1, kind, max_depth) for _ in range(3)]))
    got = jax.jit(functools.partial(ancestor_bits.ancestor_bits, max_depth=max_depth, interpret=True))(parents)
    want = jax.jit(trees.ancestor_bits, static_argnums=1)(parents, max_depth)
    assert got.dtype == want.dtype == jnp.uint32 and got.shape == want.shape == (3, n1, -(-n1 // 32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
