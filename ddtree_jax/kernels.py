"""Which kernels a run uses: ``--attention`` resolved, and the probe of the Pallas kernels behind its 'auto'.

The probe runs each kernel set once per process on small random problems against its jnp reference, so that a GPU
(or a jax version) where a kernel compiles wrong falls back to the next choice instead of decoding wrong tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import cli, model


def resolve_attention(choice: str) -> str:
    """'auto' -> on a GPU, the Pallas kernels with the attention reading each layer's K/V in place
    ('pallas-inplace', faster than the sliced kernel: no per-layer copy of the cache) when the probe of it passes,
    else the sliced kernel ('pallas') when its probe passes, else XLA; XLA elsewhere. 'pallas' and
    'pallas-inplace' on CPU run the kernels in interpret mode."""
    on_gpu = jax.default_backend() == "gpu"
    if choice == "auto":
        if not on_gpu:
            return "xla"
        return next((impl for impl in ("pallas-inplace", "pallas") if pallas_kernels_work(impl)), "xla")
    if choice in ("pallas", "pallas-inplace"):
        return choice if on_gpu else f"{choice}-interpret"
    if choice == "xla":
        return "xla"
    raise ValueError(f"unknown attention {choice!r} (choose {', '.join(cli.ATTENTIONS)})")


@functools.lru_cache(maxsize=None)
def pallas_kernels_work(impl: str = "pallas") -> bool:
    """Whether the Pallas kernels of ``impl`` ('pallas' or 'pallas-inplace') compile and run here and match their
    jnp references (:func:`kernel_mismatch`). Checked once per process and impl; False -> the next choice of
    'auto' (the sliced kernel, then the XLA path), with a warning."""
    import warnings

    try:
        problem = kernel_mismatch(impl)
    except Exception as e:  # noqa: BLE001 - any failure means: do not use these kernels
        problem = str(e)
    if problem:
        warnings.warn(f"Pallas kernels ({impl}) unavailable here: {problem[:300]}")
    return not problem


def kernel_mismatch(impl: str = "pallas") -> str | None:
    """Run the Pallas kernels of ``impl`` ('pallas' or 'pallas-inplace'; '-interpret': in the Mosaic GPU
    interpreter) once on small random problems (``pallas_kernels.inputs``) and compare them with their jnp
    references: the attention as the model calls it (``model.attention_fn(impl)``), on a ragged bf16 GQA tree
    problem, reading the middle layer (traced) of a stacked cache whose other layers differ, so a wrong layer
    cannot match; the tree walk, on trees whose target choices mostly follow the tree, so paths go deep; for
    'pallas-inplace', also one query row (``pallas_kernels.decode_attention``) and the layer's q/k norm, RoPE and
    K/V write (``pallas_kernels.qkv_write``), some rows past the cache. Returns a description of the first mismatch,
    or None."""
    from pallas_kernels import inputs, qkv_write, tree_accept as tw, tree_attention as ta

    q, k, v, prefix, bits = inputs.attention_inputs(0, 2, 5, 4, 2, 128, 128, [3, 70])
    stacked = [jnp.stack([-x[:, ::-1], x, x[:, ::-1]]) for x in (k, v)]  # [3, B, S, K, hd]: layer 1 is (k, v)
    attend = model.attention_fn(impl)
    out = jax.jit(lambda *a: attend(*a[:5], layer=a[5]))(q, *stacked, prefix, bits, jnp.int32(1))
    ref = ta.tree_attention_reference(q, k, v, prefix, bits).astype(jnp.float32)
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    if not err < 2e-2:
        return f"tree attention ({impl}): relative error {err:.3g} against the reference"
    if impl.startswith("pallas-inplace"):  # one row per sequence: an AR step (pallas_kernels.decode_attention)
        one = jnp.ones((q.shape[0], 1, 1), jnp.uint32)
        out = jax.jit(lambda *a: attend(*a[:5], layer=a[5]))(q[:, :1], *stacked, prefix, one, jnp.int32(1))
        ref = ta.tree_attention_reference(q[:, :1], k, v, prefix, one).astype(jnp.float32)
        err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
        if not err < 2e-2:
            return f"one-row attention ({impl}): relative error {err:.3g} against the reference"
    tok, par, tgt = inputs.accept_inputs(np.random.default_rng(0), 8, 65, "random", 15)
    interpret = impl.endswith("-interpret")
    got = jax.jit(functools.partial(tw.tree_accept, max_depth=15, interpret=interpret))(tok, par, tgt)
    want = tw.tree_accept_reference(tok, par, tgt, max_depth=15)
    if not all(np.array_equal(x, y) for x, y in zip(got, want)):
        return f"tree walk: lengths {np.asarray(got[1]).tolist()}, reference {np.asarray(want[1]).tolist()}"
    if impl.startswith("pallas-inplace"):
        args = inputs.qkv_write_inputs(1, 2, 3, 4, 2, 128, layers=3, slots=16, start=[5, 14])  # rows 16, 17 dropped
        got = jax.jit(functools.partial(qkv_write.qkv_write, heads=4, eps=1e-6, interpret=interpret))(*args)
        want = qkv_write.reference(*args, heads=4, eps=1e-6)
        err = max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(got, want))
        if not err < 0.05:  # normed values below 8 that may differ in their last bit: within 0.03
            return f"q/k norm, RoPE and K/V write (qkv_write): off by {err:.3g} from the reference"
    return None
