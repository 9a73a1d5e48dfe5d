"""A tree's packed ancestor-or-self mask in one Pallas (Triton) kernel: the verify's attention mask.

Row j of the mask has bit i set iff tree index i is j or one of j's ancestors (``pallas_kernels.bitmask`` packing:
word w holds indices 32 w .. 32 w + 31, least significant bit first). XLA's form (``tree.ancestor_bits``, pointer
doubling, also the reference) is a chain of about ten small kernels; here one program per tree walks every node up
its ancestors at once (max_depth gathers of the parents, from global memory, read only), then ORs one bit per row and
distance into the words, which stay in registers. Used by ``tree.ancestor_bits`` (how='kernel', chosen by
``tree.default_bits``) for trees of up to ``MAX_NODES`` nodes.

Shapes: parents [B, M] int32 (tree index 0 the root, parents[:, 0] = -1, every node's depth <= max_depth)
        -> words [B, M, ceil(M / 32)] uint32
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import pow2


MAX_NODES = 512  # tree indices (root included) up to which the words fit in registers: faster than XLA's form


def _kernel(par_ref, out_ref, *, m: int, mp: int, wp: int, max_depth: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    b = pl.program_id(0)
    node = jnp.arange(mp, dtype=jnp.int32)
    word = jnp.arange(wp, dtype=jnp.int32)[None, :]
    ancestors = [node]  # at distances 0 .. max_depth (the root is its own parent): a chain of gathers first
    for _ in range(max_depth):
        ancestors.append(jnp.maximum(pltriton.load(par_ref.at[b, ancestors[-1]], mask=ancestors[-1] < m, other=0), 0))
    words = jnp.zeros((mp, wp), jnp.int32)
    for a in ancestors:  # then one bit per row and distance
        words = words | jnp.where(word == (a >> 5)[:, None], jnp.left_shift(1, a & 31)[:, None], 0)
    pltriton.store(out_ref.at[b, node[:, None], word], words)  # padded rows and words: sliced off by the caller


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def ancestor_bits(parents: jax.Array, max_depth: int, *, interpret: bool = False) -> jax.Array:
    """parents [B, M] int32 -> packed ancestor-or-self mask [B, M, ceil(M / 32)] uint32 (as ``tree.ancestor_bits``).
    ``interpret``: the Pallas interpreter (CPU)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    b, m = parents.shape
    mp, wp = pow2(m), pow2(-(-m // 32))
    out = pl.pallas_call(
        functools.partial(_kernel, m=m, mp=mp, wp=wp, max_depth=max_depth),
        grid=(b,),
        out_shape=jax.ShapeDtypeStruct((b, mp, wp), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ancestor_bits",
    )(parents.astype(jnp.int32))
    return jax.lax.bitcast_convert_type(out[:, :m, : -(-m // 32)], jnp.uint32)
