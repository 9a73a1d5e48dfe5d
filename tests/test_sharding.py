"""Sharding (ddtree_jax.sharding) on 8 fake CPU devices, against one device and the reference fixtures.

The device count of a process is fixed when jax starts, so the multi-device checks run once, in a
subprocess (this file executed as a script with XLA_FLAGS=--xla_force_host_platform_device_count=8), and
report JSON that the tests below assert on:
- meshes 2x2, 1x4 (the fixture target has 2 KV heads: replicated to 4) and 8x1, for the methods of GRID (all three
  on 2x2, ar and ddtree on 1x4, ddtree on 8x1): one batch of 8 rows, each the first half of its fixture prompt's
  new tokens, 3 greedy (compared with the reference fixtures: outputs and per-round acceptance
  lengths) and 5 sampled with temperature / top-k / top-p (compared with one device, same seeds);
- the compiled HLO of a 2x2 round and AR step (row-parallel all-reduces present, nothing vocabulary-sized gathered) and
  of an 8x1 round and prefill (no collective at all: data parallelism is communication-free);
- decode.generate(mesh=...) padding a batch of 3 to the data axis, and with output-major target weights; the attention and tree-walk kernels per
  device under shard_map (the wrappers' splits on 2x2; the Pallas kernels in the Mosaic GPU interpreter on
  1x1); a checkpoint saved from one sharded layout and restored into another; impossible meshes.
Single-device checks (mesh parsing, error messages, KV-head replication, the CLI flag) run in-process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tempfile
import time

import pytest

from tests.conftest import decode_to_the_end, fake_device_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "ddtree_reference")
TARGET, DRAFT = os.path.join(FIXTURES, "target"), os.path.join(FIXTURES, "draft")
METHODS = ("ar", "dflash", "ddtree")
# The methods run on each mesh: all three on one device (the sampled rows' baseline) and on 2x2, whose vocabulary is
# split over the model axis and batch over the data axis (the chain's argmax and the tree's top-k over shards; its HLO
# is checked); ar and ddtree on 1x4 (the model axis alone, KV heads replicated) and ddtree on 8x1 (data parallel: its
# HLO is checked). Each other pair would repeat a split these cover (9 runs of the 18 that every method on one device
# and on five meshes would be): the sharded path on one device (1x1) is test_bench.py's fixtures mode on a mesh, and 1x2
# (the model axis alone, no replication) is 2x2's model split, and runs below with output-major weights.
GRID = {"none": METHODS, "2x2": METHODS, "1x4": ("ar", "ddtree"), "8x1": ("ddtree",)}
CASES = [(shape, method) for shape, methods in GRID.items() for method in methods]
BUDGET = 16  # ddtree; every round of the fixtures matches at budgets <= 16
VOCAB = 256
# (fixture prompt, temperature, top_k, top_p, seed): rows 0-2 greedy, 3-7 sampled
ROWS = (
    (0, 0.0, 0, 1.0, 0),
    (1, 0.0, 0, 1.0, 0),
    (2, 0.0, 0, 1.0, 0),
    (0, 0.9, 0, 1.0, 11),
    (1, 0.7, 5, 1.0, 12),
    (2, 1.0, 0, 0.8, 13),
    (0, 1.3, 20, 0.9, 14),
    (1, 0.5, 0, 1.0, 15),
)
GREEDY = [i for i, r in enumerate(ROWS) if r[1] == 0]
SAMPLED = [i for i, r in enumerate(ROWS) if r[1] > 0]


def _reference_runs():
    with open(os.path.join(FIXTURES, "generate.json")) as f:
        return json.load(f)["runs"]


def _new_tokens(run) -> int:
    """The grid's new tokens for a fixture prompt: half its reference's (20, 32 or 24; rows of different lengths)."""
    return run["max_new_tokens"] // 2


def _greedy(run) -> list[int]:
    """The reference's greedy sequence to the grid's length."""
    return run["ar"][: len(run["prompt"]) + _new_tokens(run)]


# ================================================================================ the 8-device subprocess
def _script(out_path: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from ddtree_jax import checkpoint, decode, model, sharding, weights

    assert jax.device_count() == 8, jax.devices()
    devices = jax.devices()
    runs = _reference_runs()
    prompts = [r["prompt"] for r in runs]
    target, drafter = weights.load_target(TARGET), weights.load_draft(DRAFT)
    report: dict = {"grid": {}, "hlo": {}, "seconds": {}}

    def mesh_of(shape: str):
        d, m = sharding.parse_mesh(shape)
        return sharding.make_mesh(shape, devices[: d * m])

    def run(method: str, mesh):
        """decode.generate's steps with per-row options (greedy and sampled rows in one batch)."""
        tgt, drf = target, drafter
        if mesh is not None:
            tgt = sharding.shard_model(target, mesh)
            drf = sharding.shard_model(drafter, mesh) if method != "ar" else drafter
        new = [_new_tokens(runs[r[0]]) for r in ROWS]
        base = decode.GenerateOptions(method=method, max_new_tokens=max(new), tree_budget=BUDGET)
        spec = decode.make_spec(tgt[0], drf[0], base, mesh=mesh, sampling=True, filtering=True)  # rows choose
        rows = [prompts[r[0]] for r in ROWS]
        opts = [dataclasses.replace(base, temperature=t, top_k=k, top_p=p, seed=s, max_new_tokens=n)
                for (_, t, k, p, s), n in zip(ROWS, new)]
        state, tokens = decode.start(spec, rows, opts, max(new), jnp.float32, mesh)
        tp, dp = tgt[1], drf[1] if method != "ar" else None
        outputs, acceptance, state, prefill, step = decode_to_the_end(spec, tp, dp, state, tokens, len(rows))
        result = {
            "outputs": outputs,
            "acceptance": acceptance,
            "cache_spec": str(state.cache.k.sharding.spec) if mesh is not None else None,
        }
        return result, prefill.as_text(), step.as_text()

    for shape, methods in GRID.items():
        t0 = time.time()
        mesh = None if shape == "none" else mesh_of(shape)
        report["grid"][shape] = {}
        for method in methods:
            result, prefill_hlo, rounds_hlo = run(method, mesh)
            report["grid"][shape][method] = result
            if (shape, method) in (("2x2", "ddtree"), ("2x2", "dflash"), ("2x2", "ar"), ("8x1", "ddtree")):
                report["hlo"][f"{shape} {method}"] = {
                    "rounds": sharding.collectives(rounds_hlo),
                    "prefill": sharding.collectives(prefill_hlo),
                }
        report["seconds"][shape] = time.time() - t0

    # decode.generate itself on a mesh: a batch of 3 padded to the data axis of 2x2
    t0 = time.time()
    res = decode.generate(target, prompts, decode.GenerateOptions(method="ddtree", max_new_tokens=40,
                          tree_budget=BUDGET), draft=drafter, mesh=mesh_of("2x2"))
    report["generate_2x2"] = {"outputs": res.output_ids, "acceptance": res.acceptance_lengths}
    report["seconds"]["generate"] = time.time() - t0

    # output-major target weights (the GPU layout, params.output_major) on meshes: one prompt, so AR multiplies
    # one row (the row-reduction form) on 1x4 (KV heads repeated along their output-major axis); ddtree on 1x2,
    # the drafter output-major too
    t0 = time.time()
    from ddtree_jax import params as params_lib

    om = (target[0], params_lib.output_major(target[1]))
    om_draft = (drafter[0], params_lib.output_major(drafter[1]))
    report["out_major"] = {
        f"{shape} {method}": decode.generate(om, prompts[:1], decode.GenerateOptions(
            method=method, max_new_tokens=40, tree_budget=BUDGET), draft=om_draft, mesh=mesh_of(shape)).output_ids[0]
        for shape, method in (("1x4", "ar"), ("1x2", "ddtree"))
    }
    report["seconds"]["out_major"] = time.time() - t0
    # the fused layout (q/k/v and gate/up concatenated) only where each device holds whole matrices
    report["fused"] = {
        f"{name} {shape}": decode.device_layout(sharding.shard_model(m, mesh_of(shape))[1], backend="gpu",
                                                layout="stacked-out-major-fused").layers.fused
        for name, m in (("target", target), ("drafter", drafter)) for shape in ("1x4", "4x1")
    }

    # the attention kernel per device under shard_map: the wrapper's specs on 2x2 (a jnp stand-in that records
    # the per-device shapes), then the Pallas kernel itself in the Mosaic GPU interpreter on a 1x1 mesh (the
    # interpreter's simulated GPU state is process-global: kernels interpreted on several CPU devices at once
    # can trip its barrier bookkeeping, so the multi-device kernel run belongs to the GPU machine)
    t0 = time.time()
    from jax.sharding import NamedSharding

    from pallas_kernels import tree_attention as tat
    from pallas_kernels.inputs import attention_inputs

    b, t, h, kv, hd, plens = 2, 3, 4, 2, 64, [5, 13]
    q, k, v, p, bits = attention_inputs(sum(plens) + t, b, t, h, kv, max(plens) + t + 64, hd, plens, "random")
    seen = []

    def stand_in(q, k, v, p, bits):
        seen.append([list(x.shape) for x in (q, k, v, p, bits)])
        return tat.tree_attention_reference(q, k, v, p, bits)

    def attend(mesh, kernel, q, k, v, p, bits):
        with sharding.use_mesh(mesh):
            return sharding.per_device_attention(kernel)(q, k, v, p, bits)

    def place(mesh):
        heads = NamedSharding(mesh, P("data", None, "model", None))
        return [jax.device_put(x, heads) for x in (q, k, v)] + [
            jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (p, bits)]

    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    out = jax.jit(functools.partial(attend, mesh_of("2x2"), stand_in))(*place(mesh_of("2x2")))
    with sharding.use_mesh(mesh_of("1x1")):
        kernel = model.attention_fn("pallas-interpret")  # wrapped: the mesh is active
    pallas = jax.jit(lambda *a: kernel(*a))(*place(mesh_of("1x1")))
    with jax.default_matmul_precision("highest"):
        ref = tat.tree_attention_reference(q32, k32, v32, p, bits)
    xla = tat.tree_attention_reference(q, k, v, p, bits).astype(jnp.float32)
    # 'pallas-inplace': the stacked cache [L, B, S, K, hd] and the layer go to every device (its rows, its heads)
    seen_stacked = []

    def stand_in_stacked(q, k, v, p, bits, *, layer):
        seen_stacked.append([list(x.shape) for x in (q, k, v, p, bits)])
        return tat.tree_attention_reference(q, k, v, p, bits, layer=layer)

    def attend_stacked(q, k, v, p, bits, layer):
        with sharding.use_mesh(mesh_of("2x2")):
            return sharding.per_device_attention(stand_in_stacked, stacked=True)(q, k, v, p, bits, layer)

    stacked = NamedSharding(mesh_of("2x2"), P(None, "data", None, "model", None))
    qs, _, _, ps, bs = place(mesh_of("2x2"))
    ks, vs = (jax.device_put(jnp.stack([x[:, ::-1], x]), stacked) for x in (k, v))
    out_stacked = jax.jit(attend_stacked)(qs, ks, vs, ps, bs, jnp.int32(1))
    # the tree-walk kernel likewise: split on the batch, whole on every model device
    from ddtree_jax import accept
    from ddtree_jax.tree import Tree
    from pallas_kernels import tree_accept as tac

    parents = jnp.asarray([[-1, 0, 0, 1, 2, 3, 3], [-1, 0, 1, 2, 0, 4, 5]], jnp.int32)
    nodes = jnp.asarray([[5, 7, 8, 9, 3, 4], [5, 6, 7, 8, 9, 1]], jnp.int32)
    choice = jnp.asarray([[7, 9, 9, 4, 2, 2, 2], [5, 6, 7, 3, 4, 1, 2]], jnp.int32)
    tree = Tree(nodes, jnp.ones_like(nodes), parents, jnp.zeros((2, 7, 1), jnp.uint32))
    walked = []

    def walk_stand_in(tokens, parents, choice, *, max_depth, interpret):
        walked.append([list(x.shape) for x in (tokens, parents, choice)])
        return tac.tree_accept_reference(tokens, parents, choice, max_depth=max_depth)

    def walk(mesh, impl, kernel=None):
        if kernel is not None:
            tac.tree_accept, saved = kernel, tac.tree_accept
        try:
            with sharding.use_mesh(mesh):
                return jax.jit(lambda t, c: accept.walk(t, c, 3, impl=impl))(tree, choice)
        finally:
            if kernel is not None:
                tac.tree_accept = saved

    lists = lambda xs: [np.asarray(x).tolist() for x in xs]  # noqa: E731
    report["walk"] = {
        "stand_in": lists(walk(mesh_of("2x2"), "pallas", walk_stand_in)),
        "pallas_1x1": lists(walk(mesh_of("1x1"), "pallas-interpret")),
        "reference": lists(accept.walk(tree, choice, 3)),
    }
    report["walk"]["stand_in_shapes"] = walked[0]
    report["pallas"] = {
        "stand_in_shapes": seen[0],
        "stand_in_spec": str(out.sharding.spec),
        "stand_in_same": bool(jnp.array_equal(out, tat.tree_attention_reference(q, k, v, p, bits))),
        "stacked_shapes": seen_stacked[0],
        "stacked_same": bool(jnp.array_equal(out_stacked, tat.tree_attention_reference(q, k, v, p, bits))),
        "err": float(jnp.abs(pallas.astype(jnp.float32) - ref).max()),
        "xla_err": float(jnp.abs(xla - ref).max()),
    }
    report["seconds"]["pallas"] = time.time() - t0

    # the vocabulary top-k kernels (interpreter) on each vocabulary shard: the log-probs and ids of one device
    t0 = time.time()
    from ddtree_jax import tree as trees, vocab_parallel

    logits = jnp.round(3 * jax.random.normal(jax.random.key(5), (2, 3, 8192)), 1)  # ties across shards
    want = trees.top_log_probs(logits, 16, (64, 8))
    with sharding.use_mesh(mesh_of("1x4")):
        split = vocab_parallel._vocab_split() is not None
        got = jax.jit(lambda x: trees.top_log_probs(x, 16, "kernel"))(logits)
    report["vocab_top_k"] = {"same": all(bool(jnp.array_equal(w, g)) for w, g in zip(want, got)), "split": split,
                             "ids_beyond_first_shard": int(jnp.sum(want[1] >= 2048))}
    report["seconds"]["vocab_top_k"] = time.time() - t0


    # checkpoints: read the safetensors into 1x2, save from there, restore into 1x4 (KV heads replicated)
    t0 = time.time()
    cfg2, p2 = sharding.load_target(TARGET, mesh_of("1x2"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        checkpoint.save(path, p2, weights.read_config(TARGET), "target")
        cfg4, p4 = sharding.load_target(path, mesh_of("1x4"))
    wk = np.asarray(target[1].layers.wk)
    report["checkpoint"] = {
        "wq_spec_1x2": str(p2.layers.wq.sharding.spec),
        "kv_heads_1x4": cfg4.num_kv_heads,
        "wk_local_1x4": list(p4.layers.wk.addressable_shards[0].data.shape),
        "wk_spec_1x4": str(p4.layers.wk.sharding.spec),
        "wk_repeated": bool(np.array_equal(np.asarray(p4.layers.wk), np.repeat(wk, 2, axis=2))),
        "wv_repeated": bool(np.array_equal(np.asarray(p4.layers.wv), np.repeat(np.asarray(target[1].layers.wv), 2, 2))),
        "embed_spec": str(p4.embed.sharding.spec),
        "lm_head_spec": str(p4.lm_head.sharding.spec),
        "same_wq": bool(np.array_equal(np.asarray(p4.layers.wq), np.asarray(target[1].layers.wq))),
    }
    report["seconds"]["checkpoint"] = time.time() - t0

    errors = {}
    for name, fn in {
        "3x3": lambda: sharding.make_mesh("3x3"),
        "1x8 target": lambda: sharding.shard_model(target, sharding.make_mesh()),
        "8x1 odd devices": lambda: sharding.make_mesh("8x1", devices[:6]),
    }.items():
        try:
            fn()
            errors[name] = None
        except sharding.ShardingError as e:
            errors[name] = str(e)
    report["errors"] = errors
    with open(out_path, "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return fake_device_report(__file__, str(tmp_path_factory.mktemp("sharding") / "report.json"), 8)


# ================================================================================ multi-device (subprocess)
@pytest.mark.parametrize("shape,method", CASES)
def test_greedy_rows_match_the_reference(report, shape, method):
    runs = _reference_runs()
    got = report["grid"][shape][method]
    for i in GREEDY:
        run = runs[ROWS[i][0]]
        assert got["outputs"][i] == _greedy(run), (shape, method, i)
        if method != "ar":  # the reference's rounds until the row's last token
            want = run["dflash" if method == "dflash" else "ddtree"]
            want = want["acceptance_lengths"] if method == "dflash" else want[str(BUDGET)]["acceptance_lengths"]
            acc = got["acceptance"][i]
            assert acc == want[: len(acc)] and 1 + sum(acc) >= _new_tokens(run), (shape, method, i)


@pytest.mark.parametrize("shape,method", [case for case in CASES if case[0] != "none"])
def test_mesh_matches_one_device(report, shape, method):
    """Every row, greedy and sampled (same seeds): the same tokens and the same rounds as one device."""
    one, got = report["grid"]["none"][method], report["grid"][shape][method]
    assert got["outputs"] == one["outputs"]
    assert got["acceptance"] == one["acceptance"]


def test_sampled_rows_really_sample(report):
    runs = _reference_runs()
    for method in METHODS:
        outs = report["grid"]["none"][method]["outputs"]
        differ = [outs[i] != _greedy(runs[ROWS[i][0]]) for i in SAMPLED]
        assert sum(differ) >= len(SAMPLED) - 1, (method, differ)
        assert all(len(outs[i]) == len(_greedy(runs[ROWS[i][0]])) for i in SAMPLED)


def test_cache_layout(report):
    assert report["grid"]["2x2"]["ddtree"]["cache_spec"] == "P(None, 'data', None, 'model')"
    assert report["grid"]["8x1"]["ddtree"]["cache_spec"] == "P(None, 'data')"  # a size-1 model axis is dropped


def _vocab_sized(c: dict) -> bool:
    return any(VOCAB in dims for _, dims in c["shapes"])


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_hlo_of_a_tensor_parallel_round(report, method):
    """2x2: Megatron all-reduces after the row-parallel matmuls (attention output, MLP down) and the
    vocabulary-parallel embedding, in the target and the drafter; the tree's top-k and the target's argmax
    gather a few candidates per shard; nothing vocabulary-sized crosses devices; no data-axis traffic."""
    rounds = report["hlo"][f"2x2 {method}"]["rounds"]
    reduce_srcs = [c["source"] for c in rounds if c["op"] == "all-reduce"]
    for einsum in ("bthk,hkd->btd", "btf,fd->btd"):  # o_proj, down_proj
        hits = [c for c in rounds if c["op"] == "all-reduce" and c["source"].endswith(einsum + "/dot_general")]
        assert len(hits) >= 2, (einsum, reduce_srcs)  # target verify + drafter
        assert all(c["shapes"][0][1][-1] == 64 for c in hits)  # the hidden size: the residual stream
    assert any("gather" in s for s in reduce_srcs), reduce_srcs  # the embedding lookup
    bad = [c for c in rounds + report["hlo"][f"2x2 {method}"]["prefill"] if _vocab_sized(c)]
    assert not bad, bad
    gathers = [c for c in rounds if c["op"] == "all-gather"]
    assert gathers and all(max(d[-1] for _, d in c["shapes"]) <= 2 * BUDGET for c in gathers), gathers
    assert all(c["op"] in ("all-reduce", "all-gather") for c in rounds), rounds


def test_hlo_of_a_tensor_parallel_ar_step(report):
    """2x2 AR: the row-parallel all-reduces of the residual stream (attention output, MLP down), the embedding's, and
    the argmax's all-gather of one (value, index) per vocabulary shard; nothing vocabulary-sized. (On 2 x H200 the
    all-reduces take 5-10 µs each and the argmax's all-gather carries 8 bytes: docs/PERFORMANCE.md.)"""
    rounds = report["hlo"]["2x2 ar"]["rounds"]
    assert all(c["op"] in ("all-reduce", "all-gather") for c in rounds), rounds
    for einsum in ("bthk,hkd->btd", "btf,fd->btd"):
        hits = [c for c in rounds if c["op"] == "all-reduce" and c["source"].endswith(einsum + "/dot_general")]
        assert hits and all(c["shapes"][0][1][-1] == 64 for c in hits), (einsum, rounds)
    assert any("gather" in c["source"] for c in rounds if c["op"] == "all-reduce"), rounds  # the embedding lookup
    assert not [c for c in rounds + report["hlo"]["2x2 ar"]["prefill"] if _vocab_sized(c)]
    gathers = [c for c in rounds if c["op"] == "all-gather"]
    assert gathers and all(max(d[-1] for _, d in c["shapes"]) <= 2 for c in gathers), gathers


def test_hlo_of_a_data_parallel_round_has_no_collectives(report):
    hlo = report["hlo"]["8x1 ddtree"]
    assert hlo["rounds"] == [] and hlo["prefill"] == [], hlo


def test_generate_pads_the_batch_to_the_data_axis(report):
    """decode.generate(mesh=2x2) with 3 prompts, 40 new tokens each: the reference's first 40."""
    runs = _reference_runs()
    got = report["generate_2x2"]
    assert got["outputs"] == [r["ar"][: len(r["prompt"]) + 40] for r in runs]
    for acc, r in zip(got["acceptance"], runs):  # the same rounds until the 40th token
        ref = r["ddtree"][str(BUDGET)]["acceptance_lengths"]
        assert acc == ref[: len(acc)] and 1 + sum(acc) >= 40


def test_output_major_weights_on_meshes(report):
    """Output-major target and drafter weights sharded on 1x4 (AR, one row) and 1x2 (ddtree): the reference's
    tokens."""
    run = _reference_runs()[0]
    assert report["out_major"] == {k: run["ar"][: len(run["prompt"]) + 40] for k in ("1x4 ar", "1x2 ddtree")}


def test_fused_layout_only_for_whole_matrices(report):
    """A column split of [q | k | v] is no split of the heads: split weights stay unfused, replicated ones fuse."""
    want = {f"{m} {shape}": shape == "4x1" for m in ("target", "drafter") for shape in ("1x4", "4x1")}
    assert report["fused"] == want


def test_attention_kernel_runs_per_device(report):
    got = report["pallas"]
    # per device on 2x2: one sequence, two of the four query heads and one of the two KV heads
    assert got["stand_in_shapes"] == [[1, 3, 2, 64], [1, 80, 1, 64], [1, 80, 1, 64], [1], [1, 3, 1]]
    assert got["stand_in_spec"] == "P('data', None, 'model', None)" and got["stand_in_same"]
    # pallas-inplace: each device gets both layers of its rows and heads, and reads the layer asked for
    assert got["stacked_shapes"] == [[1, 3, 2, 64], [2, 1, 80, 1, 64], [2, 1, 80, 1, 64], [1], [1, 3, 1]]
    assert got["stacked_same"]
    assert got["err"] <= max(2 * got["xla_err"], 1e-2), got  # the Pallas kernel under shard_map (bf16)


def test_tree_walk_kernel_runs_per_device(report):
    got = report["walk"]
    assert got["stand_in_shapes"] == [[1, 7], [1, 7], [1, 7]]  # one sequence per data shard
    assert got["stand_in"] == got["reference"] and got["pallas_1x1"] == got["reference"]
    assert got["reference"][1] == [3, 4]  # paths of 2 and 3 edges: the walk is not trivial


def test_vocab_top_k_kernels_run_per_vocabulary_shard(report):
    """tree.top_log_probs with the Pallas top-k kernels on each of four vocabulary shards (Pallas interpreter):
    the same values and ids as one device, winners in several shards."""
    got = report["vocab_top_k"]
    assert got["split"] and got["same"] and got["ids_beyond_first_shard"] > 0


def test_checkpoint_restores_into_the_sharded_layout(report):
    got = report["checkpoint"]
    assert got["wq_spec_1x2"] == "P(None, None, 'model', None)"
    assert got["kv_heads_1x4"] == 4 and got["wk_local_1x4"][2] == 1
    assert got["wk_spec_1x4"] == "P(None, None, 'model', None)"
    assert got["wk_repeated"] and got["wv_repeated"] and got["same_wq"]
    assert got["embed_spec"] == "P('model', None)"
    assert got["lm_head_spec"] == "P(None, 'model')"


def test_impossible_meshes_on_eight_devices(report):
    errors = report["errors"]
    assert errors["3x3"].startswith("mesh 3x3 needs 9 devices, but 8 are visible")
    assert errors["1x8 target"] == "mesh 1x8: the target has 4 query heads, not divisible by the model axis (8)"
    assert "needs 8 devices, but 6 are visible" in errors["8x1 odd devices"]


# ================================================================================ single device (in-process)
def test_parse_mesh():
    from ddtree_jax import sharding

    assert sharding.parse_mesh("1x8") == (1, 8) and sharding.parse_mesh(" 2X4 ") == (2, 4)
    for bad in ("8", "2x", "x4", "2by4", "0x8", "1x2x2"):
        with pytest.raises(sharding.ShardingError, match="mesh"):
            sharding.parse_mesh(bad)


def test_make_mesh_needs_every_given_device():
    import jax

    from ddtree_jax import sharding

    with pytest.raises(sharding.ShardingError, match=r"^mesh 1x2 needs 2 devices, but 1 is visible"):
        sharding.make_mesh("1x2", jax.devices()[:1])
    mesh = sharding.make_mesh(None, jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "model": 1}


def _abstract(d: int, m: int):
    from jax.sharding import AbstractMesh

    return AbstractMesh((d, m), ("data", "model"))


def test_check_model_errors_are_one_line():
    from ddtree_jax import config, sharding

    cfg = config.model_config(TARGET)  # 4 query heads, 2 KV heads, intermediate 128, vocab 256
    sharding.check_model(cfg, _abstract(2, 4))  # KV heads replicated: fine
    cases = [
        (cfg, (1, 8), "mesh 1x8: the target has 4 query heads, not divisible by the model axis (8)"),
        (cfg, (1, 3), "mesh 1x3: the target has 4 query heads, not divisible by the model axis (3)"),
        (dataclasses.replace(cfg, num_heads=12, num_kv_heads=4), (1, 3),
         "mesh 1x3: the target has 4 KV heads: the model axis (3) must divide them or be a multiple of them"),
        (dataclasses.replace(cfg, intermediate_size=130), (1, 4),
         "mesh 1x4: the target has intermediate_size 130, not divisible by the model axis (4)"),
        (dataclasses.replace(cfg, vocab_size=258), (1, 4),
         "mesh 1x4: the target has vocab_size 258, not divisible by the model axis (4)"),
    ]
    for c, (d, m), msg in cases:
        with pytest.raises(sharding.ShardingError) as e:
            sharding.check_model(c, _abstract(d, m))
        assert str(e.value) == msg
    dcfg = config.draft_config(DRAFT)
    with pytest.raises(sharding.ShardingError, match="the drafter has 4 query heads"):
        sharding.check(_abstract(1, 8), dataclasses.replace(cfg, num_heads=8), dcfg)


def test_kv_head_replication_leaves_attention_unchanged():
    """Repeating every KV head r times (head j -> heads j*r .. j*r+r-1) keeps query head h on a copy of its
    original KV head, so GQA attention gives the same result with K*r KV heads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax import config, params, sharding
    from pallas_kernels import tree_attention as tat
    from pallas_kernels.bitmask import causal_bits

    cfg = config.model_config(TARGET)
    assert sharding.kv_copies(cfg, _abstract(1, 4)) == 2 and sharding.kv_copies(cfg, _abstract(1, 2)) == 1
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 5, 8, 16))
    k, v = (jax.random.normal(kk, (2, 12, 2, 16)) for kk in keys[1:])
    lens, bits = jnp.asarray([3, 7]), causal_bits(2, 5)
    ref = tat.tree_attention_reference(q, k, v, lens, bits)
    for r in (2, 4):
        rep = functools.partial(jnp.repeat, repeats=r, axis=2)
        np.testing.assert_allclose(tat.tree_attention_reference(q, rep(k), rep(v), lens, bits), ref, atol=1e-6)
    layers = params.init_random(params.layer_shapes(cfg, jnp.float32), jax.random.key(1))
    big = sharding.expand_kv_heads(layers, 2)
    assert big.wk.shape == (6, 64, 4, 16) and big.wv.shape == (6, 64, 4, 16)
    np.testing.assert_array_equal(big.wk[:, :, 3], layers.wk[:, :, 1])
    assert big.wq is layers.wq and big.k_norm is layers.k_norm


def test_generate_cli_rejects_bad_meshes(capsys):
    from ddtree_jax import generate

    for mesh, msg in (("2by4", "error: mesh '2by4': expected DxM"), ("7x9", "error: mesh 7x9 needs 63 devices")):
        code = generate.main(["--target", TARGET, "--prompt-ids", "1,2,3", "--mesh", mesh])
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and msg in err, err


def test_fused_weights_are_refused_by_shard_model():
    """Fused q/k/v (decode.device_layout's GPU layout) cannot be split by heads: a clear error, not a wrong split."""
    from ddtree_jax import decode, sharding, weights

    cfg, params = weights.load_target(TARGET)
    fused = decode.device_layout(params, backend="gpu", layout="stacked-out-major-fused")
    assert fused.layers.fused
    with pytest.raises(ValueError, match="unfused weights"):
        sharding.shard_model((cfg, fused), sharding.make_mesh("1x1"))


def test_no_mesh_is_the_identity():
    import jax.numpy as jnp

    from ddtree_jax import sharding, vocab_parallel

    x = jnp.ones((2, 3, 4))
    assert sharding.active() is None and sharding.constrain(x, ("batch", "seq", "vocab")) is x
    with sharding.use_mesh(None):
        assert sharding.active() is None
    assert (vocab_parallel.filter_logits(x, jnp.ones(2), jnp.zeros(2, jnp.int32)) == x).all()  # no filter: all kept
    assert sharding.padded_batch(3, None) == 3


if __name__ == "__main__":  # the multi-device subprocess
    sys.path.insert(0, REPO)
    _script(sys.argv[1])
