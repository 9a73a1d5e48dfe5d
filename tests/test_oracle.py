"""Deep acceptance: an oracle drafter makes rounds accept long paths, and the output still equals AR.

The tiny random drafter accepts about one token a round, so the reference parity tests never commit a
long path. Here the draft logits are peaked on the target's own greedy continuation (read from a plain
AR run), with noise and deliberate decoys: DFlash's chain and DDTree's tree then accept up to the block
size (8) per round, the K/V of long, non-contiguous tree paths is compacted into the cache, and rows of
one batch accept very different lengths. We check the outputs against AR and the final caches against
a fresh forward over the output tokens.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import decode, draft as dflash, model
from ddtree_jax import cache as kvcache
from pallas_kernels.bitmask import causal_bits

NEW = 64  # generated tokens per sequence
BUDGET = 16


@pytest.fixture(scope="module")
def prompts(reference_runs):
    return [r["prompt"] for r in reference_runs]  # 5, 23 and 64 tokens


@pytest.fixture(scope="module")
def greedy(target, drafter, prompts, reference_runs):
    """AR outputs, NEW + block size tokens long (the oracle looks up to a block past the limit)."""
    extra = drafter[0].block_size
    res = decode.generate(target, prompts, decode.GenerateOptions(max_new_tokens=NEW + extra))
    for run, out in zip(reference_runs, res.output_ids):
        n = min(len(out), len(run["ar"]))
        assert out[:n] == run["ar"][:n]
    return res.output_ids


def oracle(greedy_outputs, peak, noise, decoy_rate, seed=0):
    """A proposer whose draft logits at out index length + i (i = 1 .. bs-1) are peaked on the AR token.

    Per row b: logits = noise[b] * N(0, 1) + peak[b] * onehot(AR token); with probability decoy_rate[b]
    a wrong token gets 1.5 * peak[b] on top, so the chain's argmax is wrong there but the right token is
    still the tree's second choice. The bonus sits at out index dcache.length (the committed length).
    """
    width = max(map(len, greedy_outputs))
    table = np.zeros((len(greedy_outputs), width), np.int32)
    for b, out in enumerate(greedy_outputs):
        table[b, : len(out)] = out
        table[b, len(out) :] = out[-1]
    table = jnp.asarray(table)
    peak, noise, decoy_rate = (jnp.asarray(x, jnp.float32) for x in (peak, noise, decoy_rate))

    def propose(drafter_params, draft_cfg, target_params, dcache, bonus, *, attention="xla"):
        b = bonus.shape[0]
        depth = draft_cfg.block_size - 1
        vocab = target_params.embed.shape[0]
        index = jnp.minimum(dcache.length[:, None] + jnp.arange(1, depth + 1)[None], width - 1)
        want = jnp.take_along_axis(table[:b], index, axis=1)  # [B, bs-1]

        def row(r, length):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), r), length)
            k_noise, k_decoy, k_tok = jax.random.split(key, 3)
            decoy = jax.random.uniform(k_decoy, (depth,)) < decoy_rate[r]
            wrong = (want[r] + jax.random.randint(k_tok, (depth,), 1, vocab)) % vocab
            logits = noise[r] * jax.random.normal(k_noise, (depth, vocab)) + peak[r] * jax.nn.one_hot(want[r], vocab)
            return logits + jnp.where(decoy, 1.5 * peak[r], 0.0)[:, None] * jax.nn.one_hot(wrong, vocab)

        return jax.vmap(row)(jnp.arange(b), dcache.length)

    return propose


def run(target, drafter, prompts, method, proposer, budget=BUDGET):
    """decode.generate's steps, keeping the final state (caches) for inspection."""
    tcfg, tparams = target
    dcfg, dparams = drafter
    opts = decode.GenerateOptions(method=method, max_new_tokens=NEW, tree_budget=budget, trace=True)
    spec = decode.make_spec(tcfg, dcfg, opts, proposer=proposer)
    state, tokens = decode.start(spec, prompts, [opts] * len(prompts), NEW, tparams.embed.dtype)
    state = decode.prefill(spec, tparams, dparams, state, tokens)
    state = decode.run_rounds(spec, tparams, dparams, state, jnp.int32(NEW + 1))
    assert bool(jnp.all(state.done))
    ends = decode.final_length(state)
    out = np.asarray(state.out)
    hist, n_rounds = np.asarray(state.accept_hist), np.asarray(state.n_rounds)
    outputs = [out[b, : ends[b]].tolist() for b in range(len(prompts))]
    acceptance = [hist[b, : n_rounds[b]].tolist() for b in range(len(prompts))]
    rounds = [decode.trace_rounds(spec, state, b) for b in range(len(prompts))]
    return outputs, acceptance, rounds, state


@functools.partial(jax.jit, static_argnums=(0, 2))
def fresh_caches(tcfg, tparams, dcfg, dparams, tokens):
    """A plain causal pass over tokens [B, S]: target K/V [L, B, S, K, hd], drafter K/V."""
    b, n = tokens.shape
    cache = kvcache.init(tcfg.num_layers, b, n, tcfg.num_kv_heads, tcfg.head_dim, tparams.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    bits = causal_bits(b, n)
    _, cache, taps = model.forward(tparams, tcfg, tokens, positions, cache, bits, taps=dcfg.target_layer_ids)
    dc = dcfg.layers
    dcache = kvcache.init(dc.num_layers, b, n, dc.num_kv_heads, dc.head_dim, tparams.embed.dtype)
    return cache, dflash.extend(dparams, dcfg, dcache, taps, jnp.full((b,), n, jnp.int32))


def check_caches(target, drafter, state):
    """Every row's committed target K/V, and its drafter context K/V, equal a fresh causal pass over its
    tokens (the tokens after a row's committed length only follow it: causality makes them irrelevant)."""
    fresh, dfresh = fresh_caches(*target, *drafter, state.out)
    # on the host: slicing device arrays at each row's own length would compile a slice per length
    fresh, dfresh, cache, dcache = jax.tree.map(np.asarray, (fresh, dfresh, state.cache, state.dcache))
    for b in range(state.out.shape[0]):
        n = int(cache.length[b])
        np.testing.assert_allclose(cache.k[:, b, :n], fresh.k[:, b, :n], atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(cache.v[:, b, :n], fresh.v[:, b, :n], atol=2e-4, rtol=1e-4)
        # the drafter's context: every committed token (each round appends its accepted path's taps)
        assert int(dcache.length[b]) == n
        np.testing.assert_allclose(dcache.k[:, b, :n], dfresh.k[:, b, :n], atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(dcache.v[:, b, :n], dfresh.v[:, b, :n], atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def noisy_oracle(greedy):
    rows = len(greedy)
    return oracle(greedy, peak=[10.0] * rows, noise=[1.0] * rows, decoy_rate=[0.08] * rows, seed=1)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_oracle_gives_deep_acceptance_and_ar_output(target, drafter, prompts, greedy, noisy_oracle, method):
    outputs, acceptance, rounds, state = run(target, drafter, prompts, method, noisy_oracle)
    bs = drafter[0].block_size
    for b, p in enumerate(prompts):
        assert outputs[b] == greedy[b][: len(p) + NEW], (method, b)
        acc = acceptance[b]
        assert max(acc) == bs and min(acc) >= 1
        assert np.mean(acc) >= 5, (method, b, acc)
        assert sum(acc[:-1]) < NEW <= sum(acc)
        for rnd, a in zip(rounds[b], acc):
            assert len(rnd["accepted_indices"]) == a and rnd["accepted_indices"][0] == 0
    check_caches(target, drafter, state)
    if method == "ddtree":
        # long tree paths sit at scattered tree indices: compaction really moved K/V
        scattered = [
            r["accepted_indices"] for rs in rounds for r in rs
            if len(r["accepted_indices"]) == bs and r["accepted_indices"] != list(range(bs))
        ]
        assert len(scattered) >= 3
        # decoys cost the chain a round's tail; the tree keeps the right token as a sibling
        chain = run(target, drafter, prompts, "dflash", noisy_oracle)[1]
        assert np.mean(sum(acceptance, [])) > np.mean(sum(chain, []))


def test_rows_accepting_different_lengths(target, drafter, prompts, greedy):
    """One batch: a perfect oracle (8 a round), a noisy one, a useless one (1 a round): each row is AR."""
    proposer = oracle(greedy, peak=[8.0, 4.0, 0.0], noise=[0.0, 1.5, 1.0], decoy_rate=[0.0, 0.3, 0.0], seed=2)
    for method in ("ddtree", "dflash"):
        outputs, acceptance, _, state = run(target, drafter, prompts, method, proposer)
        for b, p in enumerate(prompts):
            assert outputs[b] == greedy[b][: len(p) + NEW], (method, b)
        check_caches(target, drafter, state)
        perfect, noisy, useless = (np.mean(a) for a in acceptance)
        assert acceptance[0] == [8] * len(acceptance[0]), acceptance[0]
        assert perfect > noisy > useless and useless < 1.5, (method, acceptance)
        # in the first rounds the rows committed different lengths in the same round
        assert len({a[0] for a in acceptance}) == 3 or len({a[1] for a in acceptance}) == 3, acceptance
