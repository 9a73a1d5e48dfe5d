"""Tree-walk acceptance for a batch: the accepted path, its length and the bonus token, on device, as one Pallas
(Mosaic GPU) kernel, ``tree_accept``, with its jnp reference ``tree_accept_reference`` (the XLA path). Used by
``ddtree_jax.accept.walk`` after every verify with the 'pallas' implementations.

Semantics (the official ``follow_verified_tree``, shared by the reference and the Pallas kernel):
    node_tokens    [B, N1] int32   the token of every tree index (index 0 = root; its token is unused)
    parents        [B, N1] int32   parent tree index; parents[:, 0] = -1 and parents[:, j] < j
    target_tokens  [B, N1] int32   the target's chosen token at every tree index
From the root, step to the child whose token equals the target's token at the current node, until
none does; the target's token at the last node is the bonus. Loop-free: ok[j] = node_tokens[j] ==
target_tokens[parents[j]]; j is accepted iff it and all its ancestors are ok; the deepest accepted node
ends the path. Siblings are assumed to carry distinct tokens (a DDTree tree always does: they come
from one top-k); otherwise the accepted set need not be a path, and both implementations take the
deepest accepted node of smallest index (reference) / the matching child of smallest index (kernel).
Returns
    accepted  [B, max_depth + 1] int32  tree indices on the path, root first, padded past the path
                                        with the last accepted index (a valid gather index for the
                                        KV commit)
    acc_len   [B] int32                 accepted nodes including the root
    bonus     [B] int32                 target_tokens at the last accepted node
``max_depth`` (static) is the deepest a tree can be: block_size - 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_LANES = 128  # one warpgroup: vectors are padded to a multiple of its threads
_NONE = 1 << 30  # "no matching child"


def tree_accept_reference(node_tokens, parents, target_tokens, *, max_depth: int):
    """Pure-jnp tree walk (the XLA path), loop-free over the nodes."""
    b, n1 = node_tokens.shape
    up = jnp.maximum(parents, 0).astype(jnp.int32)
    idx = jnp.arange(n1, dtype=jnp.int32)[None]
    ok = (node_tokens == jnp.take_along_axis(target_tokens, up, axis=1)) | (idx == 0)
    accepted, depth = ok, jnp.zeros((b, n1), jnp.int32)
    for _ in range(max_depth):  # an ancestor chain has at most max_depth edges
        accepted = ok & jnp.take_along_axis(accepted, up, axis=1)
        depth = jnp.where(idx == 0, 0, jnp.take_along_axis(depth, up, axis=1) + 1)
    score = jnp.where(accepted, depth, -1)
    last = jnp.argmax(score, axis=1).astype(jnp.int32)  # deepest accepted, smallest index on ties
    length = jnp.take_along_axis(depth, last[:, None], axis=1)[:, 0] + 1
    chain = [last]  # chain[k] = the k-th ancestor of `last`
    for _ in range(max_depth):
        chain.append(jnp.take_along_axis(up, chain[-1][:, None], axis=1)[:, 0])
    chain = jnp.stack(chain, axis=1)  # [B, max_depth + 1]
    pos = jnp.arange(max_depth + 1, dtype=jnp.int32)[None]
    back = jnp.clip(length[:, None] - 1 - pos, 0, max_depth)
    path = jnp.where(pos < length[:, None], jnp.take_along_axis(chain, back, axis=1), last[:, None])
    bonus = jnp.take_along_axis(target_tokens, last[:, None], axis=1)[:, 0]
    return path.astype(jnp.int32), length.astype(jnp.int32), bonus.astype(jnp.int32)


def tree_accept(node_tokens, parents, target_tokens, *, max_depth: int, interpret=False):
    """Pallas (Mosaic GPU) tree walk with the semantics of ``tree_accept_reference``.

    One CTA (one warpgroup) per sequence. The node arrays live in registers as vectors over the
    padded node axis; each step of the walk compares every node with (current node, target's token
    there) and takes the smallest matching index with one vector min-reduction. The walk stops at the
    first node with no agreeing child: acc_len steps (at most max_depth), no host round trip.
    """
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    b, n1 = node_tokens.shape
    npad = -(-n1 // _LANES) * _LANES
    lpad = -(-(max_depth + 1) // _LANES) * _LANES
    pad = [(0, 0), (0, npad - n1)]
    tok = jnp.pad(node_tokens.astype(jnp.int32), pad, constant_values=-1)
    par = jnp.pad(parents.astype(jnp.int32), pad, constant_values=-2)  # padding is nobody's child
    tgt = jnp.pad(target_tokens.astype(jnp.int32), pad)
    nr = npad // _LANES  # TMA boxes hold <= 256 elements per dimension: rows of 128 nodes
    tok, par, tgt = (x.reshape(b, nr, _LANES) for x in (tok, par, tgt))

    def kernel(tok_ref, par_ref, tgt_ref, path_ref, sc_ref, tok_smem, par_smem, tgt_smem, path_smem,
               sc_smem, bars):
        bi = lax.axis_index("b")
        for j, (src, dst) in enumerate(((tok_ref, tok_smem), (par_ref, par_smem), (tgt_ref, tgt_smem))):
            plgpu.copy_gmem_to_smem(src.at[bi], dst, bars.at[j])
        for j in range(3):
            plgpu.barrier_wait(bars.at[j])
        toks = tok_smem[...]
        pars = par_smem[...]
        ids = lax.broadcasted_iota(jnp.int32, (nr, _LANES), 0) * _LANES + lax.broadcasted_iota(
            jnp.int32, (nr, _LANES), 1)
        pos = lax.broadcasted_iota(jnp.int32, (lpad,), 0)

        def walking(carry):
            d, _, length, _ = carry
            return (d < max_depth) & (length == d + 1)  # the last step found an agreeing child

        def step(carry):
            d, cur, length, path = carry
            want = tgt_smem[lax.div(cur, _LANES), lax.rem(cur, _LANES)]
            nxt = jnp.min(jnp.where((pars == cur) & (toks == want), ids, _NONE))
            found = nxt < _NONE
            cur = jnp.where(found, nxt, cur)
            length = jnp.where(found, length + 1, length)
            path = jnp.where(pos == length - 1, cur, path)
            return d + 1, cur, length, path

        init = (jnp.int32(0), jnp.int32(0), jnp.int32(1), jnp.zeros((lpad,), jnp.int32))
        _, cur, length, path = lax.while_loop(walking, step, init)
        path_smem[...] = jnp.where(pos < length, path, cur)
        bonus = tgt_smem[lax.div(cur, _LANES), lax.rem(cur, _LANES)]
        sc_smem[...] = jnp.where(pos == 0, length, jnp.where(pos == 1, bonus, 0))  # [acc_len, bonus, 0...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(path_smem, path_ref.at[bi])
        plgpu.copy_smem_to_gmem(sc_smem, sc_ref.at[bi])
        plgpu.wait_smem_to_gmem(0)

    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    path, sc = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((b, lpad), jnp.int32), jax.ShapeDtypeStruct((b, lpad), jnp.int32)),
        scratch_types=(
            plgpu.SMEM((nr, _LANES), jnp.int32),
            plgpu.SMEM((nr, _LANES), jnp.int32),
            plgpu.SMEM((nr, _LANES), jnp.int32),
            plgpu.SMEM((lpad,), jnp.int32),
            plgpu.SMEM((lpad,), jnp.int32),
            plgpu.Barrier(num_barriers=3),
        ),
        grid=(b,),
        grid_names=("b",),
        interpret=interpret or None,
    )(tok, par, tgt)
    return path[:, : max_depth + 1], sc[:, 0], sc[:, 1]
