"""Draft trees: DDTree's best-first tree against the reference (tree_build.npz), its invariants, the
pruned candidate pairs against the plain heap algorithm, and the chain / root-only trees."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import tree as trees
from pallas_kernels import best_first as best_first_kernel
from pallas_kernels.bitmask import unpack_bits
from tests.conftest import fixture_path


def path_of(tokens, parents, j):
    """Root-to-node token path of tree index j (j >= 1; node j is tokens[j - 1])."""
    path = []
    while j > 0:
        path.append(int(tokens[j - 1]))
        j = int(parents[j])
    return tuple(reversed(path))


def paths_by_index(tokens, parents):
    """{tree index: token path}, the root (index 0) being the empty path."""
    return {j: path_of(tokens, parents, j) for j in range(len(parents))}


best_first = jax.jit(trees.best_first, static_argnums=1)
# jitted (one program per shape) rather than dispatched op by op, each op compiled on its own for every new shape
top_log_probs = jax.jit(trees.top_log_probs, static_argnums=(1, 2, 3))
top_k = jax.jit(jax.lax.top_k, static_argnums=1)


def unpacked(tree, b=0):
    return np.asarray(unpack_bits(tree.bits[b], tree.parents.shape[1]))


@pytest.fixture(scope="module")
def tree_build():
    d = np.load(fixture_path("tree_build.npz"))
    return [
        {k: d[f"{k}_{i}"] for k in ("logits", "budget", "node_token_ids", "node_depths", "parents", "visibility")}
        for i in range(int(d["num_cases"]))
    ]


def test_reference_cases_same_paths_and_visibility(tree_build):
    assert len(tree_build) == 8
    for i, case in enumerate(tree_build):
        budget = int(case["budget"])
        tree = best_first(jnp.asarray(case["logits"])[None], budget)
        tokens, parents, depths = (np.asarray(a[0]) for a in (tree.tokens, tree.parents, tree.depths))
        assert tokens.shape == (budget,) and parents.shape == (budget + 1,) and parents[0] == -1, i
        mine = paths_by_index(tokens, parents)
        theirs = paths_by_index(case["node_token_ids"], case["parents"])
        assert set(mine.values()) == set(theirs.values()), i
        assert [len(mine[j]) for j in range(1, budget + 1)] == depths.tolist(), i
        # visibility, with our tree indices mapped to the reference's through the token paths
        to_ref = {path: j for j, path in theirs.items()}
        perm = np.asarray([to_ref[mine[j]] for j in range(budget + 1)])
        assert perm[0] == 0
        np.testing.assert_array_equal(unpacked(tree), case["visibility"][np.ix_(perm, perm)], err_msg=str(i))
        np.testing.assert_array_equal(case["node_depths"][perm[1:] - 1], depths, err_msg=str(i))


def node_scores(lp, ids, tokens, parents, n):
    """Cumulative draft log-prob of the first n nodes (numpy float32, summed root-down like the scan)."""
    lp_of = [dict(zip(ids[d].tolist(), lp[d].tolist())) for d in range(lp.shape[0])]
    scores = np.zeros(n + 1, np.float32)
    for j in range(1, n + 1):
        depth = len(path_of(tokens, parents, j))
        scores[j] = np.float32(scores[parents[j]]) + np.float32(lp_of[depth - 1][int(tokens[j - 1])])
    return scores[1:]


def check_invariants(tree, draft_logits, budget):
    b, depth_count, vocab = draft_logits.shape
    lp, ids = (np.asarray(a) for a in top_log_probs(jnp.asarray(draft_logits), min(budget, vocab)))
    for r in range(b):
        tokens, depths, parents = (np.asarray(a[r]) for a in (tree.tokens, tree.depths, tree.parents))
        assert tokens.shape == (budget,) and depths.shape == (budget,) and parents.shape == (budget + 1,)
        assert parents[0] == -1
        valid = tokens >= 0
        n = int(valid.sum())
        assert n == min(budget, sum(vocab ** d for d in range(1, depth_count + 1)))
        assert valid[:n].all() and not valid[n:].any()  # unused slots (tiny trees only) come last
        idx = np.arange(1, n + 1)
        assert (parents[idx] < idx).all() and (parents[idx] >= 0).all()  # parents precede children
        all_depths = np.concatenate([[0], depths])
        assert (depths[:n] == all_depths[parents[idx]] + 1).all()
        assert (depths[:n] <= depth_count).all()
        assert (tokens[:n] < vocab).all()
        # ancestor-closed and no duplicate path (siblings carry distinct tokens)
        paths = [path_of(tokens, parents, j) for j in idx]
        assert len(set(paths)) == n
        assert all(p[:-1] in set(paths) for p in paths if len(p) > 1)
        scores = node_scores(lp[r], ids[r], tokens, parents, n)
        assert (np.diff(scores) <= 0).all()  # best-first order
        # visibility = ancestor-or-self
        vis = unpacked(tree, r)
        want = np.zeros((budget + 1, budget + 1), bool)
        for j in range(budget + 1):
            k = j
            while k >= 0:
                want[j, k] = True
                k = parents[k] if k > 0 else -1
        np.testing.assert_array_equal(vis, want)


def heap_tree(lp, ids, budget):
    """The reference algorithm (DDTree, Algorithm 1) with a Python heap: the set of selected token paths.

    lp, ids [D, K] sorted descending per depth. A popped path (depth d, rank r) pushes its next sibling
    (rank r + 1) and its best child (depth d + 1, rank 0); scores are float32 sums, like the scan's.
    """
    depth_count, k = lp.shape
    heap = [(-np.float32(lp[0, 0]), (0,))]  # ranks per depth
    selected = []
    while heap and len(selected) < budget:
        neg, ranks = heapq.heappop(heap)
        selected.append(tuple(int(ids[d, r]) for d, r in enumerate(ranks)))
        parent_score = np.float32(-neg) - np.float32(lp[len(ranks) - 1, ranks[-1]])
        if ranks[-1] + 1 < k:
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (-(np.float32(parent_score) + np.float32(lp[len(ranks) - 1, ranks[-1] + 1])), sib))
        if len(ranks) < depth_count:
            heapq.heappush(heap, (-(np.float32(-neg) + np.float32(lp[len(ranks), 0])), ranks + (0,)))
    return set(selected)


@pytest.mark.parametrize(
    "batch,depth,vocab,budget,scale",
    [
        (3, 7, 256, 1, 1.0),
        (3, 7, 256, 16, 3.0),
        (4, 7, 256, 64, 1.0),
        (2, 7, 100, 130, 5.0),  # budget > vocab: K = vocab, depths fill up
        (3, 4, 5, 20, 2.0),  # vocab < budget
        (2, 3, 3, 39, 1.0),  # budget = every possible path (3 + 9 + 27)
        (2, 2, 3, 40, 1.0),  # budget > every possible path: unused slots
        (2, 1, 64, 33, 1.0),  # a single depth
    ],
)
def test_random_trees_equal_heap_algorithm_and_keep_invariants(batch, depth, vocab, budget, scale):
    rng = np.random.default_rng(batch * 1000 + depth * 100 + vocab + budget)
    logits = (scale * rng.standard_normal((batch, depth, vocab))).astype(np.float32)
    tree = best_first(jnp.asarray(logits), budget)
    check_invariants(tree, logits, budget)
    lp, ids = (np.asarray(a) for a in top_log_probs(jnp.asarray(logits), min(budget, vocab)))
    for r in range(batch):
        tokens, parents = np.asarray(tree.tokens[r]), np.asarray(tree.parents[r])
        n = int((tokens >= 0).sum())
        mine = {path_of(tokens, parents, j) for j in range(1, n + 1)}
        assert mine == heap_tree(lp[r], ids[r], budget), (r, budget)


def test_candidate_pairs_prune_nothing_that_can_be_selected():
    """Pair (i, j) is dropped only if (i+1)(j+1) > budget: it then has >= budget candidates above it."""
    for budget, k in [(1, 1), (4, 4), (16, 16), (64, 64), (30, 7), (300, 200)]:
        ii, jj = best_first_kernel.candidate_pairs(budget, k)
        kept = set(zip(ii.tolist(), jj.tolist()))
        full = {(i, j) for i in range(budget) for j in range(k)}
        assert kept <= full
        for i, j in full - kept:
            assert (i + 1) * (j + 1) - 1 >= budget
        assert len(kept) <= budget * (1 + np.log(budget)) + 1


def test_brute_force_frontier_over_full_product():
    """The scan's pruned frontier update equals a frontier update over the full budget x k product."""
    rng = np.random.default_rng(7)
    for budget, vocab, depth in [(16, 256, 7), (48, 6, 5), (10, 10, 4)]:
        logits = (2 * rng.standard_normal((1, depth, vocab))).astype(np.float32)
        k = min(budget, vocab)
        lp, ids = (np.asarray(a[0]) for a in top_log_probs(jnp.asarray(logits), k))
        # brute force: per depth, every (frontier path, token) extension, keep the top `budget`
        frontier = [((int(t),), np.float32(s)) for s, t in zip(lp[0][:budget], ids[0][:budget])]
        everything = list(frontier)
        for d in range(1, depth):
            ext = [(p + (int(t),), np.float32(s + np.float32(x))) for p, s in frontier for x, t in zip(lp[d], ids[d])]
            ext.sort(key=lambda e: -e[1])
            frontier = ext[:budget]
            everything += frontier
        everything.sort(key=lambda e: (-e[1], len(e[0])))
        want = {p for p, _ in everything[:budget]}
        tree = best_first(jnp.asarray(logits), budget)
        tokens, parents = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
        assert {path_of(tokens, parents, j) for j in range(1, budget + 1)} == want


@pytest.mark.parametrize("shape,k", [((7,), 3), ((2, 50), 50), ((3, 4, 100), 17)])
def test_top_k_by_count_is_lax_top_k_exactly(shape, k):
    """Same values, ids and tie order as lax.top_k, with heavy ties, -inf and both zeros (-0.0 ranks below +0.0)."""
    rng = np.random.default_rng(k)
    x = np.round(rng.standard_normal(shape)).astype(np.float32)
    x[..., ::3] = -np.inf
    x[..., 1::5] = -0.0
    by_count = jax.jit(trees.top_k_by_count, static_argnums=1)
    for arr in (x, rng.standard_normal(shape).astype(np.float32)):
        want = top_k(jnp.asarray(arr), k)
        got = by_count(jnp.asarray(arr), k)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            assert g.dtype == w.dtype


@pytest.mark.parametrize("budget,vocab,scale,kernel", [(16, 256, 3.0, False), (64, 1000, 1.0, False),
                                                       (130, 100, 5.0, True), (40, 3, 1.0, False), (32, 64, 0.0, True)])
def test_selections_build_the_same_tree(budget, vocab, scale, kernel):
    """select='count', 'kernel' (the GPU defaults; the kernel in the Pallas interpreter, its tree and bits through
    tree_from_lists, here where the budget exceeds the vocabulary and where all paths tie: the kernel alone on more
    cases is tests/test_kernels.py's) and select='sort' give the same tree, field for field (scale 0: all ties)."""
    logits = jnp.asarray((scale * np.random.default_rng(budget).standard_normal((2, 7, vocab))).astype(np.float32))
    selects = trees.SELECTS if kernel else ("sort", "count")
    by = {s: jax.jit(lambda x, s=s: trees.best_first(x, budget, select=s))(logits) for s in selects}
    for name in ("tokens", "depths", "parents", "bits"):
        for select in selects[1:]:
            np.testing.assert_array_equal(np.asarray(getattr(by[select], name)), np.asarray(getattr(by["sort"], name)))
    with pytest.raises(ValueError, match="select"):
        trees.best_first(logits, budget, select="heap")


def test_default_selection_counts_on_gpu_where_timed_faster(monkeypatch):
    """On GPU up to batch 8 the best_first kernels up to budget 256; at batch 1 rank counting up to 512 (each timed
    faster there); a sort beyond, above batch 8, and on CPU."""
    monkeypatch.setattr(trees.jax, "default_backend", lambda: "gpu")
    assert [trees.default_select(b) for b in (16, 96, 128, 256, 257, 512, 513)] == [
        "kernel", "kernel", "kernel", "kernel", "count", "count", "sort"]
    assert [trees.default_select(64, b) for b in (1, 2, 8, 9)] == ["kernel", "kernel", "kernel", "sort"]
    assert [trees.default_select(384, b) for b in (1, 2, 8)] == ["count", "sort", "sort"]
    assert [trees.default_kernels(b) for b in (1, 8, 9)] == [True, True, False]
    monkeypatch.setattr(trees.jax, "default_backend", lambda: "cpu")
    assert trees.default_select(16) == "sort"


def test_best_first_is_jittable_and_batch_independent():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 7, 256)).astype(np.float32)
    batched = best_first(jnp.asarray(logits), 24)
    for r in range(5):
        one = trees.best_first(jnp.asarray(logits[r : r + 1]), 24)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(batched)):
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[r]))


def test_chain_tree():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((3, 7, 50)).astype(np.float32)
    chain = jax.jit(trees.chain)
    tree = chain(jnp.asarray(logits))
    assert tree.size == 7
    assert tree.tokens.shape == (3, 7) and tree.depths.shape == (3, 7)
    assert tree.parents.shape == (3, 8) and tree.bits.shape == (3, 8, 1) and tree.bits.dtype == jnp.uint32
    np.testing.assert_array_equal(tree.tokens, logits.argmax(-1))
    np.testing.assert_array_equal(tree.depths, np.broadcast_to(np.arange(1, 8), (3, 7)))
    np.testing.assert_array_equal(tree.parents, np.broadcast_to(np.arange(-1, 7), (3, 8)))
    for b in range(3):
        np.testing.assert_array_equal(unpacked(tree, b), np.tril(np.ones((8, 8), bool)))
    # a chain is the best-first tree of budget = depth when every depth has one dominant token
    peaked = jnp.asarray(logits + 100 * jax.nn.one_hot(logits.argmax(-1), 50))
    bf = best_first(peaked, 7)
    for name in ("tokens", "depths", "parents", "bits"):
        np.testing.assert_array_equal(getattr(bf, name), getattr(chain(peaked), name))


def test_chain_tree_long_block_uses_several_words():
    logits = jnp.zeros((2, 40, 8)).at[:, :, 3].set(1.0)
    tree = trees.chain(logits)
    assert tree.bits.shape == (2, 41, 2)
    np.testing.assert_array_equal(unpacked(tree, 1), np.tril(np.ones((41, 41), bool)))


def test_root_only_tree():
    tree = trees.root_only(4)
    assert tree.size == 0
    assert tree.tokens.shape == (4, 0) and tree.depths.shape == (4, 0)
    np.testing.assert_array_equal(tree.parents, -np.ones((4, 1)))
    assert tree.bits.shape == (4, 1, 1) and tree.bits.dtype == jnp.uint32
    assert np.asarray(unpack_bits(tree.bits, 1)).all()


@pytest.mark.parametrize("m,max_depth", [(1, 0), (2, 1), (17, 3), (40, 15), (70, 33)])
def test_ancestor_bits_match_walking_up_the_parents(m, max_depth):
    """Pointer doubling gives exactly the ancestor-or-self sets of random trees (parents before children,
    deepest node at max_depth), over one and several 32-bit words."""
    rng = np.random.default_rng(m)
    parents = np.full((3, m), -1, np.int32)
    depth = np.zeros((3, m), int)
    for b in range(3):
        for i in range(1, m):
            choices = [j for j in range(i) if depth[b, j] < max_depth]
            parents[b, i] = rng.choice(choices)
            depth[b, i] = depth[b, parents[b, i]] + 1
    want = np.zeros((3, m, m), bool)
    for b in range(3):
        for i in range(m):
            j = i
            while j >= 0:
                want[b, i, j] = True
                j = parents[b, j]
    got = np.asarray(jax.jit(lambda p: unpack_bits(trees.ancestor_bits(p, int(depth.max())), m))(jnp.asarray(parents)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("chunk", [32, (64, 8), (128, 16, 2), (8, 8, 8)])
@pytest.mark.parametrize("n,k", [(5000, 37), (40000, 100), (3000, 64)])
def test_top_k_chunked_is_lax_top_k_exactly(n, k, chunk):
    """Chunk maxima, their top k chunks, again on those entries for each further chunk size, then the top k: the
    values, ids and tie order of lax.top_k (heavy ties, -inf), with either selection at every level."""
    rng = np.random.default_rng(n + k)
    x = np.round(3 * rng.standard_normal((2, 3, n)), 1).astype(np.float32)
    x[..., ::7] = -np.inf
    want = top_k(jnp.asarray(x), k)
    for top in (jax.lax.top_k, trees.top_k_by_count):
        got = jax.jit(trees.top_k_chunked, static_argnums=(1, 2, 3))(jnp.asarray(x), k, chunk, top)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
    assert trees.default_topk_chunk(256) == (64, 8) and trees.default_topk_chunk(512) == 32
    plain, chunked = (top_log_probs(jnp.asarray(x), k, *how) for how in ((), (chunk, trees.top_k_by_count)))
    for w, g in zip(plain, chunked):  # the log-probs too: any chunks, either selection
        np.testing.assert_array_equal(np.asarray(w), np.asarray(g))


@pytest.mark.parametrize("budget,vocab,scale", [(16, 4096, 3.0), (48, 4096, 0.3), (16, 300, 1.0)])
def test_the_tree_kernels_build_the_same_tree(budget, vocab, scale):
    """The GPU defaults, the vocabulary top-k and ancestor-bits kernels (their interpreter here), give XLA's tree
    field for field; rows too short for the top-k kernels (vocab 300 at k = 16) take the fallback."""
    logits = jnp.asarray(np.round(scale * np.random.default_rng(budget).standard_normal((2, 7, vocab)), 1),
                         jnp.float32)
    xla = jax.jit(lambda x: trees.best_first(x, budget, chunk=(64, 8), bits="xla"))(logits)
    kernels = jax.jit(lambda x: trees.best_first(x, budget, chunk="kernel", bits="kernel"))(logits)
    for name in ("tokens", "depths", "parents", "bits"):
        np.testing.assert_array_equal(np.asarray(getattr(kernels, name)), np.asarray(getattr(xla, name)))
    with pytest.raises(ValueError, match="ancestor bits"):
        trees.ancestor_bits(xla.parents, 7, "heap")


def test_tree_kernels_are_the_gpu_default_where_timed_faster(monkeypatch):
    """On GPU, up to batch 8, the vocabulary top-k kernels up to k = 512 and the ancestor-bits kernel up to 512
    tree indices (both timed faster there); XLA's forms beyond, above batch 8 (slower at batch 16, budget 256) and on
    CPU."""
    monkeypatch.setattr(trees.jax, "default_backend", lambda: "gpu")
    assert trees.default_kernels() and trees.default_kernels(8) and not trees.default_kernels(9)
    assert trees.default_bits(65, 8) == "kernel" and trees.default_bits(65, 9) == "xla"
    with trees.sharding.use_mesh(jax.make_mesh((1,), ("model",))):
        assert not trees.default_kernels()
    assert [trees.default_topk_chunk(k, True) for k in (64, 256, 512, 513)] == ["kernel", "kernel", "kernel", 32]
    assert [trees.default_bits(n) for n in (65, 257, 512, 513)] == ["kernel", "kernel", "kernel", "xla"]
    monkeypatch.setattr(trees.jax, "default_backend", lambda: "cpu")
    assert not trees.default_kernels() and trees.default_topk_chunk(64) == (64, 8)
    assert trees.default_bits(65) == "xla"
