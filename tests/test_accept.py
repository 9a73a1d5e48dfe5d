"""The target's choice at every node (argmax / filtered sample) and the tree walk (tree_walk.npz)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import accept
from ddtree_jax.tree import Tree, ancestor_bits
from tests.conftest import fixture_path

# jitted (one program per shape) rather than dispatched op by op, each op compiled on its own for every new shape
ancestor_bits_jit = jax.jit(ancestor_bits, static_argnums=1)
node_keys = jax.jit(accept.node_keys)
choose = jax.jit(accept.choose, static_argnames=("sampling", "filtering"))
filter_logits = jax.jit(accept.filter_logits)


def depths_from_parents(parents):
    depths = np.zeros(len(parents), np.int32)
    for j in range(1, len(parents)):
        depths[j] = depths[parents[j]] + 1
    return depths


def make_tree(cases, size):
    """Batch trees padded to ``size`` nodes with unused slots (token -1, parent 0, depth 1)."""
    b = len(cases)
    tokens = np.full((b, size), -1, np.int32)
    depths = np.ones((b, size), np.int32)
    parents = np.zeros((b, size + 1), np.int32)
    choice = np.zeros((b, size + 1), np.int32)
    for i, c in enumerate(cases):
        n = len(c["node_token_ids"])
        tokens[i, :n] = c["node_token_ids"]
        parents[i, : n + 1] = c["parents"]
        depths[i, :n] = depths_from_parents(c["parents"])[1:]
        choice[i, : n + 1] = c["posterior"]
    max_depth = int(depths.max())
    parents = jnp.asarray(parents)
    tree = Tree(jnp.asarray(tokens), jnp.asarray(depths), parents, ancestor_bits_jit(parents, max_depth))
    return tree, jnp.asarray(choice), max_depth


@pytest.fixture(scope="module")
def walk_cases():
    d = np.load(fixture_path("tree_walk.npz"))
    keys = ("node_token_ids", "parents", "posterior", "accepted", "next_token")
    return [{k: d[f"{k}_{i}"] for k in keys} for i in range(int(d["num_cases"]))]


def check_walk(cases, path, length, bonus, max_depth):
    path, length, bonus = np.asarray(path), np.asarray(length), np.asarray(bonus)
    assert path.shape == (len(cases), max_depth + 1)
    for i, c in enumerate(cases):
        n = len(c["accepted"])
        assert length[i] == n, i
        np.testing.assert_array_equal(path[i, :n], c["accepted"], err_msg=str(i))
        assert (path[i, n:] == c["accepted"][-1]).all(), i  # padded with the last accepted index
        assert bonus[i] == c["next_token"], i


walk = jax.jit(accept.walk, static_argnums=2)


def test_reference_walks_one_by_one(walk_cases):
    assert len(walk_cases) == 12
    size = max(len(c["node_token_ids"]) for c in walk_cases)
    for i, c in enumerate(walk_cases):
        # cases 0 and 1 at their own size; the others padded to one shape (a single compilation)
        tree, choice, max_depth = make_tree([c], len(c["node_token_ids"]) if i < 2 else size)
        path, length, bonus = walk(tree, choice, max_depth if i < 2 else 8)
        check_walk([c], path, length, bonus, max_depth if i < 2 else 8)


def test_reference_walks_batched_and_padded(walk_cases):
    size = max(len(c["node_token_ids"]) for c in walk_cases) + 5
    tree, choice, max_depth = make_tree(walk_cases, size)
    path, length, bonus = walk(tree, choice, max_depth + 2)
    check_walk(walk_cases, path, length, bonus, max_depth + 2)
    assert len({len(c["accepted"]) for c in walk_cases}) > 1  # rows of different lengths in one batch


def test_walk_rejects_unused_slots_and_matches_a_python_walk():
    """Random trees and random choices: the loop-free walk equals the reference's step-by-step walk."""
    rng = np.random.default_rng(0)
    b, n, vocab = 64, 20, 3
    parents = np.zeros((b, n + 1), np.int32)
    parents[:, 0] = -1
    tokens = np.full((b, n), -1, np.int32)
    for r in range(b):  # siblings carry distinct tokens, as in every DDTree tree
        used = {0: []}
        for j in range(1, n - 2):  # the last 3 slots stay unused (token -1, parent 0)
            parent = int(rng.choice([q for q, t in used.items() if len(t) < vocab]))
            tokens[r, j - 1] = rng.choice([t for t in range(vocab) if t not in used[parent]])
            parents[r, j] = parent
            used[parent].append(int(tokens[r, j - 1]))
            used[j] = []
    choice = rng.integers(0, vocab, (b, n + 1)).astype(np.int32)
    depths = np.stack([depths_from_parents(p)[1:] for p in parents])
    md = int(depths.max())
    parents_ = jnp.asarray(parents)
    tree = Tree(jnp.asarray(tokens), jnp.asarray(depths), parents_, ancestor_bits_jit(parents_, md))
    path, length, bonus = walk(tree, jnp.asarray(choice), md)
    for r in range(b):
        want = accept.walk_host(tokens[r], parents[r], choice[r])  # follow_verified_tree, step by step
        assert int(length[r]) == len(want)
        assert np.asarray(path[r, : len(want)]).tolist() == want
        assert int(bonus[r]) == choice[r, want[-1]]
    assert np.asarray(length).max() >= 3


def test_greedy_choice_is_argmax():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, 9, 256)).astype(np.float32))
    keys = node_keys(jax.vmap(jax.random.key)(jnp.arange(3, dtype=jnp.uint32)), jnp.arange(5, 8)[:, None] + jnp.arange(9))
    zeros = jnp.zeros(3)
    got = choose(logits, keys, zeros, jnp.full(3, 0.5), jnp.full(3, 3, jnp.int32))
    np.testing.assert_array_equal(got, np.asarray(logits).argmax(-1))


def test_node_keys_depend_only_on_own_seed_and_position():
    """A node's key is its sequence's seed at the node's position: distinct across positions and seeds, the same for
    siblings (one position) and for the same (seed, position) in another batch or another round's tree."""
    seq = jax.vmap(jax.random.key)(jnp.asarray([0, 1, 0], jnp.uint32))
    positions = jnp.asarray([[10, 11, 12, 13], [10, 11, 12, 13], [14, 15, 16, 17]])
    keys = node_keys(seq, positions)
    data = np.asarray(jax.random.key_data(keys)).reshape(12, -1)
    assert len({tuple(r) for r in data}) == 12
    alone = node_keys(seq[1:2], jnp.asarray([[12, 12, 10]]))
    np.testing.assert_array_equal(jax.random.key_data(alone[0]), jax.random.key_data(keys[1, jnp.asarray([2, 2, 0])]))


# A hand-made distribution: probabilities 0.40 0.25 0.15 0.10 0.06 0.04, shuffled over 6 tokens.
PROBS = np.asarray([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
ORDER = np.asarray([3, 0, 5, 1, 4, 2])  # token ORDER[i] has probability PROBS[i]


def hand_logits():
    lg = np.zeros(6, np.float32)
    lg[ORDER] = np.log(PROBS)
    return lg


def kept(temperature, top_p, top_k):
    lg = jnp.asarray(np.tile(hand_logits(), (1, 1, 1)))
    out = filter_logits(lg, jnp.asarray([temperature]), jnp.asarray([top_p]), jnp.asarray([top_k], jnp.int32))
    out = np.asarray(out[0, 0])
    keep = np.isfinite(out)
    np.testing.assert_allclose(out[keep], hand_logits()[keep] / temperature, rtol=1e-6)
    return set(np.flatnonzero(keep).tolist())


def top(n):
    return set(ORDER[:n].tolist())


@pytest.mark.parametrize(
    "temperature,top_p,top_k,n",
    [
        (1.0, 1.0, 0, 6),  # no filter
        (1.0, 1.0, 3, 3),
        (1.0, 1.0, 1, 1),
        (1.0, 1.0, 10, 6),  # k above the vocabulary
        (1.0, 0.3, 0, 1),  # 0.40 covers 0.3
        (1.0, 0.5, 0, 2),  # 0.40 < 0.5 <= 0.65
        (1.0, 0.7, 0, 3),  # 0.65 < 0.7 <= 0.80
        (1.0, 0.85, 0, 4),
        (1.0, 0.93, 0, 5),
        (1.0, 0.99, 0, 6),
        (1.0, 0.85, 2, 2),  # both: the smaller set
        (1.0, 0.5, 4, 2),
        (0.5, 0.7, 0, 2),  # top-p after the temperature: p ∝ PROBS**2 -> 0.615, 0.240, 0.086, ...
        (2.0, 0.7, 0, 4),  # p ∝ sqrt(PROBS) -> 0.277, 0.219, 0.170, 0.139, ...
    ],
)
def test_filter_keeps_exactly_the_right_set(temperature, top_p, top_k, n):
    assert kept(temperature, top_p, top_k) == top(n)


def sorted_filter(x, top_p, top_k):
    """The oracle: sort, cumulative mass, cut (numpy, float64 sums): what a top-k / top-p filter keeps. x [V]."""
    srt = np.sort(x)[::-1]
    k = min(top_k, len(x)) if top_k > 0 else len(x)
    probs = np.exp(srt - srt[0]) / np.exp(srt - srt[0]).sum()
    before = np.cumsum(probs) - probs
    keep = ((before < top_p) | (top_p >= 1.0)) & (np.arange(len(x)) < k)
    return x >= srt[keep].min()


@pytest.mark.parametrize("seed,form", [(0, "search"), (1, "search"), (0, "sort")])
def test_filter_matches_a_sorted_cumulative_sum_on_random_logits(seed, form, monkeypatch):
    """Both forms of the filter (the search for the cutoff, the sort of larger logits) keep what sorting and summing
    in float64 keeps, row by row, over random logits (sharp and flat, with ties), every top-p / top-k mix."""
    from ddtree_jax import vocab_parallel

    monkeypatch.setattr(vocab_parallel, "FILTER_SEARCH_MAX_BYTES", 1 << 30 if form == "search" else 0)
    monkeypatch.setattr(vocab_parallel, "_filtered_by_" + ("sort" if form == "search" else "search"), None)  # not taken
    rng = np.random.default_rng(seed)
    b, t, v = 6, 5, 3000
    x = rng.standard_normal((b, t, v)) * rng.choice([0.3, 1.0, 4.0], size=(b, t, 1))
    x[:, 0, : v // 2] = np.round(x[:, 0, : v // 2], 1)  # many ties
    x = x.astype(np.float32)
    top_p = np.asarray([1.0, 0.9, 0.5, 0.99, 1.0, 0.7], np.float32)
    top_k = np.asarray([0, 0, 0, 40, 7, 300], np.int32)
    # a fresh function to trace: the patched vocab_parallel module decides the form while tracing
    out = np.asarray(jax.jit(lambda *a: accept.filter_logits(*a))(jnp.asarray(x), jnp.ones(b), jnp.asarray(top_p),
                                                                   jnp.asarray(top_k)))
    for i in range(b):
        for j in range(t):
            want = sorted_filter(x[i, j].astype(np.float64), float(top_p[i]), int(top_k[i]))
            np.testing.assert_array_equal(np.isfinite(out[i, j]), want, err_msg=f"row {i}, node {j}")
            np.testing.assert_array_equal(out[i, j][want], x[i, j][want])


def test_filter_is_per_sequence():
    lg = jnp.asarray(np.tile(hand_logits(), (4, 2, 1)))
    out = filter_logits(
        lg, jnp.asarray([1.0, 1.0, 1.0, 0.5]), jnp.asarray([1.0, 0.5, 1.0, 0.7]), jnp.asarray([0, 0, 3, 0], jnp.int32)
    )
    sets = [set(np.flatnonzero(np.isfinite(np.asarray(out[b, t]))).tolist()) for b in range(4) for t in range(2)]
    assert sets == [top(6)] * 2 + [top(2)] * 2 + [top(3)] * 2 + [top(2)] * 2


def test_mixed_greedy_and_sampled_rows():
    """Per-sequence temperatures: greedy rows are the argmax for any key; sampled rows follow the filtered
    tempered distribution (checked by frequencies over many keys) and never leave the kept set."""
    rows = [  # (temperature, top_p, top_k)
        (0.0, 1.0, 0),
        (1.0, 1.0, 0),
        (0.0, 0.5, 2),
        (0.5, 1.0, 0),
        (1.0, 0.7, 0),
        (2.0, 1.0, 3),
    ]
    b, nodes, draws = len(rows), 2, 4000
    temp, top_p, top_k = (jnp.asarray(x) for x in zip(*rows))
    top_k = top_k.astype(jnp.int32)
    logits = jnp.asarray(np.tile(hand_logits(), (b, nodes, 1)))

    @jax.jit
    def draw(i):
        seq = jax.vmap(jax.random.key)(jnp.arange(b, dtype=jnp.uint32) + 100)
        keys = accept.node_keys(seq, jnp.full((b, 1), i) + jnp.arange(nodes))
        return accept.choose(logits, keys, temp, top_p, top_k)

    samples = np.asarray(jax.lax.map(draw, jnp.arange(draws)))  # [draws, B, nodes]
    lg = hand_logits().astype(np.float64)
    for r, (t, p, k) in enumerate(rows):
        s = samples[:, r, :]
        if t == 0:
            assert (s == ORDER[0]).all()
            continue
        want = np.exp(lg / t)
        want /= want.sum()
        keep = kept(t, p, k)
        mask = np.zeros(6, bool)
        mask[list(keep)] = True
        want = np.where(mask, want, 0.0)
        want /= want.sum()
        for node in range(nodes):
            counts = np.bincount(s[:, node], minlength=6)
            assert counts[~mask].sum() == 0, (r, counts)
            expected = draws * want[mask]
            stat = ((counts[mask] - expected) ** 2 / expected).sum()
            dof = int(mask.sum()) - 1
            if dof:
                pval = float(jax.scipy.stats.chi2.sf(stat, dof))
                assert pval > 1e-3, (r, node, counts, expected)
        # the two nodes of a row use independent keys
        assert (s[:, 0] != s[:, 1]).any()


def test_the_choice_has_no_branch_and_each_program_agrees_where_it_applies():
    """Spec.sampling / Spec.filtering (static) compile the greedy argmax alone, a sample without a top-k / top-p pass,
    or both; none has a ``cond`` (whose predicate a GPU reads on the host every round). Where a program applies it
    gives the general one's tokens: greedy rows the argmax, unfiltered sampled rows the same sample (same keys)."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((3, 5, 64)).astype(np.float32))
    keys = node_keys(jax.vmap(jax.random.key)(jnp.arange(3, dtype=jnp.uint32)), jnp.arange(3, 6)[:, None] + jnp.arange(5))
    greedy = (logits, keys, jnp.zeros(3), jnp.ones(3), jnp.zeros(3, jnp.int32))
    np.testing.assert_array_equal(choose(*greedy, sampling=False), np.asarray(logits).argmax(-1))
    np.testing.assert_array_equal(choose(*greedy, sampling=False), choose(*greedy))
    hot = (logits, keys, jnp.asarray([0.0, 1.0, 0.7]), jnp.ones(3), jnp.zeros(3, jnp.int32))
    plain, general = choose(*hot, filtering=False), choose(*hot)
    np.testing.assert_array_equal(plain, general)
    assert (np.asarray(plain)[1:] != np.asarray(logits).argmax(-1)[1:]).any()  # the hot rows sampled
    np.testing.assert_array_equal(plain[0], np.asarray(logits)[0].argmax(-1))

    def program(**flags):  # the jaxpr's text, nested jaxprs (jitted helpers) included
        return str(jax.make_jaxpr(lambda *a: accept.choose(*a, **flags))(*hot))

    for flags in ({"sampling": False}, {"filtering": False}, {}):
        assert " cond[" not in program(**flags), flags
    assert " cond[" in str(jax.make_jaxpr(lambda x: jax.lax.cond(x > 0, jnp.sin, jnp.cos, x))(1.0))  # as it shows
    assert " sort[" not in program()  # the filter searches for its cutoff: no sort of the vocabulary
    assert program().count("reduce_sum") > program(filtering=False).count("reduce_sum")  # its passes, only with it
