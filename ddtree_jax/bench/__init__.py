"""``python -m ddtree_jax.bench``: speed of ar / dflash / ddtree, on the fixtures (CPU) or at real shapes (GPU).

Subcommands
  fixtures  the tiny reference pair of tests/fixtures/ddtree_reference (any backend; float32): ar, dflash and
            ddtree at a few budgets on the fixture prompts: per-round time, acceptance length, and whether
            the output equals the reference's. Quick; a smoke test of the whole pipeline.
  models    random-weight models of real shapes (Qwen3-8B, Qwen3-4B, the MoE Qwen3-Coder-30B-A3B, each with its
            DFlash drafter shape), built directly on the device under jit (no weights travel), bf16. For each prompt
            length and batch: AR ms per token with its HBM roofline; dflash and ddtree ms per round at tree budgets,
            each with a breakdown (draft, tree, verify, accept+commit: every stage its own compiled function
            on the same state), the ratio to an AR step and the two-number floor. Extras on the first
            configuration: HLO checks (host transfers, big copies), N rounds in one call vs N calls, a
            profiler trace summary, tree-build micro-benchmarks. Writes JSON records (the format of
            benchmarks/results/*.json) and a details file. ``--quick`` runs a tiny shape (CPU-friendly).
            Weights are laid out as decode.device_layout does on GPU for each method (without ``--layout``:
            stacked layers under lax.scan, q/k/v and gate/up fused, the target's matrices input-major for dflash
            and ddtree and output-major for ar, the drafter's output-major); the round loop and the stages compile
            with decode.XLA_OPTIONS, and the verify rows are padded as decode.default_verify_align says.
            ``--tuning KEY=VALUE,...`` (ddtree_jax.tuning) changes how the rounds run, e.g. a layer kernel
            against XLA's ops (qkv_write=0), the verify's padding or the layer loop's unroll. An MoE target's
            records also hold the distinct experts one more round touches per layer (measured from the router's
            choices, ``ddtree_jax.moe_cost``; random weights route about uniformly), and its rooflines and floors
            count the bytes of those experts only.
  pair      a trained pair (default: the default pair) on the shipped held-out Python prompts, one at a time or
            as one batch: mean acceptance length and decode tokens/s of ar, dflash and ddtree at budgets.
  project   the projected speedup over AR of dflash and ddtree: the DDTree paper's mean acceptance lengths
            (benchmarks/paper_tau.json) x our recorded round costs (benchmarks/results/h200.json), per dataset.
            A projection, not a measurement (ddtree_jax.projection).
  table     README's performance tables (ms per round, the stage breakdown) and the ratios to the official
            PyTorch code, from the recorded results (ddtree_jax.tables).
  kernels   pallas_kernels.bench_kernels, if present, with the remaining arguments.

The KV caches are filled with random values and their lengths set to the prompt length (no prefill is
timed). With random weights the drafter almost never agrees with the target, so rounds accept about one
token; the timings do not depend on that (every shape is static), the acceptance lengths do.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import gzip
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Sequence

from ddtree_jax import cli, projection, tables
from ddtree_jax.bench.analysis import hlo_summary, profile_summary, weight_shape_strings
from ddtree_jax.bench.records import ARGV, command, fmt_breakdown, log, now, print_table, write_json
from ddtree_jax.bench.timing import J, Timer, aot, loop_us, make_spec, make_state, reset, sync
from ddtree_jax.shapes import SHAPES, Shape, build_params, model_configs
from ddtree_jax.tuning import LAYOUTS

PEER = {  # the official PyTorch DDTree code on the same H200, Qwen3-8B shapes, prompt 512, random weights
    "ar_ms": 78.5,
    "ddtree_ms_range": [102.0, 114.0],  # budgets 32..128
    "ddtree_budgets": [32, 128],
    "host_tree_build_ms_range": [0.7, 1.2],
}
TARGETS = {"ar_over_roofline": 1.15, "ddtree64_over_ar": 1.25, "ddtree256_over_ar": 1.5, "tree_build_256_us": 50.0}


# =============================================================================================== fixtures
def _fixtures(args) -> int:
    import jax
    import jax.numpy as jnp

    from ddtree_jax import decode, weights

    root = args.fixtures
    cli.existing_dir("--fixtures", root)
    target = weights.load_target(os.path.join(root, "target"), dtype=jnp.float32)
    draft = weights.load_draft(os.path.join(root, "draft"), dtype=jnp.float32)
    with open(os.path.join(root, "generate.json")) as f:
        runs = json.load(f)["runs"][: args.prompts]
    mesh = None
    if args.mesh:  # the weights placed once (decode.generate would place them again on every call)
        from ddtree_jax import sharding

        mesh = sharding.make_mesh(args.mesh)
        target, draft = sharding.shard_model(target, mesh), sharding.shard_model(draft, mesh)
    configs = []
    for m in args.methods:
        if m == "ddtree":
            configs += [("ddtree", b) for b in args.budgets]
        else:
            configs.append((m, None))
    groups = [[r] for r in runs] + ([runs] if args.batched and len(runs) > 1 else [])
    records = []
    for method, budget in configs:
        for group in groups:
            n = min(r["max_new_tokens"] for r in group) if args.max_new_tokens is None else args.max_new_tokens
            opts = decode.GenerateOptions(method=method, max_new_tokens=n, tree_budget=budget or 1)
            prompts = [r["prompt"] for r in group]
            dr = draft if method != "ar" else None
            t0 = time.perf_counter()
            decode.generate(target, prompts, opts, draft=dr, mesh=mesh, tuning=args.tuning)  # compiles
            compile_s = time.perf_counter() - t0
            per_round, res = [], None
            for _ in range(args.repeats):
                res = decode.generate(target, prompts, opts, draft=dr, mesh=mesh, tuning=args.tuning)
                rounds = max(len(a) for a in res.acceptance_lengths) if method != "ar" else max(res.num_generated)
                per_round.append(1e3 * res.decode_s / max(rounds, 1))
            acc = [a for seq in res.acceptance_lengths for a in seq]
            parity = all(out == r["ar"][: len(out)] and len(out) == len(r["prompt"]) + n
                         for out, r in zip(res.output_ids, group))
            rec = {
                "model": "fixture-tiny", "method": method, "budget": budget, "batch": len(group),
                "prompt_len": max(len(p) for p in prompts), "max_new_tokens": n,
                "ms_per_round": statistics.median(per_round),
                "rounds": rounds, "mean_acceptance_length": (sum(acc) / len(acc)) if acc else None,
                "tokens_per_round": sum(res.num_generated) / len(group) / max(rounds, 1),
                "matches_reference": parity, "attention": res.attention, "compile_s": compile_s,
                "mesh": args.mesh, "device": jax.devices()[0].device_kind, "date": now(), "command": command(),
            }
            records.append(rec)
            log(f"{method:6s} budget={budget} batch={len(group)}: {rec['ms_per_round']:.2f} ms/round, "
                 f"acceptance {rec['mean_acceptance_length']}, parity {parity}")
    print_table(records, ["method", "budget", "batch", "prompt_len", "ms_per_round", "mean_acceptance_length",
                           "tokens_per_round", "matches_reference"])
    if args.json:
        write_json(args.json, records)
    if not all(r["matches_reference"] for r in records):
        cli.warn("some outputs differ from the reference AR output")
        return 1
    return 0


def _nbytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


# =============================================================================================== ceilings
def measure_ceilings(quick: bool) -> dict:
    """Copy bandwidth (read + write bytes), bf16 GEMV read bandwidth, bf16 matmul rate, on random data."""
    import jax
    import jax.numpy as jnp

    def med_ms(fn, arg_sets, k):
        fn(*arg_sets[0]).block_until_ready()
        out = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(k):
                r = fn(*arg_sets[i % len(arg_sets)])
            r.block_until_ready()
            out.append(1e3 * (time.perf_counter() - t0) / k)
        return statistics.median(out)

    n = (1 << 24) if quick else (1 << 31)  # bf16 elements: 4 GiB
    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (n,), jnp.float32).astype(jnp.bfloat16)
    copy_ms = med_ms(jax.jit(lambda a: a + jnp.bfloat16(1)), [(x,)], 5)
    copy_gbps = 2 * x.nbytes / copy_ms / 1e6
    del x
    d, f = (256, 512) if quick else (8192, 65536)  # 1 GiB of weights
    w = jax.random.normal(keys[1], (d, f), jnp.float32).astype(jnp.bfloat16)
    gemv = {}
    for b in (1, 8):
        v = jax.random.normal(keys[2], (b, d), jnp.float32).astype(jnp.bfloat16)
        ms = med_ms(jax.jit(lambda a, m: jnp.dot(a, m, preferred_element_type=jnp.float32)), [(v, w)], 10)
        gemv[f"batch{b}_gbps"] = w.nbytes / ms / 1e6
    del w
    m = 256 if quick else 8192
    a = jax.random.normal(keys[3], (m, m), jnp.float32).astype(jnp.bfloat16)
    mm_ms = med_ms(jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32).astype(jnp.bfloat16)),
                   [(a, a)], 10)
    return {"copy_gbps": copy_gbps, "copy_bytes": 2 * n * 2, "gemv": gemv,
            "matmul_tflops": 2 * m**3 / mm_ms / 1e9, "matmul_n": m}


# =============================================================================================== models mode
class Bench:
    def __init__(self, args):
        import jax
        import jax.numpy as jnp

        self.args = args
        self.t_start = time.time()
        self.dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        self.device = jax.devices()[0].device_kind
        self.records: list[dict] = []
        self.details: dict[str, Any] = {"meta": {
            "date": now(), "device": self.device, "backend": jax.default_backend(), "jax": jax.__version__,
            "python": platform.python_version(), "command": command(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }, "items": []}
        self.timer = Timer(args.repeats)
        self.out = args.out
        os.makedirs(self.out, exist_ok=True)

    # ---------------------------------------------------------------- bookkeeping
    def left(self) -> float:
        return self.args.time_budget_s - (time.time() - self.t_start)

    def flush(self):
        write_json(os.path.join(self.out, self.args.results_name), self.records)
        write_json(os.path.join(self.out, "bench_details.json"), self.details)

    def item(self, name: str, fn: Callable, *a, min_left: float = 0.0, **kw):
        if self.left() < min_left:
            log(f"skip {name}: {self.left():.0f}s left")
            self.details["items"].append({"name": name, "skipped": True})
            return None
        log(f"start {name} ({self.left():.0f}s left)")
        t0 = time.time()
        try:
            res = fn(*a, **kw)
            self.details["items"].append({"name": name, "s": time.time() - t0})
            return res
        except Exception as e:  # noqa: BLE001 - record and go on
            import traceback

            traceback.print_exc()
            self.details["items"].append({"name": name, "error": repr(e)[:1500], "s": time.time() - t0})
            return None
        finally:
            self.flush()

    # ---------------------------------------------------------------- one model
    def run_model(self, shape: Shape):
        import jax

        args = self.args
        tcfg, dcfg = model_configs(shape)
        t0 = time.time()
        tp, dp = build_params(tcfg, dcfg, self.dtype)
        self.mesh = None
        if args.mesh:  # the sharded path (ddtree_jax.sharding): weights placed, KV heads replicated if needed
            from ddtree_jax import sharding

            self.mesh = sharding.make_mesh(args.mesh)
            (tcfg, tp), (dcfg, dp) = (sharding.shard_model(m, self.mesh) for m in ((tcfg, tp), (dcfg, dp)))
        from ddtree_jax import decode

        # (the random weights are built stacked and input-major); without --layout (or --tuning layout=), the target
        # as decode lays it out for each method: the rounds' layout, and AR's (a second copy, made only if AR is timed)
        forced = args.tuning.layout if args.tuning.layout != "auto" else None
        args.layout = args.layout or forced
        args.draft_layout = args.draft_layout or forced or decode.DRAFT_GPU_LAYOUT
        self.layouts = {m: args.layout or (decode.GPU_AR_LAYOUT if m == "ar" else decode.GPU_LAYOUT)
                        for m in ("ar", "dflash", "ddtree")}
        tp_ar = (decode.device_layout(tp, layout=self.layouts["ar"])
                 if "ar" in args.methods and self.layouts["ar"] != self.layouts["ddtree"] else None)
        tp, dp = sync((decode.device_layout(tp, layout=self.layouts["ddtree"]),
                        decode.device_layout(dp, layout=args.draft_layout)))
        tp_ar = sync(tp_ar) if tp_ar is not None else tp
        info = {"layout": self.layouts["ddtree"], "ar_layout": self.layouts["ar"], "draft_layout": args.draft_layout,
            "build_s": time.time() - t0, "target_bytes": _nbytes(tp), "draft_bytes": _nbytes(dp),
            "target_layer_bytes": _nbytes(tp.layers), "lm_head_bytes": _nbytes(tp.lm_head),
            "embed_bytes": _nbytes(tp.embed),
        }
        self.details.setdefault("models", {})[shape.name] = info
        log(f"{shape.name}: built in {info['build_s']:.1f}s, target {info['target_bytes'] / 1e9:.2f} GB, "
             f"drafter {info['draft_bytes'] / 1e9:.2f} GB")
        self.ctx = dict(shape=shape, tcfg=tcfg, dcfg=dcfg, tp=tp, tp_ar=tp_ar, dp=dp,
                        wshapes=weight_shape_strings(tp, dp))
        self.ar_ms: dict = {}
        pb = [(p, b) for p in args.prompts for b in args.batches]
        primary = pb[0]
        budgets = args.budgets if "ddtree" in args.methods else []
        key = [x for x in budgets if x in args.key_budgets]
        rest = [x for x in budgets if x not in args.key_budgets]
        for p, b in pb:  # pass 1: AR, the key budgets, dflash
            extras = (p, b) == primary and shape.name == args.models[0]
            self.item(f"{shape.name} p{p} b{b} ar", self.run_config, p, b, "ar", 0, extras)
            for budget in key:
                self.item(f"{shape.name} p{p} b{b} ddtree{budget}", self.run_config, p, b, "ddtree", budget,
                          extras and budget == key[0])
            if "dflash" in args.methods:
                self.item(f"{shape.name} p{p} b{b} dflash", self.run_config, p, b, "dflash", 0, False)
            if extras and args.tree_micro:
                self.item(f"{shape.name} tree micro", self.tree_micro, [1, 8] if 8 in args.batches else [1])
        for p, b in pb:  # pass 2: the other budgets
            for budget in rest:
                self.item(f"{shape.name} p{p} b{b} ddtree{budget}", self.run_config, p, b, "ddtree", budget, False)
        del self.ctx, tp, dp
        jax.clear_caches()

    def capacity(self, spec_any, batch: int, prompt_len: int):
        """One cache capacity per batch for every prompt length, method and budget (as a server would size it):
        decode.layout for the longest prompt and the largest budget asked, and 256 new tokens. The prompt length
        is then data, not shape: one compiled program serves every prompt length (with --compile-cache, a
        second prompt length recompiles nothing). Attention reads only the prefix."""
        from ddtree_jax import decode

        big = make_spec(self.ctx["tcfg"], self.ctx["dcfg"], "ddtree", max(self.args.budgets), self.args.attention,
                        tuning=self.args.tuning)
        _, capacity, out_len = decode.layout(big, [max(prompt_len, *self.args.prompts)] * batch, 256)
        return capacity, out_len

    def run_config(self, prompt_len: int, batch: int, method: str, budget: int, extras: bool):
        import jax
        import jax.numpy as jnp

        from ddtree_jax import decode

        args, c = self.args, self.ctx
        tcfg, dcfg, tp, dp, shape = c["tcfg"], c["dcfg"], c["tp_ar" if method == "ar" else "tp"], c["dp"], c["shape"]
        spec = make_spec(tcfg, dcfg, method, budget, args.attention, self.mesh, tuning=args.tuning)
        dpp = dp if method != "ar" else None
        capacity, out_len = self.capacity(spec, batch, prompt_len)
        state = make_state(spec, shape.vocab, batch, prompt_len, capacity, out_len, self.dtype)
        if self.mesh is not None:
            from ddtree_jax import sharding

            state = jax.device_put(state, sharding.state_shardings(state, self.mesh))
        rec: dict[str, Any] = {"model": shape.name, "method": method, "budget": budget if method == "ddtree" else None,
                               "batch": batch, "prompt_len": prompt_len}
        info: dict[str, Any] = {"capacity": capacity, "attention": spec.attention, "layout": self.layouts[method],
                                "draft_layout": args.draft_layout, "tuning": dataclasses.asdict(spec.tuning),
                                "compile_s": {}}

        # ---- whole rounds: N in one while_loop call
        n = args.rounds
        i32 = jnp.int32
        compiled, cs = aot(decode.run_rounds, spec, tp, dpp, state, i32(n))
        info["compile_s"]["run_rounds"] = cs
        state = sync(compiled(tp, dpp, reset(state, prompt_len), i32(2)))  # warm

        def rounds_step(st):
            st = compiled(tp, dpp, st, i32(n))
            return st, st.n_rounds

        ms, state, all_ms = self.timer.chain(rounds_step, state, 1, prompt_len)
        ms /= n
        hist = jax.device_get(state.accept_hist[:, :n])
        rec["ms_per_round"] = ms
        info["ms_per_round_repeats"] = [t / n for t in all_ms]
        info["mean_acceptance_length"] = float(hist.mean()) if method != "ar" else None
        rec.update({"date": now(), "command": command(), "device": self.device, "details": info})
        self.records.append(rec)  # recorded now (and completed below): a timeout later keeps this number
        self.flush()
        log(f"  rounds: {ms:.3f} ms/round (compile {cs:.1f}s)")
        routed = None  # an MoE target's experts touched per layer by one more round (moe_cost; one device)
        if tcfg.num_experts and self.mesh is None:
            from ddtree_jax import moe_cost

            routed = info["experts"] = moe_cost.routed(spec, tp, dpp, state)
            rec["distinct_experts"] = routed["mean"]
            log(f"  experts touched per layer: {routed['mean']:.1f} ({routed['min']}-{routed['max']}; uniform "
                 f"routing of {routed['tokens']} rows: {routed['uniform']:.1f})")
        if extras and args.hlo:
            text = compiled.as_text()
            info["hlo"] = hlo_summary(text, c["wshapes"])
            try:
                mem = compiled.memory_analysis()
                info["memory"] = {k: getattr(mem, k) for k in dir(mem) if k.endswith("_in_bytes")}
            except Exception as e:  # noqa: BLE001
                info["memory"] = repr(e)
            fn = os.path.join(self.out, f"hlo_{shape.name}_{method}{budget or ''}.txt.gz")
            with gzip.open(fn, "wt") as f:
                f.write(text)
        if extras and args.ab:
            info["ab"], state = self.ab_variants(spec, tp, dpp, state, prompt_len, n, ms)
        if extras:
            info["one_call_vs_separate"] = self.loop_vs_calls(compiled, tp, dpp, state, prompt_len, n)
            state = info["one_call_vs_separate"].pop("_state")
            if args.profile:
                info["profile"], state = self.profile(compiled, tp, dpp, state, prompt_len, f"{method}{budget or ''}")

        # ---- stage breakdown: each stage its own compiled function, chained on the same state
        first = (prompt_len, batch) == (args.prompts[0], args.batches[0])
        if args.breakdown and (args.breakdown_all or method != "ddtree" or budget in args.key_budgets) \
                and (first or not args.breakdown_first_only):
            bd, cs = self.breakdown(spec, tp, dpp, state, prompt_len, batch)
            state = bd.pop("_state")
            info["compile_s"].update(cs)
            rec["breakdown_ms"] = bd
        # ---- ratios, rooflines
        kv_bytes = self.kv_bytes(tcfg, batch, prompt_len)
        w_bytes = self.step_weight_bytes(batch, routed)
        ceil = self.details.get("ceilings", {})
        bw = ceil.get("copy_gbps")
        if method == "ar":
            self.ar_ms[(prompt_len, batch)] = ms
            rec["roofline_ms"] = (w_bytes + kv_bytes) / bw / 1e6 if bw else None
            rec["roofline_bytes"] = w_bytes + kv_bytes
            if rec["roofline_ms"]:
                rec["ratio_to_roofline"] = ms / rec["roofline_ms"]
            if shape.name == "qwen3-8b" and prompt_len == 512 and batch == 1:
                rec["peer_ms"] = PEER["ar_ms"]
                rec["speedup_vs_peer"] = PEER["ar_ms"] / ms
        else:
            ar = self.ar_ms.get((prompt_len, batch))
            rec["ratio_to_ar"] = ms / ar if ar else None
            floor = self.round_floor(spec, batch, prompt_len, routed)
            rec["floor_ms"], info["floor"] = floor["floor_ms"], floor
            if method == "ddtree" and shape.name == "qwen3-8b" and prompt_len == 512 and batch == 1:
                rec["peer_ms_range"] = PEER["ddtree_ms_range"]
                rec["speedup_vs_peer_range"] = [PEER["ddtree_ms_range"][0] / ms, PEER["ddtree_ms_range"][1] / ms]
        heavy = {k: info.pop(k) for k in ("hlo", "memory", "profile", "one_call_vs_separate", "ab") if k in info}
        if heavy:
            self.details.setdefault("configs", {})[f"{shape.name} p{prompt_len} b{batch} {method}{budget or ''}"] = heavy
            if "one_call_vs_separate" in heavy:
                info["one_call_vs_separate"] = heavy["one_call_vs_separate"]
        rec.update({"roofline_ms": rec.get("roofline_ms"), "breakdown_ms": rec.get("breakdown_ms"),
                    "date": now(), "command": command(), "device": self.device, "attention": spec.attention,
                    "layout": self.layouts[method], "draft_layout": args.draft_layout,  # what projection filters on
                    "mean_acceptance_length": info["mean_acceptance_length"], "details": info})
        log(f"  -> {ms:.3f} ms/round" + (f", breakdown {fmt_breakdown(rec.get('breakdown_ms'))}" if args.breakdown else "")
             + (f", ratio to AR {rec['ratio_to_ar']:.3f}" if rec.get("ratio_to_ar") else "")
             + (f", roofline {rec['roofline_ms']:.3f} ms" if rec.get("roofline_ms") else ""))
        del state

    def breakdown(self, spec, tp, dp, state, prompt_len, batch):
        from ddtree_jax import tree as trees

        k = self.args.stage_iters
        out: dict[str, Any] = {}
        cs: dict[str, float] = {}

        def stage(name, step, state, iters=k):
            """Warm ``step`` (state -> (state, output)) once, time it chained ``iters`` times, and return
            the output of one more call (what the next stage consumes) with the state."""
            state, _ = step(state)
            out[name], state, _ = self.timer.chain(step, state, iters, prompt_len)
            state, result = step(state)
            return result, state

        if spec.method == "ar":
            tree = trees.root_only(batch)
        else:
            f_draft, cs["draft"] = aot(J("stage_draft"), spec, tp, dp, state)
            logits, state = stage("draft", lambda st: f_draft(tp, dp, st)[::-1], state)
            f_tree, cs["tree"] = aot(J("stage_tree"), spec, logits)
            tree, state = stage("tree", lambda st: (st, f_tree(logits)), state, 4 * k)
        f_ver, cs["verify"] = aot(J("stage_verify"), spec, tp, state, tree)
        outs, state = stage("verify", lambda st: f_ver(tp, st, tree)[::-1], state)
        f_acc, cs["accept_commit"] = aot(J("stage_accept"), spec, state, tree, outs)

        def accept_step(st):
            st = f_acc(st, tree, outs)
            return st, st.n_out

        _, state = stage("accept_commit", accept_step, state)
        out["sum"] = sum(v for kk, v in out.items())
        out["_state"] = state
        return out, cs

    def ab_variants(self, spec, tp, dp, state, prompt_len, n, base_ms):
        """run_rounds compiled with decode.XLA_OPTIONS updated by other XLA options (``--ab name:key=value,...``):
        time and HLO checks."""
        import jax.numpy as jnp

        from ddtree_jax import decode

        out = {"base_ms_per_round": base_ms}
        for name, update in self.args.ab:
            options = {**decode.XLA_OPTIONS, **update}
            try:
                t0 = time.perf_counter()
                compiled = decode.run_rounds.lower(spec, tp, dp, state, jnp.int32(n)).compile(options)
                cs = time.perf_counter() - t0
                state = sync(compiled(tp, dp, reset(state, prompt_len), jnp.int32(2)))

                def step(st, compiled=compiled):
                    st = compiled(tp, dp, st, jnp.int32(n))
                    return st, st.n_rounds

                ms, state, _ = self.timer.chain(step, state, 1, prompt_len)
                hlo = hlo_summary(compiled.as_text(), self.ctx["wshapes"])
                out[name] = {"options": options, "ms_per_round": ms / n, "compile_s": cs,
                             "n_weight_shaped_outputs": hlo["n_weight_shaped_outputs"],
                             "n_copies_over_1MiB": hlo["n_copies_over_1MiB"], "fusions": hlo["fusions"]}
                log(f"  ab {name}: {ms / n:.3f} ms/round (base {base_ms:.3f})")
            except Exception as e:  # noqa: BLE001
                out[name] = {"options": options, "error": repr(e)[:500]}
        return out, state

    def loop_vs_calls(self, compiled, tp, dp, state, prompt_len, n):
        """N rounds in one while_loop call vs N calls of one round (async, and blocking after each)."""
        import jax.numpy as jnp

        res = {}
        one = jnp.int32(1)
        for mode in ("one_call", "separate_async", "separate_blocking"):
            times = []
            for _ in range(self.args.repeats):
                state = sync(reset(state, prompt_len))
                t0 = time.perf_counter()
                if mode == "one_call":
                    state = compiled(tp, dp, state, jnp.int32(n))
                else:
                    for _ in range(n):
                        state = compiled(tp, dp, state, one)
                        if mode == "separate_blocking":
                            sync(state.n_rounds)
                sync(state)
                times.append(1e3 * (time.perf_counter() - t0) / n)
            res[f"{mode}_ms_per_round"] = statistics.median(times)
        res["host_overhead_per_call_ms"] = res["separate_blocking_ms_per_round"] - res["one_call_ms_per_round"]
        res["_state"] = state
        return res

    def profile(self, compiled, tp, dp, state, prompt_len, tag):
        import glob
        import shutil

        import jax
        import jax.numpy as jnp

        d = os.path.join("/tmp", f"ddtree_prof_{tag}_{os.getpid()}")
        state = sync(reset(state, prompt_len))
        with jax.profiler.trace(d):
            state = sync(compiled(tp, dp, state, jnp.int32(self.args.profile_rounds)))
        files = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))
        if not files:
            return {"error": "no trace written"}, state
        summ = profile_summary(files[-1])
        summ["rounds"] = self.args.profile_rounds
        size = os.path.getsize(files[-1])
        if size < (12 << 20):
            shutil.copy(files[-1], os.path.join(self.out, f"trace_{tag}.xplane.pb"))
        summ["trace_bytes"] = size
        return summ, state

    # ---------------------------------------------------------------- bytes and flops
    def kv_bytes(self, cfg, batch, prefix):
        import jax.numpy as jnp

        item = jnp.dtype(self.dtype).itemsize
        return 2 * cfg.num_layers * batch * prefix * cfg.num_kv_heads * cfg.head_dim * item

    def step_weight_bytes(self, batch, routed: dict | None = None):
        """Weights one target step must read: every layer (of an MoE target's experts, those ``routed`` reports
        touched: moe_cost), the final norm, lm_head; B embedding rows."""
        from ddtree_jax import moe_cost

        c = self.ctx
        tp = c["tp"]
        return (moe_cost.layer_bytes(tp.layers, routed and routed["distinct"]) + _nbytes(tp.final_norm)
                + _nbytes(tp.lm_head) + batch * tp.embed.shape[1] * tp.embed.dtype.itemsize)

    def round_floor(self, spec, batch, prefix, routed: dict | None = None) -> dict:
        """max(bytes / copy bandwidth, flops / matmul rate) of one speculative round (both models; an MoE target's
        bytes with the experts ``routed`` reports touched, its FLOPs with each token's k experts)."""
        from ddtree_jax import moe_cost

        c = self.ctx
        tcfg, dcfg, tp, dp = c["tcfg"], c["dcfg"], c["tp"], c["dp"]
        ceil = self.details.get("ceilings", {})
        t = 1 + spec.budget
        bs = dcfg.block_size
        dl = dcfg.layers
        kv_t = self.kv_bytes(tcfg, batch, prefix)
        kv_d = self.kv_bytes(dl, batch, prefix)
        lm = _nbytes(tp.lm_head)
        bytes_ = self.step_weight_bytes(batch, routed) + _nbytes(dp) + lm + kv_t + kv_d
        active = [tcfg.experts_per_token] * len(tcfg.sparse_layers) if tcfg.num_experts else None
        p_t = (moe_cost.layer_bytes(tp.layers, active) + lm) / 2  # parameters touched per token (bf16)
        p_d = _nbytes(dp.layers) / 2
        att_t = 4 * tcfg.num_layers * batch * t * (prefix + t) * tcfg.num_heads * tcfg.head_dim
        att_d = 4 * dl.num_layers * batch * bs * (prefix + bs) * dl.num_heads * dl.head_dim
        flops = 2 * p_t * batch * t + 2 * p_d * batch * bs + 2 * lm / 2 * batch * (bs - 1) + att_t + att_d
        bw, rate = ceil.get("copy_gbps"), ceil.get("matmul_tflops")
        mem_ms = bytes_ / bw / 1e6 if bw else None
        cmp_ms = flops / rate / 1e9 if rate else None
        return {"bytes": bytes_, "flops": flops, "memory_ms": mem_ms, "compute_ms": cmp_ms,
                "floor_ms": max(mem_ms or 0, cmp_ms or 0) or None}

    # ---------------------------------------------------------------- tree build micro-benchmarks
    def tree_micro(self, batches):
        """Device time of the tree build (its parts, and variants that must give the same tree) from K
        distinct random draft logits inside one jitted fori_loop (static trip count): t / K, with the
        loop's own cost per iteration ('empty_loop') measured the same way."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from ddtree_jax import tree as trees

        c = self.ctx
        shape, dcfg = c["shape"], c["dcfg"]
        dp_ = dcfg.block_size - 1
        res = {}
        k = self.args.tree_iters

        for b in batches:
            xs = 3.0 * jax.random.normal(jax.random.key(11), (k, b, dp_, shape.vocab), jnp.float32)
            budgets = self.args.tree_budgets if b == batches[0] else [x for x in self.args.tree_budgets if x == 256][:1]
            for budget in budgets:
                kk = min(budget, shape.vocab)
                row: dict[str, Any] = {}
                row["empty_loop_us"] = loop_us(lambda x: x[:, :, :1], xs)
                variants = {  # the defaults (on GPU the kernels; an unrolled depth loop), each selection
                    f"best_first_{sel}": lambda x, bb=budget, sel=sel: trees.best_first(x, bb, select=sel)
                    for sel in trees.SELECTS
                }
                chunks = {"xla": trees.default_topk_chunk(kk), "kernel": "kernel"}
                variants["best_first_count_no_kernels"] = lambda x, bb=budget: trees.best_first(
                    x, bb, select="count", chunk=chunks["xla"], bits="xla")
                for how, chunk in chunks.items():
                    variants[f"part_top_log_probs_{how}"] = lambda x, kk=kk, c=chunk: trees.top_log_probs(x, kk, c)
                for name, fn in variants.items():
                    row[name + "_us"] = loop_us(fn, xs)
                lp, ids = jax.jit(trees.top_log_probs, static_argnums=(1, 2))(xs, kk, chunks["xla"])
                for sel in trees.SELECTS:  # the tree from the sorted lists (with its ancestor bits)
                    core = functools.partial(trees.tree_from_lists, budget=budget, select=sel)
                    row[f"part_tree_from_lists_{sel}_us"] = loop_us(lambda p, c=core: c(p[0], p[1]), (lp, ids))
                par = jax.jit(jax.vmap(lambda x, bb=budget: trees.best_first(x, bb).parents))(xs)
                for how in trees.BITS:
                    row[f"part_ancestor_bits_{how}_us"] = loop_us(lambda p, h=how: trees.ancestor_bits(p, dp_, h), par)
                same = [f"best_first_{sel}" for sel in trees.SELECTS] + ["best_first_count_no_kernels"]
                got = jax.jit(lambda x: [variants[name](x) for name in same])(xs[1])
                row["selects_equal"] = bool(all(
                    np.array_equal(np.asarray(getattr(got[0], f)), np.asarray(getattr(other, f)))
                    for other in got[1:] for f in ("tokens", "depths", "parents", "bits")))
                res[f"b{b}_budget{budget}"] = row
                log(f"  tree b{b} budget {budget}: " + ", ".join(
                    f"{kk_}={v:.1f}" if isinstance(v, float) else f"{kk_}={v}" for kk_, v in row.items()))
                self.details.setdefault("tree_micro", {})[shape.name] = res
                self.flush()
            del xs
        return res


def _models(args) -> int:
    import jax

    if args.quick:
        args.models = args.models or ["tiny"]
        args.prompts = args.prompts_set or [64]
        args.batches = args.batches_set or [1, 2]
        args.budgets = args.budgets_set or [4, 16]
        args.key_budgets = args.key_budgets_set or [16]
        args.rounds = min(args.rounds, 3)
        args.repeats = 1
        args.stage_iters = 2
        args.tree_iters = 2
        args.tree_budgets = [16]
        args.profile_rounds = 2
    else:
        args.models = args.models or ["qwen3-8b", "qwen3-4b"]
        args.prompts = args.prompts_set or [512, 2048]
        args.batches = args.batches_set or [1, 8]
        args.budgets = args.budgets_set or [16, 32, 64, 128, 256, 512]
        args.key_budgets = args.key_budgets_set or [64, 256]
    for m in args.models:
        if m not in SHAPES:
            raise cli.UsageError(f"unknown model {m!r} (choose from {', '.join(SHAPES)})")
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    bench = Bench(args)
    log(f"device {bench.device}, backend {jax.default_backend()}, budget {args.time_budget_s:.0f}s")
    bench.details["ceilings"] = bench.item("ceilings", measure_ceilings, args.quick) or {}
    log(f"ceilings: {bench.details['ceilings']}")
    for m in args.models:
        bench.item(f"model {m}", bench.run_model, SHAPES[m])
    bench.details["meta"]["total_s"] = time.time() - bench.t_start
    bench.flush()
    moe = ["distinct_experts"] if any("distinct_experts" in r for r in bench.records) else []
    print_table(bench.records, ["model", "method", "budget", "batch", "prompt_len", "ms_per_round", "roofline_ms",
                                 "ratio_to_roofline", "ratio_to_ar", "floor_ms", *moe], breakdown=True)
    return 0


# =============================================================================================== kernels
def _kernels(rest: list[str]) -> int:
    try:
        from pallas_kernels import bench_kernels
    except ImportError as e:
        raise cli.UsageError(f"pallas_kernels.bench_kernels is not available here ({e})") from None
    code = bench_kernels.main(rest)
    return 0 if code is None else int(code)


# =============================================================================================== CLI
def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return vals


def _budgets(text: str) -> list:
    """'16,64,auto' -> [16, 64, 'auto'] (argparse type)."""
    parts = [x.strip().lower() for x in text.split(",") if x.strip()]
    nums = [x for x in parts if x != "auto"]
    return (_ints(",".join(nums)) if nums else []) + (["auto"] if "auto" in parts else [])


def xla_options(text: str) -> dict | None:
    """``KEY=VALUE,...`` -> {KEY: VALUE} (None if malformed); true/false become bools, integers ints. A piece
    without "=" continues the previous value, for list-valued options (``xla_gpu_enable_command_buffer=FUSION,WHILE``)."""
    pairs: list[list[str]] = []
    for piece in filter(None, text.split(",")):
        if "=" in piece:
            pairs.append(piece.split("=", 1))
        elif pairs:
            pairs[-1][1] += "," + piece
        else:
            return None
    if not pairs or not all(k and v for k, v in pairs):
        return None
    return {k: {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
            for k, v in pairs}


def _ab(text: str) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,...`` -> (NAME, {KEY: VALUE}) (:func:`xla_options`)."""
    name, colon, opts = text.partition(":")
    options = xla_options(opts)
    if not (name and colon and options):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:KEY=VALUE,... (e.g. pdl:xla_gpu_enable_pdl=true)")
    return name, options


def _names(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


LAYOUT_CHOICES = tuple(x for x in LAYOUTS if x != "auto")  # --layout, --draft-layout


def build_parser() -> cli.ArgumentParser:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fixtures_default = os.path.join(repo, "tests", "fixtures", "ddtree_reference")
    p = cli.ArgumentParser(prog="python -m ddtree_jax.bench", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True, parser_class=cli.ArgumentParser)

    f = sub.add_parser("fixtures", help="the tiny reference pair (CPU): per-round time, acceptance, parity",
                       description="ar / dflash / ddtree on the fixture pair and prompts; per-round time "
                                   "(decode time / rounds, compile excluded), acceptance length, parity with "
                                   "the reference output.")
    f.add_argument("--fixtures", default=fixtures_default, help="fixture directory (default: %(default)s)")
    f.add_argument("--methods", type=_names, default=["ar", "dflash", "ddtree"],
                   help="comma-separated methods among ar,dflash,ddtree (default: all)")
    f.add_argument("--budgets", type=_ints, default=[1, 4, 16, 64], help="ddtree tree budgets (default: 1,4,16,64)")
    f.add_argument("--prompts", type=int, default=3, help="how many fixture prompts to run (default: 3)")
    f.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per prompt (default: the fixture's max_new_tokens)")
    f.add_argument("--batched", action="store_true", help="also run all prompts as one batch")
    f.add_argument("--repeats", type=int, default=2, help="timed runs per configuration; median (default: 2)")
    f.add_argument("--mesh", default=None, metavar="DxM",
                   help="run on a data x model mesh of every visible device (ddtree_jax.sharding; e.g. 1x2: each "
                        "layer split over 2 devices, 2x1: the prompts split); default: one device")
    cli.add_tuning(f)
    f.add_argument("--json", default=None, help="write the records (a JSON list) to this file")

    m = sub.add_parser("models", help="random-weight models of real shapes, built on the device",
                       description="Qwen3-8B / Qwen3-4B shapes with their DFlash drafter (5 layers, block 16, "
                                   "taps 1,9,17,25,33), random bf16 weights made on the device. Times AR, "
                                   "dflash and ddtree rounds with per-stage breakdowns; see the module doc.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--models", type=_names, default=None,
                   help=f"comma-separated among {', '.join(SHAPES)} (default: qwen3-8b,qwen3-4b; tiny with --quick)")
    m.add_argument("--prompts", dest="prompts_set", type=_ints, default=None,
                   help="prompt lengths = cache prefix (default: 512,2048; --quick: 64)")
    m.add_argument("--batches", dest="batches_set", type=_ints, default=None,
                   help="batch sizes (default: 1,8; --quick: 1,2)")
    m.add_argument("--budgets", dest="budgets_set", type=_ints, default=None,
                   help="ddtree tree budgets (default: 16,32,64,128,256,512; --quick: 4,16)")
    m.add_argument("--key-budgets", dest="key_budgets_set", type=_ints, default=None,
                   help="budgets run first for every prompt/batch (the rest come after) (default: 64,256; "
                        "--quick: 16)")
    m.add_argument("--methods", type=_names, default=["ar", "dflash", "ddtree"],
                   help="methods; ar always runs (the ratios need it); ddtree runs --budgets (default: ar,dflash,ddtree)")
    m.add_argument("--rounds", type=int, default=10, help="rounds per timed run_rounds call (default: 10)")
    m.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is kept (default: 3)")
    m.add_argument("--stage-iters", type=int, default=10,
                   help="chained calls per timed repeat of a stage (the tree: 4x) (default: 10)")
    m.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the stage breakdown")
    m.add_argument("--breakdown-first-only", action="store_true",
                   help="break down only the first prompt/batch configuration (saves compiles)")
    m.add_argument("--layout", choices=LAYOUT_CHOICES,
                   default=None,
                   help="the target's layer weights for every method: separate per-layer arrays (an unrolled layer "
                        "loop) or stacked [L, ...] arrays under lax.scan; -out-major: the matrices stored [out, in], "
                        "so a one-row step is a row reduction (else [in, out], which cuBLAS reads faster at 2 rows "
                        "and more); -fused: also q/k/v and gate/up as one matrix each (default: --tuning's layout "
                        "if set, else as decode.device_layout lays it out on GPU for each method, decode.GPU_LAYOUT "
                        "stacked-fused for dflash and ddtree, decode.GPU_AR_LAYOUT stacked-out-major-fused for ar)")
    m.add_argument("--draft-layout", choices=LAYOUT_CHOICES,
                   default=None,
                   help="the drafter's layer weights, in the same forms as --layout (its fc stays input-major; a "
                        "fused drafter keeps its k and v matrices for the context projection) (default: "
                        "--tuning's layout if set, else decode.DRAFT_GPU_LAYOUT, stacked-out-major-fused)")
    cli.add_tuning(m)  # its layout: the default of --layout and --draft-layout
    m.add_argument("--breakdown-all", action="store_true",
                   help="break down every ddtree budget (default: only the --key-budgets)")
    m.add_argument("--ab", action="append", type=_ab, default=[], metavar="NAME:KEY=VAL,...",
                   help="on the first configuration, also compile run_rounds with decode.XLA_OPTIONS updated by "
                        "these XLA options and time it (repeatable), e.g. merge:xla_gpu_dot_merger_threshold_mb=32; "
                        "a list value continues after commas (cb:xla_gpu_enable_command_buffer=FUSION,WHILE)")
    m.add_argument("--no-hlo", dest="hlo", action="store_false", help="skip the HLO checks")
    m.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiler trace")
    m.add_argument("--profile-rounds", type=int, default=5, help="rounds inside the profiler trace (default: 5)")
    m.add_argument("--no-tree-micro", dest="tree_micro", action="store_false",
                   help="skip the tree-build micro-benchmarks")
    m.add_argument("--tree-budgets", type=_ints, default=[64, 256, 512],
                   help="budgets of the tree micro-benchmarks (default: 64,256,512)")
    m.add_argument("--tree-iters", type=int, default=16, help="trees per micro-benchmark loop (default: 16)")
    m.add_argument("--attention", choices=cli.ATTENTIONS, default="auto", help=cli.ATTENTION_HELP)
    m.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16", help="weights and caches")
    m.add_argument("--mesh", default=None, metavar="DxM",
                   help="run_rounds on a data x model mesh (ddtree_jax.sharding); --mesh 1x1 against the default "
                        "measures the sharded path's overhead on one device (the stage breakdown stays unsharded)")
    m.add_argument("--quick", action="store_true", help="a tiny model and few sizes (a CPU rehearsal)")
    m.add_argument("--time-budget-s", type=float, default=480.0,
                   help="start no new item after this many seconds (default: 480)")
    m.add_argument("--out", default="bench_out", help="output directory (default: %(default)s)")
    m.add_argument("--results-name", default="results.json", help="records file name in --out")
    m.add_argument("--compile-cache", default=None, help="a persistent JAX compilation cache directory")

    q = sub.add_parser("pair", help="a trained pair (default: the default pair) on held-out prompts: mean "
                                    "acceptance length and decode speed of ar, dflash and ddtree budgets")
    q.add_argument("--target", default="default", metavar="PATH",
                   help="target directory (default: the default pair's SmolLM2-135M-Instruct)")
    q.add_argument("--draft", default=None, metavar="PATH", help="drafter directory (default: the shipped one)")
    q.add_argument("--budgets", type=_budgets, default=[16, 32, 64, 128, 256, "auto"],
                   help="ddtree tree budgets, auto among them for --tree-budget auto (each prompt's rounds take the "
                        "form with the most expected tokens per second; the record lists the forms that ran) "
                        "(default: 16,32,64,128,256,auto)")
    q.add_argument("--forms", type=cli.form_list, default=None, metavar="LIST", help=cli.FORMS_HELP)
    q.add_argument("--prompts", type=cli.positive_int, default=4,
                   help="held-out prompts (the shipped held-out Python questions, ddtree_jax/data/prompts) "
                        "(default: 4)")
    q.add_argument("--max-new-tokens", type=cli.positive_int, default=64, help="tokens per prompt (default: 64)")
    q.add_argument("--batched", action="store_true",
                   help="all prompts as one batch (default: one prompt at a time, batch 1)")
    q.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16", help="(default: bfloat16)")
    q.add_argument("--attention", choices=cli.ATTENTIONS, default="auto", help=cli.ATTENTION_HELP)
    q.add_argument("--check", action="store_true",
                   help="also compare every method's tokens with ar's and replay each round's tree walk on the host "
                        "from a traced run (columns same-as-ar, first divergence, walk mismatches)")
    q.add_argument("--json", default=None, help="write the results (a JSON object) to this file")

    j = sub.add_parser("project", help="projected speedup over AR: the paper's acceptance lengths x our round costs",
                       description="Projected speedup over AR of dflash and ddtree per dataset: the DDTree paper's "
                                   "mean acceptance length tau x (AR ms per token / round ms), the round costs from "
                                   "recorded `models` runs (the latest record of the current GPU layout). A "
                                   "projection, not a measurement; see ddtree_jax/projection.py.")
    j.add_argument("--results", default=str(projection.RESULTS),
                   help="records of `bench models` (a JSON list) (default: %(default)s)")
    j.add_argument("--tau", default=str(projection.PAPER_TAU),
                   help="the paper's acceptance lengths and speedups (default: %(default)s)")
    j.add_argument("--models", type=_names, default=["qwen3-8b", "qwen3-4b"],
                   help="comma-separated models of both files (default: qwen3-8b,qwen3-4b)")
    j.add_argument("--temperature", default="0.0", help="the paper's temperature, 0.0 or 1.0 (default: 0.0)")
    j.add_argument("--prompt", type=cli.positive_int, default=512, help="the records' prompt length (default: 512)")
    j.add_argument("--batch", type=cli.positive_int, default=1, help="the records' batch (default: 1)")
    j.add_argument("--budgets", type=_ints, default=[64, 256], help="ddtree budgets to project (default: 64,256)")
    j.add_argument("--json", default=None, help="write the rows (a JSON list, one object per model) to this file")

    t = sub.add_parser("table", help="README's performance tables from the recorded results",
                       description="ms per round and the stage breakdown per model, prompt, batch and method, as "
                                   "markdown, from the latest record of each configuration in the current GPU layout "
                                   "(ddtree_jax/tables.py); README's tables are this output.")
    t.add_argument("--results", default=str(projection.RESULTS),
                   help="records of `bench models` (a JSON list) (default: %(default)s)")
    t.add_argument("--models", type=_names, default=["qwen3-8b", "qwen3-4b"],
                   help="comma-separated models (default: qwen3-8b,qwen3-4b)")
    t.add_argument("--prompts", type=_ints, default=[512, 2048], help="prompt lengths (default: 512,2048)")
    t.add_argument("--batches", type=_ints, default=[1, 8], help="batch sizes (default: 1,8)")
    t.add_argument("--budgets", type=_ints, default=[16, 32, 64, 128, 256, 512],
                   help="ddtree budgets (default: 16,32,64,128,256,512)")

    sub.add_parser("kernels", help="pallas_kernels.bench_kernels with the remaining arguments", add_help=False)
    return p


# =============================================================================================== pair
def _pair(args) -> int:
    """training.evaluate.benchmark on held-out prompts, one at a time (batch 1) or as one batch; per method the mean
    acceptance length over all rounds and the mean decode tokens/s, compilation excluded."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import decode, defaults, weights
    from ddtree_jax.tokenizer import load_tokenizer
    from ddtree_jax.training import evaluate, prompts as curated

    target_path = defaults.target_path() if args.target == "default" else cli.existing_dir("--target", args.target)
    draft_path = cli.existing_dir("--draft", args.draft or defaults.draft_path())
    dtype = jnp.dtype(args.dtype)
    # laid out once for the backend here, for the rounds (device_layout is idempotent: each dflash / ddtree call below
    # then has nothing to do; on GPU each ar call turns the target output-major again, before its timed decode), not
    # once per prompt
    target, draft = ((cfg, decode.device_layout(p)) for cfg, p in (weights.load_target(target_path, dtype),
                                                                  weights.load_draft(draft_path, dtype)))
    tok = load_tokenizer(target_path)
    if tok is None:
        raise cli.UsageError(f"{target_path} has no tokenizer: the held-out prompts are text")
    held_out = [curated.chat_ids(tok, m) for m in curated.held_out_set("python")]
    prompts = held_out[: args.prompts]
    stop = tuple(dict.fromkeys(tok.eos_token_ids + target[0].eos_token_ids))
    groups = [prompts] if args.batched else [[p] for p in prompts]
    fixed = [b for b in args.budgets if b != decode.AUTO]
    runs = [evaluate.benchmark(target, draft, g, budgets=fixed, max_new_tokens=args.max_new_tokens,
                               stop_ids=stop, attention=args.attention, check=args.check, log=lambda m: None)
            for g in groups]
    if decode.AUTO in args.budgets:
        for run, g in zip(runs, groups):
            run["ddtree-auto"] = _auto_run(target, draft, g, args, stop, run["ar"]["tokens_per_s"])
    table = {}
    for name in runs[0]:
        acc = [r[name]["mean_acceptance_length"] for r in runs if r[name]["mean_acceptance_length"] is not None]
        tps = [r[name]["tokens_per_s"] for r in runs if r[name]["tokens_per_s"]]
        mins = [r[name]["min_acceptance_length"] for r in runs if r[name]["min_acceptance_length"] is not None]
        table[name] = {"mean_acceptance_length": statistics.fmean(acc) if acc else None,
                       "min_acceptance_length": min(mins) if mins else None,  # >= 1: generate checks it
                       "tokens_per_s": statistics.fmean(tps) if tps else None,
                       "attention": sorted({r[name]["attention"] for r in runs})}
        if name == "ddtree-auto":  # the forms its rounds took, over every prompt
            table[name]["forms"] = dict(sum((collections.Counter(r[name]["forms"]) for r in runs),
                                            collections.Counter()).most_common())
        if args.check and name != "ar":
            firsts = [r[name]["first_divergence"] for r in runs if r[name]["first_divergence"] is not None]
            table[name].update({k: sum(r[name][k] for r in runs) for k in ("same_as_ar", "walk_mismatches",
                                                                             "traced_rounds")})
            table[name]["first_divergence"] = min(firsts, default=None)
            table[name]["traced_same_as_untraced"] = all(r[name]["traced_same_as_untraced"] for r in runs)
    for name, row in table.items():
        ar = table["ar"]["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / ar if ar and row["tokens_per_s"] else None
    out = {"date": now(), "command": command(), "device": jax.devices()[0].device_kind,
           "backend": jax.default_backend(), "target": target_path, "draft": draft_path, "dtype": args.dtype,
           "prompts": len(prompts), "batch": len(prompts) if args.batched else 1,
           "max_new_tokens": args.max_new_tokens, "attention": args.attention, "methods": table}
    extra = f" {'min':>4} {'same-as-ar':>10} {'diverges at':>11} {'walk mismatches':>15}" if args.check else ""
    print(f"{'method':<12} {'acceptance':>10} {'tok/s':>8} {'vs ar':>6}{extra}")
    for name, row in table.items():
        acc = "-" if row["mean_acceptance_length"] is None or name == "ar" else f"{row['mean_acceptance_length']:.2f}"
        line = f"{name:<12} {acc:>10} {row['tokens_per_s']:>8.1f} {row['speedup']:>5.2f}x"
        if args.check and name != "ar":
            div = "-" if row["first_divergence"] is None else str(row["first_divergence"])
            line += (f" {row['min_acceptance_length']:>4} {row['same_as_ar']:>4}/{len(prompts):<5} {div:>11} "
                     f"{row['walk_mismatches']:>6}/{row['traced_rounds']:<8}")
        print(line)
    if "ddtree-auto" in table:
        print("ddtree-auto's rounds: " + ", ".join(f"{f} x{n}" for f, n in table["ddtree-auto"]["forms"].items()))
    if args.json:
        write_json(args.json, out)
    return 0


def _auto_run(target, draft, prompts, args, stop, ar_tokens_per_s) -> dict:
    """``bench pair``'s ddtree under --tree-budget auto (the cost table of the cache directory, kept there): what
    training.evaluate.benchmark records of a fixed budget, and the forms the rounds took ({form: rounds})."""
    from ddtree_jax import accept, decode

    opts = decode.GenerateOptions(method="ddtree", tree_budget=decode.AUTO, max_new_tokens=args.max_new_tokens,
                                  stop_token_ids=stop, attention=args.attention, forms=args.forms or ())
    res = decode.generate(target, prompts, opts, draft=draft, persist_costs=True)
    acc = [a for seq in res.acceptance_lengths for a in seq]
    tps = sum(res.num_generated) / res.decode_s if res.decode_s > 0 else None
    row = {"mean_acceptance_length": statistics.fmean(acc) if acc else None,
           "min_acceptance_length": min(acc) if acc else None, "rounds": len(acc), "tokens_per_s": tps,
           "attention": res.attention,
           "forms": dict(collections.Counter(f for seq in res.round_forms for f in seq).most_common())}
    if tps and ar_tokens_per_s:
        row["speedup"] = tps / ar_tokens_per_s
    if args.check:  # as training.evaluate.benchmark's check: AR's tokens, and every traced round's walk replayed
        ar_ids = decode.generate(target, prompts, dataclasses.replace(opts, method="ar")).output_ids
        firsts = [next((i - len(p) for i, (x, y) in enumerate(zip(mine, theirs)) if i >= len(p) and x != y),
                       None if len(mine) == len(theirs) else min(len(mine), len(theirs)) - len(p))
                  for p, mine, theirs in zip(prompts, res.output_ids, ar_ids)]
        traced = decode.generate(target, prompts, dataclasses.replace(opts, trace=True), draft=draft,
                                 persist_costs=True)
        rounds = [r for seq in traced.rounds for r in seq]
        row.update(same_as_ar=sum(f is None for f in firsts), traced_rounds=len(rounds),
                   first_divergence=min((f for f in firsts if f is not None), default=None),
                   walk_mismatches=sum(accept.walk_host(r["tree"]["node_token_ids"], r["tree"]["parents"],
                                                        r["target_choices"]) != r["accepted_indices"] for r in rounds),
                   traced_same_as_untraced=traced.output_ids == res.output_ids)
    return row


def _load_records(path: str) -> list[dict]:
    records = projection.load_json(path, "the results file")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise cli.UsageError(f"{path} is not a JSON list of records (the output of `bench models`)")
    return records


def _project(args) -> int:
    """Print the projection tables (markdown) of ddtree_jax.projection for each model; --json writes the rows."""
    temps = projection.load_tau(args.tau)
    if args.temperature not in temps:
        raise cli.UsageError(f"--temperature {args.temperature} is not in {args.tau} (has {', '.join(temps)})")
    records = _load_records(args.results)
    out = []
    for model in args.models:
        if model not in temps[args.temperature]:
            raise cli.UsageError(f"{args.tau} has no {model} (has {', '.join(temps[args.temperature])})")
        costs = projection.round_costs(records, model, args.prompt, args.batch, args.budgets)
        rows = projection.project(temps[args.temperature][model], costs, args.budgets)
        print(projection.markdown(model, costs, rows, args.budgets) + "\n")
        out.append({"model": model, "temperature": args.temperature, "prompt_len": args.prompt, "batch": args.batch,
                    "round_ms": {k: r["ms_per_round"] for k, r in costs.items()},
                    "round_dates": {k: r["date"] for k, r in costs.items()}, "rows": rows})
    print(f"A projection, not a measurement: tau (the paper's, temperature {args.temperature}) x AR ms / round ms "
          f"from {args.results}; the paper's ddtree tau is at its best budget per dataset.")
    if args.json:
        write_json(args.json, out)
    return 0


def _table(args) -> int:
    """Print the grid table of each model, the breakdown table and the peer ratios (ddtree_jax.tables)."""
    records = _load_records(args.results)
    for model in args.models:
        print(tables.grid(records, model, args.prompts, args.batches, args.budgets) + "\n")
    print(tables.breakdown(records, args.models, args.prompts, args.batches, args.budgets))
    print("\nAgainst the official PyTorch code (qwen3-8b, prompt 512, batch 1): " + tables.peer(records))
    return 0


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ARGV[:] = argv
    if argv and argv[0] == "kernels":
        return _kernels(argv[1:])
    args = build_parser().parse_args(argv)
    if args.mode == "fixtures":
        return _fixtures(args)
    if args.mode == "pair":
        return _pair(args)
    if args.mode == "table":
        return _table(args)
    if args.mode == "project":
        return _project(args)
    return _models(args)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)
