"""How the benchmarks time device work: random caches at a prompt length, reset between timed runs; each stage of
a round its own compiled function (donating its state); chained calls timed on the host (``Timer``), a call's
device time from K calls inside one jitted loop (``loop_us``), and ahead-of-time compilation with
decode.XLA_OPTIONS (``aot``). Nothing here imports jax at module import."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable

from ddtree_jax.tuning import Tuning


def _jitted():
    """The compiled-once helpers (built lazily so that importing this module does not import jax)."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import cache as kvcache, decode
    from ddtree_jax.round import accept_commit, build_tree, draft_logits, hand_over, verify

    @functools.partial(decode.donating_jit, static_argnums=(2, 3), donate_argnums=(0,))
    def randomize(state, key, prompt_len: int, vocab: int):
        ks = jax.random.split(key, 6)

        def rnd(k, x):  # the prompt's slots alone: states of other capacities hold the same prompts
            shape = x.shape[:2] + (prompt_len,) + x.shape[3:]
            return x.at[:, :, :prompt_len].set(jax.random.normal(k, shape, jnp.float32).astype(x.dtype))

        full = jnp.full_like(state.cache.length, prompt_len)
        cache = kvcache.KVCache(rnd(ks[0], state.cache.k), rnd(ks[1], state.cache.v), full)
        dcache = state.dcache
        if dcache is not None:
            dcache = kvcache.KVCache(rnd(ks[2], dcache.k), rnd(ks[3], dcache.v), full)
        bonus = jax.random.randint(ks[5], state.bonus.shape, 0, vocab - 1, jnp.int32)
        return dataclasses.replace(state, cache=cache, dcache=dcache, bonus=bonus, n_out=state.prompt_len + 1)

    @functools.partial(decode.donating_jit, static_argnums=(0,), donate_argnums=(3,))
    def stage_draft(spec, tp, dp, state):
        logits, dcache = draft_logits(spec, tp, dp, state)
        return logits, dataclasses.replace(state, dcache=dcache)

    @functools.partial(jax.jit, static_argnums=(0,))
    def stage_tree(spec, logits):
        return build_tree(spec, logits)[0]

    @functools.partial(decode.donating_jit, static_argnums=(0,), donate_argnums=(2,))
    def stage_verify(spec, tp, state, tree):
        logits, cache, taps, tokens, depths = verify(spec, tp, state, tree)
        return (logits, taps, tokens, depths), dataclasses.replace(state, cache=cache)

    @functools.partial(decode.donating_jit, static_argnums=(0,), donate_argnums=(2,))
    def stage_accept(spec, dp, state, tree, outs):
        logits, taps, tokens, depths = outs
        state, context, count = accept_commit(spec, state, tree, state.dcache, logits, state.cache, taps, tokens,
                                              depths)
        return hand_over(spec, dp, state, context, count)  # the drafter's extension counts in this stage

    return dict(randomize=randomize, stage_draft=stage_draft, stage_tree=stage_tree, stage_verify=stage_verify,
                stage_accept=stage_accept)


_J: dict = {}


def J(name: str):
    """One of ``_jitted``'s helpers by name (randomize, stage_draft, stage_tree, stage_verify, stage_accept)."""
    if not _J:
        _J.update(_jitted())
    return _J[name]


def reset(state, prompt_len: int):
    """Back to the freshly prefilled lengths (every timing run starts from the same prefix)."""
    import jax.numpy as jnp

    b = state.bonus.shape[0]
    cache = dataclasses.replace(state.cache, length=jnp.full((b,), prompt_len, jnp.int32))
    dcache = state.dcache  # its own length array: a donated call must not see one buffer twice
    if dcache is not None:
        dcache = dataclasses.replace(dcache, length=jnp.full((b,), prompt_len, jnp.int32))
    return dataclasses.replace(state, cache=cache, dcache=dcache, n_rounds=jnp.zeros((b,), jnp.int32),
                               done=jnp.zeros((b,), bool), n_out=jnp.full((b,), prompt_len + 1, jnp.int32))


def make_spec(tcfg, dcfg, method: str, budget: int, attention: str, mesh=None, *, temperature: float = 0.0,
              top_p: float = 1.0, top_k: int = 0, tuning: Tuning = Tuning()):
    """spec.make_spec for one grid point (greedy unless a temperature is given) under ``tuning``."""
    from ddtree_jax import spec as spec_lib  # this function's own name is make_spec

    opts = spec_lib.GenerateOptions(method=method, max_new_tokens=256, tree_budget=max(budget, 1),
                                    attention=attention, temperature=temperature, top_p=top_p, top_k=top_k)
    return spec_lib.make_spec(tcfg, dcfg if method != "ar" else None, opts, tuning, mesh=mesh)


def make_state(spec, vocab: int, batch: int, prompt_len: int, capacity: int, out_len: int, dtype, seed: int = 1, *,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0):
    """A batch of random prompts' caches for ``spec`` (the sequences greedy unless a temperature is given; sequence
    i samples with seed i)."""
    import jax

    from ddtree_jax import decode
    from ddtree_jax.spec import GenerateOptions

    opts = [GenerateOptions(method=spec.method, max_new_tokens=256, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=i) for i in range(batch)]
    state = decode.init_state(spec, [prompt_len] * batch, opts, capacity, out_len, dtype)
    return J("randomize")(state, jax.random.key(seed), prompt_len, vocab)


def loop_us(fn, xs) -> float:
    """Device microseconds per call of ``fn`` over the leading axis of ``xs`` (K distinct inputs): the K calls in
    one jitted ``fori_loop`` (static trip count), median of 5 timings, / K. The loop's own cost is included
    (time ``lambda x: x[..., :1]`` for it)."""
    import jax
    import jax.numpy as jnp

    def body(i, acc):
        leaves = jax.tree.leaves(fn(jax.tree.map(lambda a: a[i], xs)))
        return acc + sum(x.reshape(-1)[-1].astype(jnp.int32) for x in leaves)

    n = jax.tree.leaves(xs)[0].shape[0]
    f = jax.jit(lambda xs: jax.lax.fori_loop(0, n, body, jnp.int32(0)))
    f(xs).block_until_ready()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        f(xs).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts) / n


def sync(x):
    """``x`` once the device has computed it."""
    import jax

    return jax.block_until_ready(x)


class Timer:
    """Median over repeats of (wall time of k chained calls) / k, each repeat from a reset state."""

    def __init__(self, repeats: int):
        self.repeats = repeats

    def chain(self, step: Callable, state, k: int, prompt_len: int):
        """step(state) -> (state, out); returns (ms per call, state)."""
        times = []
        for _ in range(self.repeats):
            state = sync(reset(state, prompt_len))
            t0 = time.perf_counter()
            out = None
            for _ in range(k):
                state, out = step(state)
            sync((state, out))
            times.append(1e3 * (time.perf_counter() - t0) / k)
        return statistics.median(times), state, times


def aot(jitted, *args):
    """Lower and compile once (ahead of time) with decode.XLA_OPTIONS, as decode.generate does; returns
    (compiled, seconds)."""
    from ddtree_jax import decode

    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile(decode.XLA_OPTIONS)
    return compiled, time.perf_counter() - t0
