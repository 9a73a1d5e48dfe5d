"""Where the drafter trainer's step time goes: each part of ``train_draft``'s step timed alone on random weights of
the default pair's shape (or another of ``ddtree_jax.shapes``), with XLA's cost analysis beside each time.

    PYTHONPATH=. python benchmarks/train_step_profile.py --out DIR [--trace DIR2]   # on the GPU, about 3-5 minutes
    PYTHONPATH=. python benchmarks/train_step_profile.py --quick --out DIR          # a CPU rehearsal, tiny shape

Items, each its own jitted function compiled ahead, timed as the median of ``--repeats`` calls (each ended by
``jax.block_until_ready``) after ``--warmup`` calls:

    target_features   the target's forward over the packed rows with the segment mask (objective.target_features),
                      with XLA's attention; on a GPU also through the tree-attention kernel ("target_features pallas")
    context_kv        every drafter layer's context K/V from the features (objective.context_kv)
    step ...          the trainer's own compiled step (trainer._compiled_fns: value_and_grad + the optax update) at
                      the recipe's anchors / group / loss / rows, then one variant at a time: group x2 and /2,
                      anchors /2, the kl loss, half the row length at twice the rows
    loss_fwd          the trainer's loss alone (no gradient) at the recipe
    group ...         one anchor group's pieces: block_hidden forward, and forward + backward (a VJP into the drafter's
                      weights and the context K/V); the output layer + cross-entropy over [B, G, bs-1, V] from random
                      hidden states and labels, forward and forward + backward into the hidden states, in the
                      log_softmax form and the logsumexp form (their values and gradients compared)

Each row: ms, XLA's 'flops' and 'bytes accessed' of the compiled program (what XLA counts: a scan's body counted
once or per trip depends on the backend), the implied TFLOP/s and GB/s, and the program's temporary memory.
Writes DIR/train_step_profile.json and prints a table. ``--trace DIR2`` also records 3 recipe steps with
jax.profiler.trace (open in TensorBoard / Perfetto) and adds a summary of its device kernels to the JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ddtree_jax import cli  # noqa: E402
from ddtree_jax.bench.records import log, now, print_table, write_json  # noqa: E402
from ddtree_jax.shapes import SHAPES  # noqa: E402

QUICK = dict(shape="tiny", batch=2, seq_len=128, anchors=32, group=8, repeats=2, warmup=1, variants=False)


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python benchmarks/train_step_profile.py",
        description="Time each part of the drafter trainer's step (target features, context K/V, the whole step and "
                    "its variants, the loss alone, one anchor group's pieces) on random weights, with XLA's FLOP and "
                    "byte counts; writes one JSON.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="directory for train_step_profile.json")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m",
                   help="target shape (ddtree_jax.shapes) and its drafter (layers, block, taps)")
    p.add_argument("--batch", type=cli.positive_int, default=16, metavar="N", help="rows per step")
    p.add_argument("--seq-len", type=cli.positive_int, default=2048, metavar="N", help="tokens per row")
    p.add_argument("--anchors", type=cli.positive_int, default=512, metavar="N", help="blocks per row per step")
    p.add_argument("--group", type=cli.positive_int, default=32, metavar="N", help="anchors computed at once")
    p.add_argument("--loss", choices=("ce", "kl"), default="ce", help="the recipe's loss")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the target's weights and the step's compute dtype (the drafter's master weights are f32)")
    p.add_argument("--repeats", type=cli.positive_int, default=5, metavar="N", help="timed calls per item (median)")
    p.add_argument("--warmup", type=cli.nonneg_int, default=2, metavar="N", help="untimed calls before them")
    p.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the step at group x2 and /2, anchors /2, the other loss, half the row length at "
                        "twice the rows (--no-variants: the recipe's step only)")
    p.add_argument("--trace", default=None, metavar="DIR2", help="also record 3 recipe steps with jax.profiler.trace")
    p.add_argument("--quick", action="store_true",
                   help="a CPU rehearsal: shape tiny, 2 rows of 128 tokens, 32 anchors in groups of 8, 2 repeats "
                        "and no variants (overrides those flags)")
    return p


# ---------------------------------------------------------------------------------------------- inputs


def random_rows(batch: int, seq_len: int, vocab: int, seed: int = 0):
    """[batch, seq_len] packed rows (``dataset.pack``) of random sequences: prompts of 1/64 .. 1/4 of a row, responses
    of 1/32 .. 1/2 (about two thirds response tokens, as the recipe's data), random tokens."""
    import numpy as np

    from ddtree_jax.training import dataset

    rng = np.random.default_rng(seed)
    items, total = [], 0
    while total < 1.3 * batch * seq_len:
        p = int(rng.integers(max(1, seq_len // 64), seq_len // 4 + 1))
        r = int(rng.integers(max(2, seq_len // 32), seq_len // 2 + 1))
        items.append((rng.integers(0, vocab - 1, p + r).tolist(), p, dataset.TRAIN, 0.0, "random"))
        total += p + r
    return dataset.pack(dataset.Sequences.build(items), seq_len).take(np.arange(batch))


def cost(compiled) -> dict:
    """XLA's cost analysis of a compiled program (flops, bytes accessed) and its temporary memory."""
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, (list, tuple)) else (ca or {})
    out = {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}
    try:
        out["temp_mib"] = round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1)
    except Exception:  # noqa: BLE001 - not every backend reports it
        pass
    return out


class Profile:
    """The items measured so far (written after each one, so a run cut short keeps them)."""

    def __init__(self, args, meta: dict):
        self.args, self.items, self.compiled = args, [], {}
        self.record = {"meta": meta, "items": self.items}
        self.path = os.path.join(args.out, "train_step_profile.json")

    def time(self, name: str, jitted, args: tuple, thread=None, **info):
        """Compile ``jitted`` for ``args``, then time it (returns the last call's output). ``thread(out) -> args``: the next call's arguments (a step
        that donates its state); None: the same arguments every call."""
        import jax

        t0 = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        self.compiled[name] = compiled
        times = []
        for i in range(self.args.warmup + self.args.repeats):
            t0 = time.perf_counter()
            out = jax.block_until_ready(compiled(*args))
            if i >= self.args.warmup:
                times.append(time.perf_counter() - t0)
            if thread is not None:
                args = thread(out)
        ms = 1e3 * statistics.median(times)
        c = cost(compiled)
        item = {"name": name, "ms": round(ms, 3), "ms_all": [round(1e3 * t, 3) for t in times], **c,
                "tflops_per_s": round(c["flops"] / ms / 1e9, 2), "gb_per_s": round(c["bytes"] / ms / 1e6, 1),
                "compile_s": round(compile_s, 1), **info}
        if "model_flops" in info:  # the figure the trainer's record reports (objective.flops_per_row)
            item["model_tflops_per_s"] = round(info["model_flops"] / ms / 1e9, 1)
        self.items.append(item)
        write_json(self.path, self.record)
        log(f"{name}: {ms:.2f} ms, {c['flops'] / 1e9:.1f} GFLOP, {c['bytes'] / 1e9:.2f} GB")
        return out


# ---------------------------------------------------------------------------------------------- the items


def log_softmax_nll(logits, labels):
    """-log softmax(logits)[label], the log_softmax-then-gather form."""
    import jax
    import jax.numpy as jnp

    return -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), labels[..., None], axis=-1)[..., 0]


def run(args) -> dict:
    import jax
    import jax.numpy as jnp

    from ddtree_jax.shapes import build_params, model_configs
    from ddtree_jax.training import objective, trainer

    dtype = jnp.dtype(args.dtype)
    tcfg, dcfg = model_configs(SHAPES[args.shape])
    bs, b, t, v = dcfg.block_size, args.batch, args.seq_len, tcfg.vocab_size
    meta = {"date": now(), "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
            "shape": args.shape, "batch": b, "seq_len": t, "anchors": args.anchors, "group": args.group,
            "loss": args.loss, "dtype": args.dtype, "block_size": bs, "vocab": v,
            "model_flops_per_step": objective.flops_per_row(tcfg, dcfg, t, args.anchors) * b}
    prof = Profile(args, meta)
    tparams, _ = build_params(tcfg, dcfg, dtype)

    def batch_of(rows_b, rows_t):
        rows = random_rows(rows_b, rows_t, v)
        return objective.Batch(jnp.asarray(rows.tokens), jnp.asarray(rows.positions), jnp.asarray(rows.supervised))

    batch = batch_of(b, t)
    meta["response_share"] = round(float(jnp.mean(batch.supervised)), 3)
    key = jax.random.key(1)
    master = trainer.init_params(dcfg, jax.random.key(0))
    compute = jax.tree.map(lambda x: x.astype(dtype), master)

    # 1-2. the target's features, the drafter's context K/V
    feats, final = prof.time("target_features", jax.jit(
        lambda tp, batch: objective.target_features((tcfg, tp), dcfg.target_layer_ids, batch)), (tparams, batch))
    if jax.default_backend() == "gpu":  # the same features through the tree-attention kernel (no [T, T] scores)
        try:
            pf, _ = prof.time("target_features pallas", jax.jit(lambda tp, batch: objective.target_features(
                (tcfg, tp), dcfg.target_layer_ids, batch, attention="pallas")), (tparams, batch))
            diff = jnp.abs(pf.astype(jnp.float32) - feats.astype(jnp.float32))
            meta["pallas_features_max_abs_diff"] = float(jnp.max(diff))
        except Exception as e:  # noqa: BLE001 - recorded; the rest of the profile still runs
            meta["pallas_features_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    kv = prof.time("context_kv", jax.jit(lambda p, f, pos: objective.context_kv(p, dcfg, f, pos)),
                   (compute, feats, batch.positions))

    # 3-4. the trainer's step (recipe, then variants) and its loss alone
    recipe = objective.Objective(anchors=args.anchors, group=args.group, loss=args.loss)
    variants = [("recipe", recipe, b, t)]
    if args.variants:
        other = "kl" if args.loss == "ce" else "ce"
        variants += [(f"group {args.group * 2}", dataclasses.replace(recipe, group=args.group * 2), b, t),
                     (f"group {max(1, args.group // 2)}", dataclasses.replace(recipe, group=max(1, args.group // 2)),
                      b, t),
                     (f"anchors {max(1, args.anchors // 2)}",
                      dataclasses.replace(recipe, anchors=max(1, args.anchors // 2)), b, t),
                     (f"loss {other}", dataclasses.replace(recipe, loss=other), b, t),
                     (f"seq {t // 2} x {2 * b} rows", recipe, 2 * b, t // 2)]
    for label, obj, vb, vt in variants:
        tc = trainer.TrainConfig(steps=0, batch=0, lr=0.0, warmup=0, seed=0, compute_dtype=args.dtype, objective=obj)
        step_fn, loss_fn = trainer._compiled_fns(dcfg, tcfg, tc, None)
        vbatch = batch if (vb, vt) == (b, t) else batch_of(vb, vt)
        params, opt = jax.tree.map(jnp.copy, master), trainer.optimizer(tc).init(master)
        lr = jnp.float32(1e-4)
        state = {}

        def thread(out, vbatch=vbatch):
            state["params"], state["opt"] = out[0], out[1]
            return state["params"], state["opt"], tparams, vbatch, key, lr

        flops = objective.flops_per_row(tcfg, dcfg, vt, obj.anchors) * vb
        prof.time(f"step {label}", step_fn, (params, opt, tparams, vbatch, key, lr), thread=thread,
                  model_flops=flops, rows=vb, seq_len=vt, anchors=obj.anchors, group=obj.group, loss=obj.loss)
        if label == "recipe":
            traced = (thread, state)  # the recipe step's state, for --trace
            prof.time("loss_fwd recipe", loss_fn, (master, tparams, batch, key))

    # 5. one anchor group's pieces
    g = min(args.group, args.anchors, t)
    anchors, _ = objective.sample_anchors(key, batch, g)
    prof.time(f"group block_hidden fwd (G={g})", jax.jit(
        lambda p, kv, a: objective.block_hidden(p, dcfg, tparams.embed, kv, batch, a)), (compute, kv, anchors))
    ct = jax.random.normal(key, (b, g, bs, tcfg.hidden_size), jnp.float32)
    prof.time(f"group block_hidden fwd+bwd (G={g})", jax.jit(
        lambda p, kv, a, ct: jax.vjp(lambda p, kv: objective.block_hidden(p, dcfg, tparams.embed, kv, batch, a),
                                     p, kv)[1](ct)), (compute, kv, anchors, ct))
    head = tparams.head()
    k1, k2, k3 = jax.random.split(key, 3)
    hidden = jax.random.normal(k1, (b, g, bs - 1, tcfg.hidden_size), jnp.float32)
    labels = jax.random.randint(k2, (b, g, bs - 1), 0, v, jnp.int32)
    weights = jax.random.uniform(k3, (b, g, bs - 1), jnp.float32)

    def head_ce(nll):
        def f(hidden):
            logits = jnp.einsum("bgkd,dv->bgkv", hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)
            per = nll(logits, labels)
            hits = jnp.sum(jnp.argmax(logits, axis=-1) == labels)
            return jnp.sum(per * weights), (per, hits)
        return f

    forms = {"log_softmax": log_softmax_nll, "logsumexp": objective.label_nll}  # before and since the switch
    got = {}
    for form, nll in forms.items():
        f = head_ce(nll)
        prof.time(f"group head+ce fwd {form}", jax.jit(f), (hidden,))
        got[form] = prof.time(f"group head+ce fwd+bwd {form}", jax.jit(jax.value_and_grad(f, has_aux=True)), (hidden,))
    (_, (per_a, _)), grad_a = got["log_softmax"]
    (_, (per_b, _)), grad_b = got["logsumexp"]
    meta["ce_forms"] = {"nll_max_abs_diff": float(jnp.max(jnp.abs(per_a - per_b))),
                        "nll_equal": bool(jnp.all(per_a == per_b)),
                        "grad_max_abs_diff": float(jnp.max(jnp.abs(grad_a - grad_b))),
                        "grad_max_abs": float(jnp.max(jnp.abs(grad_a)))}
    groups = -(-min(args.anchors, t) // g)
    ms = {i["name"]: i["ms"] for i in prof.items}
    per_group = (ms[f"group block_hidden fwd (G={g})"] + ms[f"group block_hidden fwd+bwd (G={g})"]
                 + ms["group head+ce fwd logsumexp"] + ms["group head+ce fwd+bwd logsumexp"])
    # the groups run forward, then again (jax.checkpoint) with their backward: the pieces' sum beside the step's time
    meta["groups_per_step"] = groups
    meta["pieces_ms"] = {"target_features": ms["target_features"], "context_kv": ms["context_kv"],
                         "groups": round(groups * per_group, 3), "step": ms["step recipe"]}

    if args.trace:
        step_fn = prof.compiled["step recipe"]
        thread, state = traced
        args_ = thread((state["params"], state["opt"]))
        with jax.profiler.trace(args.trace):
            for _ in range(3):
                args_ = thread(jax.block_until_ready(step_fn(*args_)))
        pb = sorted(glob.glob(os.path.join(args.trace, "**", "*.xplane.pb"), recursive=True))
        if pb:
            from ddtree_jax.bench.analysis import profile_summary

            prof.record["trace"] = {"path": pb[-1], "summary": profile_summary(pb[-1])}
    write_json(prof.path, prof.record)
    return prof.record


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        for k, x in QUICK.items():
            setattr(args, k, x)
    if args.seq_len < 64:
        raise cli.UsageError("--seq-len must be at least 64")
    record = run(args)
    rows = [{**i, "gflop": i["flops"] / 1e9, "gb": i["bytes"] / 1e9} for i in record["items"]]
    print_table(rows, ["name", "ms", "gflop", "gb", "tflops_per_s", "gb_per_s", "temp_mib", "model_tflops_per_s"])
    m = record["meta"]
    print(f"CE forms: nll max |diff| {m['ce_forms']['nll_max_abs_diff']:.3g}, grad max |diff| "
          f"{m['ce_forms']['grad_max_abs_diff']:.3g}; model GFLOP a recipe step {m['model_flops_per_step'] / 1e9:.1f}; "
          f"pieces (ms): {m['pieces_ms']} ({m['groups_per_step']} groups x (block_hidden fwd + fwd+bwd, head+ce "
          f"fwd + fwd+bwd))")
    print("XLA's counts of a program with a loop (the steps, the loss) may count the loop's body once: "
          "compare the steps' FLOPs with model_flops, and the pieces with the step")
    print(f"wrote {os.path.join(args.out, 'train_step_profile.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
