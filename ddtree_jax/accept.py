"""The target's choice at every tree node, and the walk down the tree it agrees with.

Losslessness: every emitted token is the target's own choice (argmax, or an independent sample) at the
node whose path is the emitted prefix, so the output has exactly the target's distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax import sharding, vocab_parallel
from ddtree_jax.tree import Tree
from pallas_kernels import tree_accept as tree_accept_lib

Array = jax.Array


def node_keys(seq_keys: Array, positions: Array) -> Array:
    """Keys [B, N] from per-sequence keys [B] and each node's position [B, N] (the root's is the sequence's length).

    A node's key depends only on its sequence's own seed and its position, never on its batch neighbours nor on
    the tree: the token after position p is always chosen with the noise of (seed, p), so every form of round (an
    AR step, the chain, any tree) emits exactly the tokens AR sampling emits with that seed (a node agrees with the
    choice at its parent only if it is the token AR would have drawn there). Siblings share their key; that is
    lossless, since only one node per depth lies on the accepted path.
    """

    def one(key, pos):
        return jax.vmap(lambda p: jax.random.fold_in(jax.random.fold_in(key, p), 0))(pos)

    return jax.vmap(one)(seq_keys, positions)


def filter_logits(logits: Array, temperature: Array, top_p: Array, top_k: Array, filtering: bool = True) -> Array:
    """Tempered logits [B, T, V] with top-k (0 = off) and top-p (1 = off) applied per sequence [B]
    (``vocab_parallel.filter_logits``: by a search for the cutoff or by a sort, as the logits' size says; over a split
    vocabulary under a mesh).

    filtering (static): False when no sequence filters, so the program only divides by the temperature. With True
    every row goes through the filter (a row with neither top-k nor top-p keeps every token): no data-dependent
    branch, whose predicate XLA's GPU runtime would read on the host.
    """
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None, None]
    if not filtering:
        return scaled
    return vocab_parallel.filter_logits(scaled, top_p, top_k)


def filters(top_p, top_k) -> bool:
    """Whether a sequence's settings ask for a top-p / top-k filter (what ``Spec.filtering`` must allow)."""
    return top_k > 0 or top_p < 1.0


def choose(logits: Array, keys: Array, temperature: Array, top_p: Array, top_k: Array,
           sampling: bool = True, filtering: bool = True) -> Array:
    """The target's token at every node [B, T]: argmax where temperature == 0, else a sample.

    logits [B, T, V] f32; keys [B, T] (one independent key per node); temperature/top_p/top_k [B].
    sampling, filtering (static; ``spec.Spec``): False when no sequence samples (the program is the argmax
    alone) / when no sampled sequence filters (no top-k / top-p pass). Nothing here branches on data: a
    ``lax.cond`` on "some temperature > 0" would have XLA's GPU runtime read its predicate on the host, a
    device-to-host copy and a wait inside every round, so a sampling program draws for every row and keeps the
    draw where the temperature is > 0.
    """
    greedy = vocab_parallel.argmax(logits)
    if not sampling:
        return greedy
    filt = filter_logits(logits, temperature, top_p, top_k, filtering)
    gumbel = jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],))))(keys)
    return jnp.where(temperature[:, None] > 0, vocab_parallel.argmax(filt + gumbel), greedy)


def walk(tree: Tree, choice: Array, max_depth: int, impl: str = "xla") -> tuple[Array, Array, Array]:
    """Follow the target's choices from the root (see ``pallas_kernels.tree_accept``), batched, on device.

    choice [B, 1+N] = the target's token at every tree index. Node j is accepted iff its token equals
    the choice at its parent and its parent is accepted; the accepted nodes form one path.
    Returns (path [B, max_depth+1] tree indices root-first, padded with the last accepted index;
    length [B] accepted nodes including the root; bonus [B] = the choice at the path's end).
    impl: "xla" (the jnp reference), or an attention implementation of the Pallas kernels ("pallas",
    "pallas-inplace", "-interpret" in the Mosaic GPU interpreter): the walk kernel.
    """
    b = choice.shape[0]
    if tree.size == 0:  # autoregressive: the root alone
        return jnp.zeros((b, max_depth + 1), jnp.int32), jnp.ones((b,), jnp.int32), choice[:, 0]
    tokens = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), tree.tokens], axis=1)
    if impl == "xla":
        return tree_accept_lib.tree_accept_reference(tokens, tree.parents, choice, max_depth=max_depth)
    kernel = sharding.per_device_walk(tree_accept_lib.tree_accept)  # per device under a mesh
    return kernel(tokens, tree.parents, choice, max_depth=max_depth, interpret=impl.endswith("-interpret"))


def walk_host(node_tokens, parents, choices) -> list[int]:
    """The walk of one round in plain Python, step by step as the official ``follow_verified_tree`` (no jax, no
    kernel): the oracle of ``walk``'s tests and of ``bench pair --check``.

    node_tokens [N] (tree index j + 1), parents [1+N] (parents[0] = -1), choices [1+N] = the target's token at
    every tree index. Returns the accepted tree indices, root first; the bonus is ``choices[path[-1]]``.
    """
    path = [0]
    while True:
        want = choices[path[-1]]
        agree = [j for j in range(1, len(parents)) if parents[j] == path[-1] and node_tokens[j - 1] == want]
        if not agree:
            return path
        path.append(min(agree))
