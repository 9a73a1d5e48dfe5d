"""Layer-level parity of the target and drafter with transformers (fixtures from the reference code)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import cache as kvcache
from ddtree_jax import decode, draft, model, params as P
from pallas_kernels.bitmask import causal_bits
from tests.conftest import fixture_path


# jitted as decode runs them: one compiled program per shape and layout, where eager calls dispatch every layer's ops
# (and a scan compiled again) on each chunk
_forward = jax.jit(model.forward, static_argnums=1, static_argnames="taps")
_logits = jax.jit(model.logits)


def run_chunked(cfg, params, tokens, chunk, taps=()):
    """Prefill [T] tokens chunk by chunk through the cache; returns logits [T, V] and taps [T, F]."""
    t = len(tokens)
    cache = kvcache.init(cfg.num_layers, 1, decode.round_up(t, chunk), cfg.num_kv_heads, cfg.head_dim, params.embed.dtype)
    toks = np.zeros(decode.round_up(t, chunk), np.int32)
    toks[:t] = tokens
    outs, feats = [], []
    for s in range(0, t, chunk):
        cache.length = jnp.asarray([s], jnp.int32)
        h, cache, f = _forward(
            params, cfg, jnp.asarray(toks[None, s : s + chunk]), jnp.arange(s, s + chunk)[None], cache,
            causal_bits(1, chunk), taps=taps,
        )
        outs.append(_logits(params, h)[0])
        feats.append(f[0] if taps else None)
    lg = np.concatenate(outs)[:t]
    return lg, (np.concatenate(feats)[:t] if taps else None)


def test_qwen3_logits_and_every_hidden_state(target, logits_npz):
    cfg, params = target
    lg, feats = run_chunked(cfg, params, logits_npz["prompt"], chunk=8, taps=tuple(range(cfg.num_layers)))
    assert np.abs(lg - logits_npz["target_logits"]).max() < 1e-4
    hs = logits_npz["target_hidden_states"]  # [L+1, T, D]; index 0 is the embedding output
    d = cfg.hidden_size
    emb = np.asarray(params.embed)[logits_npz["prompt"]]
    assert np.abs(emb - hs[0]).max() < 1e-6
    for layer in range(cfg.num_layers):
        assert np.abs(feats[:, layer * d : (layer + 1) * d] - hs[layer + 1]).max() < 1e-4, layer


def test_drafter_hidden_and_logits(target, drafter, logits_npz):
    cfg, params = target
    dcfg, dparams = drafter
    _, feats = run_chunked(cfg, params, logits_npz["prompt"], chunk=32, taps=dcfg.target_layer_ids)
    assert np.abs(feats - logits_npz["draft_context_features"]).max() < 1e-4
    t = len(logits_npz["prompt"])
    dc = dcfg.layers
    dcache = kvcache.init(dc.num_layers, 1, 64, dc.num_kv_heads, dc.head_dim, jnp.float32)
    dcache = draft.extend(dparams, dcfg, dcache, jnp.asarray(feats[None]), jnp.asarray([t]))
    assert int(dcache.length[0]) == t
    block = logits_npz["draft_block"]
    assert block[0] != dcfg.mask_token_id and (block[1:] == dcfg.mask_token_id).all()
    lg = draft.propose(dparams, dcfg, params, dcache, jnp.asarray(block[:1], jnp.int32))
    assert np.abs(np.asarray(lg[0]) - logits_npz["draft_logits"]).max() < 1e-4


def test_llama3_rope_sharded_tied_logits(llama):
    cfg, params = llama
    assert cfg.rope.kind == "llama3" and cfg.tie_word_embeddings and params.lm_head is None
    ref = np.load(fixture_path("llama_logits.npz"))
    lg, _ = run_chunked(cfg, params, ref["prompt"], chunk=64)  # 300 tokens in 5 chunks
    assert np.abs(lg - ref["logits"]).max() < 1e-4


def test_llama_greedy_equals_transformers(llama):
    ref = np.load(fixture_path("llama_logits.npz"))
    prompt = ref["greedy_prompt"].tolist()
    n = len(ref["greedy_output"]) - len(prompt)
    res = decode.generate(llama, [prompt], decode.GenerateOptions(max_new_tokens=n))
    assert res.output_ids[0] == ref["greedy_output"].tolist()


def test_bfloat16_first_tokens_agree(target, reference_runs):
    """bf16 weights give the f32 reference's first tokens up to a near tie: a run may leave them only where the f32
    logits of the two tokens are within 0.1 (bf16 keeps 8 bits: its logits of size ~4 move by a few hundredths).
    With gate and up rounded to bf16 (PyTorch's rounding, model.mlp) one prompt leaves at a gap of 0.05."""
    cfg, params = target
    bf16 = (cfg, P.cast(params, jnp.bfloat16))
    res = decode.generate(bf16, [r["prompt"] for r in reference_runs], decode.GenerateOptions(max_new_tokens=8))
    agree = 0
    for r, out in zip(reference_runs, res.output_ids):
        n = len(r["prompt"]) + 8
        assert out[: len(r["prompt"])] == r["prompt"] and len(out) == n
        k = next((j for j in range(n) if out[j] != r["ar"][j]), n)
        agree += k == n
        if k < n:
            lg, _ = run_chunked(cfg, params, r["ar"][:k], chunk=k)
            assert 0 <= lg[-1][r["ar"][k]] - lg[-1][out[k]] < 0.1, (k, r["ar"][k], out[k])
    assert agree >= len(reference_runs) - 1


@pytest.mark.parametrize("tied", [False, True])
def test_output_major_layout_same_logits(target, llama, tied):
    """Output-major weights ([out, in]): one row goes through a row reduction, more rows through a GEMM;
    both give the input-major layout's logits, stacked or per layer, for an untied and a tied head."""
    import jax

    cfg, tp = llama if tied else target
    tokens = [3, 17, 5, 40, 9]
    ref, _ = run_chunked(cfg, tp, tokens, chunk=1)
    for laid in (P.output_major(tp), P.unstack_layers(P.output_major(tp))):
        assert laid.output_major and P.output_major(laid) is laid
        for chunk in (1, 4):
            lg, _ = run_chunked(cfg, laid, tokens, chunk=chunk)
            np.testing.assert_allclose(lg, ref, atol=2e-5, rtol=0)
    w = P.output_major(tp).layers.wo[0]  # [D, H, hd]
    assert w.shape == (cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    one, many = (jax.make_jaxpr(lambda x: model.linear(x, w, "bthk,hkd->btd", True))(jnp.ones((1, n, cfg.num_heads, cfg.head_dim)))
                 for n in (1, 3))
    assert "dot_general" not in str(one) and "reduce_sum" in str(one)  # the one-row form is a reduction
    assert "dot_general" in str(many)


@pytest.mark.parametrize("output_major", [False, True])
def test_linear_splits_the_contraction_into_partial_products(output_major):
    """model.linear(splits=S): S partial products over slices of the contracted axis, which sum to the product."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)  # [F, D] input-major
    laid = w.T if output_major else w
    whole = model.linear(x, laid, "btf,fd->btd", output_major, jnp.float32)
    for s in (2, 4):
        parts = model.linear(x, laid, "btf,fd->btd", output_major, jnp.float32, splits=s)
        assert parts.shape == (s, 2, 3, 5)
        np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(whole), rtol=1e-5, atol=1e-5)
        c = 8 // s  # each part: the product of x's and w's s-th slices
        np.testing.assert_allclose(np.asarray(parts[1]), np.asarray(x[..., c:2 * c] @ w[c:2 * c]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divisible by 3"):
        model.linear(x, laid, "btf,fd->btd", output_major, jnp.float32, splits=3)


@pytest.mark.parametrize("fused", [False, True])
def test_mlp_rounds_gate_and_up_to_the_operand_dtype(target, fused):
    """model.mlp in bf16: gate and up leave their product rounded to bf16 (as PyTorch's Linear returns them), the
    SiLU product rounded again, the down product in f32; gate and up kept in f32 would give other values."""
    cfg, tp = target
    w = jax.tree.map(lambda x: x[0], P.cast(tp, jnp.bfloat16).layers)
    if fused:
        w = jax.tree.map(lambda x: x[0], P.fuse_projections(P.cast(tp, jnp.bfloat16)).layers)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 3, cfg.hidden_size)), jnp.bfloat16)
    gu = w.w_gate if fused else jnp.concatenate([w.w_gate, w.w_up], axis=-1)
    f32 = jnp.einsum("btd,df->btf", x, gu, preferred_element_type=jnp.float32)
    down = lambda h: jnp.einsum("btf,fd->btd", h, w.w_down, preferred_element_type=jnp.float32)  # noqa: E731

    def want(inner):
        gate, up = jnp.split(f32.astype(inner), 2, axis=-1)
        return down((jax.nn.silu(gate) * up).astype(jnp.bfloat16))

    close = dict(rtol=1e-5, atol=1e-5)  # the f32 sums' order may differ; a bf16 rounding more or less would not
    got = np.asarray(jax.jit(model.mlp)(x, w))
    np.testing.assert_allclose(got, np.asarray(jax.jit(want, static_argnums=0)(jnp.bfloat16)), **close)
    assert np.abs(np.asarray(jax.jit(want, static_argnums=0)(jnp.float32)) - got).max() > 1e-3


@pytest.mark.parametrize("lengths, t", [((5, 40), 1), ((60, 127), 1), ((100, 128), 1), ((100, 130), 16), ((3, 300), 4),
                                         ((500, 506), 1)])
def test_cpu_attention_over_live_spans_equals_the_whole_cache(lengths, t):
    """On CPU the XLA attention reads only the smallest of model.key_spans holding every sequence's prefix and block
    (a lax.switch), not the whole cache; slots past it are invisible, so the output is the reference's, from the
    shortest span (both lengths in it) to the capacity."""
    layers, b, s, kv, hd, heads, layer = 3, 2, 512 + 24, 2, 16, 4, 1
    assert model.key_spans(s) == (128, 256, 512, s)
    rng = np.random.default_rng(t)
    k, v = (jnp.asarray(rng.standard_normal((layers, b, s, kv, hd)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((b, t, heads, hd)), jnp.float32)
    prefix = jnp.asarray(lengths, jnp.int32)
    bits = causal_bits(b, t)
    want = model.tree_attention_lib.tree_attention_reference(q, k, v, prefix, bits, layer=layer)
    got = jax.jit(model.live_spans(model.tree_attention_lib.tree_attention_reference))(
        q, k, v, prefix, bits, layer=jnp.int32(layer))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    # a span too short for the longest sequence would differ: the test sees the spans' effect
    short = model.tree_attention_lib.tree_attention_reference(q, k[:, :, :8], v[:, :, :8], prefix, bits, layer=layer)
    assert not np.allclose(np.asarray(short), np.asarray(want), atol=1e-3)
