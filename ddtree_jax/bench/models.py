"""``bench models``: random-weight models of real shapes (ddtree_jax.shapes) built on the device; for each prompt
length and batch, AR and dflash / ddtree rounds timed (N rounds in one run_rounds call), each with a stage breakdown
(draft, tree, verify, accept+commit: every stage its own compiled function on the same state), its ratio to an AR
step and its roofline (ddtree_jax.bench.roofline). Extras on the first configuration: HLO checks, XLA option A/Bs,
N rounds in one call vs N calls, a profiler trace summary, the tree-build micro-benchmarks. The records and a
details file are written after every item, so a run cut short keeps what it measured."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import os
import platform
import statistics
import time
from typing import Any, Callable

from ddtree_jax import cli
from ddtree_jax.bench import roofline, tree_micro
from ddtree_jax.bench.analysis import hlo_summary, profile_summary, weight_shape_strings
from ddtree_jax.bench.records import command, fmt_breakdown, log, now, print_table, write_json
from ddtree_jax.bench.roofline import nbytes
from ddtree_jax.bench.timing import J, Timer, aot, make_spec, make_state, reset, sync
from ddtree_jax.shapes import SHAPES, Shape, build_params, model_configs

PEER = {  # the official PyTorch DDTree code on the same H200, Qwen3-8B shapes, prompt 512, random weights
    "ar_ms": 78.5,
    "ddtree_ms_range": [102.0, 114.0],  # budgets 32..128
    "ddtree_budgets": [32, 128],
    "host_tree_build_ms_range": [0.7, 1.2],
}
TARGETS = {"ar_over_roofline": 1.15, "ddtree64_over_ar": 1.25, "ddtree256_over_ar": 1.5, "tree_build_256_us": 50.0}


class Bench:
    """One ``bench models`` run: its arguments, the records and details written as it goes, the time left, and per
    model the grid of configurations."""

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

    def keep(self, section: str, name: str, value) -> None:
        """details[section][name] = value, written at once (a later timeout keeps it)."""
        self.details.setdefault(section, {})[name] = value
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
        from ddtree_jax.weight_layout import DRAFT_GPU_LAYOUT, GPU_AR_LAYOUT, GPU_LAYOUT, device_layout

        # (the random weights are built stacked and input-major); without --layout (or --tuning layout=), the target
        # as decode lays it out for each method: the rounds' layout, and AR's (a second copy, made only if AR is timed)
        forced = args.tuning.layout if args.tuning.layout != "auto" else None
        args.layout = args.layout or forced
        args.draft_layout = args.draft_layout or forced or DRAFT_GPU_LAYOUT
        self.layouts = {m: args.layout or (GPU_AR_LAYOUT if m == "ar" else GPU_LAYOUT)
                        for m in ("ar", "dflash", "ddtree")}
        tp_ar = (device_layout(tp, layout=self.layouts["ar"])
                 if "ar" in args.methods and self.layouts["ar"] != self.layouts["ddtree"] else None)
        tp, dp = sync((device_layout(tp, layout=self.layouts["ddtree"]),
                        device_layout(dp, layout=args.draft_layout)))
        tp_ar = sync(tp_ar) if tp_ar is not None else tp
        info = {"layout": self.layouts["ddtree"], "ar_layout": self.layouts["ar"], "draft_layout": args.draft_layout,
            "build_s": time.time() - t0, "target_bytes": nbytes(tp), "draft_bytes": nbytes(dp),
            "target_layer_bytes": nbytes(tp.layers), "lm_head_bytes": nbytes(tp.lm_head),
            "embed_bytes": nbytes(tp.embed),
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
                self.item(f"{shape.name} tree micro", tree_micro.tree_build, shape, dcfg,
                          [1, 8] if 8 in args.batches else [1], args.tree_budgets, args.tree_iters,
                          functools.partial(self.keep, "tree_micro", shape.name))
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
        kv_bytes = roofline.kv_bytes(tcfg, batch, prompt_len, self.dtype)
        w_bytes = roofline.step_weight_bytes(c["tp"], batch, routed)
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
            floor = roofline.round_floor(spec, tcfg, dcfg, c["tp"], dp, batch, prompt_len, self.dtype, ceil, routed)
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
        log(f"  -> {ms:.3f} ms/round"
            + (f", breakdown {fmt_breakdown(rec.get('breakdown_ms'))}" if args.breakdown else "")
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
        f_acc, cs["accept_commit"] = aot(J("stage_accept"), spec, dp, state, tree, outs)

        def accept_step(st):
            st = f_acc(dp, st, tree, outs)
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


def run(args) -> int:
    """``bench models``: the defaults of the grid (--quick: a tiny one), the ceilings, then every model."""
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
    bench.details["ceilings"] = bench.item("ceilings", roofline.measure_ceilings, args.quick) or {}
    log(f"ceilings: {bench.details['ceilings']}")
    for m in args.models:
        bench.item(f"model {m}", bench.run_model, SHAPES[m])
    bench.details["meta"]["total_s"] = time.time() - bench.t_start
    bench.flush()
    moe = ["distinct_experts"] if any("distinct_experts" in r for r in bench.records) else []
    print_table(bench.records, ["model", "method", "budget", "batch", "prompt_len", "ms_per_round", "roofline_ms",
                                 "ratio_to_roofline", "ratio_to_ar", "floor_ms", *moe], breakdown=True)
    return 0
