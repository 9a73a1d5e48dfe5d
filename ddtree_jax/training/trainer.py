"""The training loop: AdamW on f32 master weights, the objective in bf16, data parallel over a mesh, orbax
checkpoints, a learning-rate schedule that ends where a time-boxed run does, evaluations as it goes.

    step       one jitted update (``jax.jit`` with NamedShardings on a ``data`` mesh axis: the rows of a batch split
               over the devices, the drafter and the frozen target replicated; XLA adds the gradients' all-reduce)
    schedule   linear warmup, then cosine to 0 at ``total`` steps; with a deadline, ``total`` is planned from the
               measured step time (again after each evaluation), so the decay ends where the time does
    state      ``out``/ckpt: orbax checkpoints of {params, opt_state} (the last two), restorable on any machine and
               mesh; a run without one starts from exported drafter weights (``init``: a warm start with a fresh
               optimiser; a shallower drafter grows, ``grow``) or at random
    record     ``out``/history.jsonl: one JSON line per log interval (loss, accuracy per slot, the chain's expected
               acceptance, learning rate, tokens/s) and per evaluation; a tqdm bar on stderr
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from ddtree_jax import params as params_lib
from ddtree_jax.training import objective
from ddtree_jax.training.dataset import Rows, batch_indices


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000  # the schedule's length (the most steps, with a deadline)
    batch: int = 16  # rows per step (a multiple of the mesh's data axis)
    objective: objective.Objective = objective.Objective()
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    compute_dtype: str = "bfloat16"
    seed: int = 0
    target_attention: str = "xla"  # the target's forward over the rows (model.attention_fn): "pallas" on one GPU


def learning_rate(tc: TrainConfig, step: int, total: int) -> float:
    """Linear warmup over ``tc.warmup`` steps, then cosine from ``tc.lr`` to 0 at ``total``."""
    warm = min(1.0, (step + 1) / max(1, tc.warmup))
    progress = min(1.0, max(0, step - tc.warmup) / max(1, total - tc.warmup))
    return tc.lr * warm * 0.5 * (1.0 + math.cos(math.pi * progress))


def init_params(dcfg, key) -> params_lib.DraftParams:
    """Random drafter params (f32): matrices N(0, 0.02^2), every norm scale exactly 1."""
    p = params_lib.init_random(params_lib.draft_shapes(dcfg, jnp.float32), key)
    leaves, treedef = jax.tree.flatten_with_path(p)
    return jax.tree.unflatten(treedef, [jnp.ones_like(x) if getattr(path[-1], "name", "") in params_lib.NORMS else x
                                        for path, x in leaves])


def grow(init: params_lib.DraftParams, fresh: params_lib.DraftParams) -> params_lib.DraftParams:
    """A deeper drafter that computes what ``init`` does: ``init``'s layers, then ``fresh``'s last layers (a random
    drafter of the deeper config) with their attention output and MLP down projections zero, so each added layer
    starts as the identity on the residual stream and training moves it from there. Every other weight is ``init``'s."""
    have = init.layers.wq.shape[0]
    if fresh.layers.wq.shape[0] < have:
        raise ValueError(f"cannot grow a {have}-layer drafter to {fresh.layers.wq.shape[0]} layers")

    def stack(path, old, new):
        added = new[have:]
        if path[-1].name in ("wo", "w_down"):
            added = jnp.zeros_like(added)
        return jnp.concatenate([jnp.asarray(old, new.dtype), added])

    layers = jax.tree.map_with_path(stack, init.layers, fresh.layers)
    return dataclasses.replace(fresh, fc=jnp.asarray(init.fc, fresh.fc.dtype), layers=layers,
                               hidden_norm=jnp.asarray(init.hidden_norm, fresh.hidden_norm.dtype),
                               final_norm=jnp.asarray(init.final_norm, fresh.final_norm.dtype))


def _deepened(shallow, dcfg) -> bool:
    """Whether drafter config ``dcfg`` is ``shallow`` with more layers (every other field equal)."""
    n = dcfg.layers.num_layers
    return (shallow.layers.num_layers < n and dataclasses.replace(
        shallow, layers=dataclasses.replace(shallow.layers, num_layers=n), layer_types=dcfg.layer_types) == dcfg)


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW's direction (clipped gradients, decoupled weight decay); the step scales it by the learning rate."""
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.scale_by_adam(),
                       optax.add_decayed_weights(tc.weight_decay))


class Trainer:
    """One drafter's training state and its compiled step. ``target``: (ModelConfig, TargetParams), frozen; ``mesh``:
    a mesh whose ``data`` axis splits each batch's rows (None: one device)."""

    def __init__(self, target, dcfg, raw_config: dict, tc: TrainConfig, out: str, mesh=None):
        if any(t != "full_attention" for t in dcfg.layer_types):
            raise ValueError("training supports full-attention drafter layers only")
        self.target, self.dcfg, self.raw, self.tc, self.out, self.mesh = target, dcfg, raw_config, tc, out, mesh
        self.tx = optimizer(tc)
        self.replicated = None if mesh is None else NamedSharding(mesh, P())
        self.rows = None if mesh is None else NamedSharding(mesh, P("data"))
        if mesh is not None and tc.batch % mesh.shape["data"]:
            raise ValueError(f"batch {tc.batch} is not a multiple of the mesh's data axis ({mesh.shape['data']})")
        self.tparams = self._place(target[1])
        shape_only = dataclasses.replace(tc, steps=0, batch=0, lr=0.0, warmup=0, seed=0)  # what the program reads
        self.step_fn, self.eval_fn = _compiled_fns(dcfg, target[0], shape_only, mesh)
        self.params = self.opt_state = self.compiled = None  # compiled: (row length, step, loss) compiled ahead
        self.step = 0
        self.history: list[dict] = []

    def _place(self, tree):
        return tree if self.mesh is None else jax.device_put(tree, self.replicated)

    def batch(self, rows: Rows) -> objective.Batch:
        b = objective.Batch(jnp.asarray(rows.tokens), jnp.asarray(rows.positions), jnp.asarray(rows.supervised))
        return b if self.mesh is None else jax.device_put(b, self.rows)

    def compile(self, seq_len: int) -> float:
        """Compile the step and the held-out loss for batches of ``seq_len``-token rows ahead of time (safe in a
        background thread while the data is made); returns the seconds it took."""
        t0 = time.perf_counter()
        shapes = jax.eval_shape(lambda: init_params(self.dcfg, jax.random.key(0)))
        opt = jax.eval_shape(self.tx.init, shapes)
        rows = lambda dt: jax.ShapeDtypeStruct((self.tc.batch, seq_len), dt, sharding=self.rows)  # noqa: E731
        placed = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=self.replicated)  # noqa: E731
        rep = functools.partial(jax.tree.map, placed)
        batch = objective.Batch(rows(jnp.int32), rows(jnp.int32), rows(jnp.bool_))
        key = jax.random.key(0)
        step = self.step_fn.lower(rep(shapes), rep(opt), self.tparams, batch, key, jnp.float32(0)).compile()
        loss = self.eval_fn.lower(rep(shapes), self.tparams, batch, key).compile()
        self.compiled = (seq_len, step, loss)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ state
    def start(self, init: tuple | None = None, log: Callable[[str], object] = print) -> str:
        """Resume from ``out``/ckpt if it holds a checkpoint, else start from ``init`` (DraftConfig, DraftParams:
        exported weights, a fresh optimiser; a drafter like the one trained but shallower grows into it, ``grow``) or
        at random. Returns how it started."""
        self.params = self._place(init_params(self.dcfg, jax.random.key(self.tc.seed)))
        self.opt_state = self._place(self.tx.init(self.params))
        self.ckpts = _Checkpoints(os.path.join(self.out, "ckpt"))
        latest = self.ckpts.latest()
        hist = os.path.join(self.out, "history.jsonl")
        if latest is not None:
            state = self.ckpts.restore(latest, {"params": self.params, "opt_state": self.opt_state})
            self.params, self.opt_state, self.step = state["params"], state["opt_state"], int(latest)
            if os.path.exists(hist):
                with open(hist) as f:
                    self.history = [h for h in map(json.loads, f) if h.get("step", 0) <= latest]
            how = f"resumed from step {latest}"
        elif init is not None:
            warm = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), init[1])
            if _deepened(init[0], self.dcfg):
                self.params = self._place(grow(warm, self.params))
                how = (f"warm start from exported weights, grown from {init[0].layers.num_layers} to "
                       f"{self.dcfg.layers.num_layers} layers")
            elif init[0] != self.dcfg:
                raise ValueError("the warm-start drafter's config differs from the one being trained")
            else:
                self.params = self._place(warm)
                how = "warm start from exported weights"
        else:
            how = "random initialisation"
        with open(hist, "w") as f:  # the history of the state being continued, nothing past it
            f.writelines(json.dumps(h) + "\n" for h in self.history)
        log(how)
        return how

    def save(self) -> None:
        self.ckpts.save(self.step, {"params": self.params, "opt_state": self.opt_state})

    def record(self, entry: dict) -> None:
        self.history.append(entry)
        with open(os.path.join(self.out, "history.jsonl"), "a") as f:
            f.write(json.dumps(entry) + "\n")

    # ------------------------------------------------------------------ the loop
    def fit(self, rows: Rows, held: Rows | None = None, *, deadline: float | None = None, evals: int = 4,
            evaluate: Callable[[Any], dict] | None = None, should_stop: Callable[[], bool] = lambda: False,
            save_every: int = 500, log_every: int = 10, eval_guess: float = 60.0,
            log: Callable[[str], object] = print) -> dict:
        """Train from ``self.step`` to the planned total (``tc.steps``, fewer if ``deadline``, a perf_counter time,
        comes first), log every ``log_every`` steps, evaluate ``evals`` times evenly and at the end
        (``evaluate(params)`` -> dict of figures, and the held-out rows' loss), checkpoint every ``save_every`` steps
        and at the end, stop early when ``should_stop()``. With a deadline, the evaluations still to come are
        reserved time as the last one took (``eval_guess`` seconds each before the first). Returns the run's
        figures."""
        import tqdm

        tc = self.tc
        key = jax.random.key(tc.seed + 1)
        total, first = tc.steps, self.step
        sec_per_step, eval_s, t_run = None, 0.0, time.perf_counter()
        held_batch = None if held is None or len(held) == 0 else self.batch(
            held.take(np.resize(np.arange(len(held)), tc.batch)))
        pending: list = []  # (lr, loss, metrics) on the device, read at each log
        next_eval = self._eval_points(first, total, evals, log_every)
        bar = tqdm.tqdm(total=total, initial=self.step, desc="train drafter", file=sys.stderr, dynamic_ncols=True)
        t_log, stopped = time.perf_counter(), "steps"
        while self.step < total:
            if should_stop():
                stopped = "signal"
                break
            lr = learning_rate(tc, self.step, total)
            batch = self.batch(rows.take(batch_indices(len(rows), tc.batch, self.step, tc.seed)))
            self.params, self.opt_state, loss, m = self._run_step(batch, jax.random.fold_in(key, self.step), lr)
            pending.append((lr, loss, m))
            self.step += 1
            bar.update(1)
            if self.step % log_every and self.step < total:
                if deadline is not None and time.perf_counter() > deadline:
                    stopped = "deadline"
                    break
                continue
            entry = self._log_entry(pending, rows, time.perf_counter() - t_log)
            pending = []
            self.record(entry)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", tau=f"{entry['chain_tau']:.2f}")
            timed = sec_per_step is not None
            if self.step - first >= 2 * log_every:  # compilation and warm-up behind
                sec_per_step = entry["elapsed_s"] / entry["steps"]
            due = bool(next_eval) and self.step >= next_eval[0]
            # plan once the step is timed (a resumed run's log steps need not fall 2 * log_every after its first)
            if deadline is not None and sec_per_step and (not timed or due):
                left = len([s for s in next_eval if s > self.step]) + 1 + due  # the final evaluation too
                total = self._plan(deadline, sec_per_step, (eval_s or (eval_guess if evaluate else 1.0)) * left)
                bar.total = total
                next_eval = self._eval_points(first, total, evals, log_every)
            next_eval = [s for s in next_eval if s > self.step]
            if due and self.step < total:
                eval_s = self._evaluate(evaluate, held_batch, key, log)
            if self.step % save_every < log_every:
                self.save()
            t_log = time.perf_counter()
            if deadline is not None and t_log > deadline:
                stopped = "deadline"
                break
        bar.close()
        if pending:
            self.record(self._log_entry(pending, rows, time.perf_counter() - t_log))
        self.save()
        trained = self.step > first or not self.history
        final = self._evaluate(evaluate, held_batch, key, log) if trained and stopped != "signal" else 0.0
        return {"steps": self.step, "planned_steps": total, "stopped_by": stopped,
                "train_s": round(time.perf_counter() - t_run, 1), "sec_per_step": sec_per_step,
                "final_eval_s": round(final, 1)}

    def _run_step(self, batch, key, lr):
        args = (self.params, self.opt_state, self.tparams, batch, key, jnp.float32(lr))
        return self._ahead(1, self.step_fn, batch)(*args)

    def _ahead(self, which: int, fn, batch):
        """The program compiled ahead (``which``: 1 the step, 2 the loss) if it fits ``batch``, else ``fn``."""
        fits = self.compiled is not None and self.compiled[0] == batch.tokens.shape[1]
        return self.compiled[which] if fits else fn

    @staticmethod
    def _eval_points(first: int, total: int, evals: int, every: int) -> list[int]:
        """The steps of ``evals`` - 1 evaluations spread over this run's steps ``first``..``total`` (the last one is at
        the end), at log steps after ``first``: a resumed run evaluates, and so re-plans, as it goes."""
        lo = (first // every + 1) * every
        return sorted({max(lo, round((first + (total - first) * k / evals) / every) * every)
                       for k in range(1, evals)} - {total})

    def _plan(self, deadline: float, sec_per_step: float, reserve: float) -> int:
        """The steps that fit before ``deadline`` with ``reserve`` seconds left (for the evaluations still to come)."""
        left = deadline - time.perf_counter() - reserve
        return int(min(self.tc.steps, max(self.step + 1, self.step + left / sec_per_step)))

    def _log_entry(self, pending, rows: Rows, elapsed: float) -> dict:
        got, steps = jax.device_get(pending), len(pending)
        hits = np.sum([m["hits"] for *_, m in got], axis=0)
        counts = np.maximum(np.sum([m["counts"] for *_, m in got], axis=0), 1)
        labels = float(np.sum([m["labels"] for *_, m in got]))
        return {"step": self.step, "loss": float(np.mean([loss for _, loss, _ in got])),
                "chain_tau": float(np.mean([m["chain_tau"] for *_, m in got])),
                "acc": [round(float(a), 4) for a in hits / counts], "lr": got[-1][0], "steps": steps,
                "elapsed_s": round(elapsed, 3), "row_tokens_per_s": round(steps * self.tc.batch * rows.tokens.shape[1]
                                                                         / max(elapsed, 1e-9)),
                "labels_per_s": round(labels / max(elapsed, 1e-9))}

    def _evaluate(self, evaluate, held_batch, key, log) -> float:
        t0 = time.perf_counter()
        entry: dict = {"step": self.step}
        if held_batch is not None:
            loss_fn = self._ahead(2, self.eval_fn, held_batch)
            loss, m = jax.device_get(loss_fn(self.params, self.tparams, held_batch, key))
            entry.update(held_out_loss=float(loss), held_out_chain_tau=float(m["chain_tau"]))
        if evaluate is not None:
            entry["eval"] = evaluate(self.params)
        if len(entry) > 1:
            entry["eval_s"] = round(time.perf_counter() - t0, 1)
            self.record(entry)
            log(f"step {self.step}: " + json.dumps({k: v for k, v in entry.items() if k != "step"}))
        return time.perf_counter() - t0


@functools.lru_cache(maxsize=8)
def _compiled_fns(dcfg, target_cfg, tc: TrainConfig, mesh):
    """(the jitted step, the jitted loss) of a configuration, shared by every Trainer of it in a process."""
    tx = optimizer(tc)

    def loss(params, tparams, batch, key):
        compute = jax.tree.map(lambda x: x.astype(tc.compute_dtype), params)
        return objective.loss_terms(compute, dcfg, (target_cfg, tparams), batch, key, tc.objective,
                                    tc.target_attention)

    def step(params, opt_state, tparams, batch, key, lr):
        (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, tparams, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, value, metrics

    out = None if mesh is None else NamedSharding(mesh, P())  # the drafter and the figures replicated
    return jax.jit(step, donate_argnums=(0, 1), out_shardings=out), jax.jit(loss, out_shardings=out)


class _Checkpoints:
    """Orbax checkpoints of {params, opt_state} under ``path``, the last two kept."""

    def __init__(self, path: str):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.mgr = ocp.CheckpointManager(os.path.abspath(path), options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def latest(self) -> int | None:
        return self.mgr.latest_step()

    def save(self, step: int, state) -> None:
        if self.mgr.latest_step() != step:
            self.mgr.save(step, args=self.ocp.args.StandardSave(state))
            self.mgr.wait_until_finished()

    def restore(self, step: int, like):
        return self.mgr.restore(step, args=self.ocp.args.StandardRestore(like))
