"""The on-device loop of rounds, prefill, and the host API: methods ar, dflash and ddtree.

A round (draft, tree, verify, accept, commit) is ``round.py``'s. The loop runs rounds under ``lax.while_loop`` until
every sequence is done (or a round count is reached, so a host can stream every few rounds); no host synchronisation
inside. :func:`generate` runs it for a batch of prompts; under ``--tree-budget auto`` its groups of rounds and their
timing are ``autorun.py``'s, and the engine's slot batch (sequences entering and leaving rows of one State) is
``slots.py``'s. What a run is (its options and the static Spec of each program) is ``spec.py``'s, the weights' layout
``weight_layout.py``'s, and the reading of a finished run on the host ``results.py``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import accept, draft as dflash, model, policy
from ddtree_jax import cache as kvcache, sharding
from ddtree_jax.params import DraftParams, TargetParams
from ddtree_jax.results import (GenerateResult, fault_message, final_length, round_forms, round_statistics_problem,
                                trace_rounds)
from ddtree_jax.round import State, commit_round, hand_over, round_step
from ddtree_jax.spec import AUTO, MAX_STOP_IDS, NEVER, GenerateOptions, Spec, make_spec, round_up
from ddtree_jax.tuning import Tuning
from ddtree_jax.weight_layout import device_layout, layout_method
from pallas_kernels.bitmask import causal_bits

Array = jax.Array


# XLA options of every top-level compile of the round loop and prefill (``decode.compiled``, the engine's steps,
# the bench; jax takes compiler options on top-level jits only; the GPU ones are inert on CPU; they override
# XLA_FLAGS). Dynamic-slice fusion with cuBLAS GEMMs lets each GEMM read its layer's slice of the stacked weights
# in place, where XLA's Triton GEMMs copy it first (a Qwen3-8B ddtree-64 round: 9.5 against 17.2 ms). A dot-merger
# threshold of 0 stops XLA from concatenating each layer's gate+up and q/k/v weights into new buffers every round to
# merge their products. Concurrent command-buffer scheduling builds each CUDA graph from the data dependencies, so
# small independent kernels may overlap (a few percent). Measurements: docs/PERFORMANCE.md; ``bench models --ab``
# compiles with others.
XLA_OPTIONS = {
    "xla_gpu_enable_dynamic_slice_fusion": True,
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
}


# Every jit that donates a State keeps its unused arguments. jax pairs each donated buffer with the first output of its
# shape and dtype; when an argument the program never reads is pruned (prefill overwrites the lengths, bonus and n_out),
# the pairs shift and a pass-through output is given another leaf's buffer (prompt_len's value into n_rounds' buffer).
# XLA on an H200 miscompiled such a pairing: prefill with an input-major drafter returned n_rounds = prompt_len (a
# "decode fault", docs/CORRECTNESS.md). With every argument kept, each output takes its own input's buffer
# (tests/test_decode.py checks the pairs of the compiled programs).
donating_jit = functools.partial(jax.jit, keep_unused=True)


@functools.partial(donating_jit, static_argnums=(0,), donate_argnums=(3,))
@sharding.on_spec_mesh(batched=(3,))
def run_rounds(spec: Spec, target: TargetParams, drafter: DraftParams | None, state: State, max_rounds: Array):
    """Run rounds until every sequence is done or ``max_rounds`` more rounds have run. AR steps of a speculative run
    (tree "root" with a drafter) hand the drafter their tokens ``path_len`` steps at a time (:func:`_ar_steps`)."""

    def cond(carry):
        state, i = carry
        return jnp.any(~state.done) & (i < max_rounds)

    def body(carry):
        state, i = carry
        if spec.tree == "root" and spec.draft is not None:
            state, steps = _ar_steps(spec, target, drafter, state, max_rounds - i)
            return state, i + steps
        return round_step(spec, target, drafter, state), i + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state


def _ar_steps(spec: Spec, target: TargetParams, drafter: DraftParams, state: State, most: Array):
    """Up to R = ``spec.path_len`` AR steps (``spec.hand_over_rows`` if fewer; at most ``most``, while a sequence runs),
    then one :func:`hand_over` of their tokens' tap features, collected in a buffer [B, R, taps*D]: the drafter's input
    projection and K/V products read their weights once for up to R steps, not once a step, over B x R rows whatever
    the steps run. The same features at the same positions as a hand-over a step: the drafter's context stays
    complete. (state, steps run)."""
    b, rows = state.bonus.shape[0], spec.hand_over_rows or spec.path_len  # Spec.per_call caps it at path_len
    buffer = jnp.zeros((b, rows, spec.draft.num_taps * spec.target.hidden_size), state.dcache.k.dtype)

    def cond(carry):
        state, _, _, j = carry
        return jnp.any(~state.done) & (j < jnp.minimum(rows, most))

    def body(carry):  # a sequence's steps commit one token each until it is done: its rows are a prefix
        state, buffer, n, j = carry
        state, context, count = commit_round(spec, target, drafter, state)
        return state, jax.lax.dynamic_update_slice_in_dim(buffer, context.astype(buffer.dtype), j, 1), n + count, j + 1

    state, buffer, n, steps = jax.lax.while_loop(cond, body, (state, buffer, jnp.zeros((b,), jnp.int32), jnp.int32(0)))
    return hand_over(spec, drafter, state, buffer, n), steps


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Snapshot:
    """What the host reads after a group of rounds, per sequence [B]: one small device->host copy."""

    end: Array  # [B] final output length (cut at the limit and the first stop token)
    window: Array  # [B, W] out[start : start + W]
    done: Array  # [B] bool
    stopped: Array  # [B] bool: a stop token ended the sequence
    new_tokens: Array  # [B] tokens committed by the group's rounds
    new_rounds: Array  # [B] rounds the group ran for the sequence
    new_stats: Array | None  # (Spec.auto) [B, S] the growth of State.stats over the group


def device_final_length(state: State) -> Array:
    """:func:`final_length` on device: [B] int32."""
    cut = jnp.minimum(state.n_out, state.limit)
    return jnp.minimum(cut, jnp.where(state.stop_at < NEVER, state.stop_at + 1, state.n_out))


def group(spec: Spec, target, drafter, state: State, starts: Array, rounds: Array, most: int):
    """Up to ``rounds`` (int32, at most ``most``, static) rounds for the batch: the new state and a :class:`Snapshot`
    whose window holds each sequence's output from ``starts`` [B] (the first undelivered index) on. Traced, not
    jitted: :data:`run_group` jits it alone, ``slots.run_group_rows`` on some rows of a batch."""
    n_out0, rounds0, stats0 = state.n_out, state.n_rounds, state.stats
    spec = spec.per_call(most)
    state = run_rounds(spec, target, drafter, state, jnp.minimum(rounds, most))
    width = most * spec.commit_len + 1
    idx = jnp.minimum(starts[:, None] + jnp.arange(width)[None], state.out.shape[1] - 1)
    snap = Snapshot(
        end=device_final_length(state),
        window=jnp.take_along_axis(state.out, idx, axis=1),
        done=state.done,
        stopped=state.stop_at < NEVER,
        new_tokens=state.n_out - n_out0,
        new_rounds=state.n_rounds - rounds0,
        new_stats=None if stats0 is None else state.stats - stats0,
    )
    return state, snap


# A group of rounds and its Snapshot: the unit the engine and generate's auto loop dispatch (compiled with
# XLA_OPTIONS through ``compiled`` or ``.lower(...).compile(XLA_OPTIONS)``).
run_group = donating_jit(group, static_argnums=(0, 6), donate_argnums=(3,))


# ----------------------------------------------------------------------------------------- prefill


@functools.partial(donating_jit, static_argnums=(0,), donate_argnums=(3,))
@sharding.on_spec_mesh(batched=(3, 4))
def prefill(spec: Spec, target: TargetParams, drafter: DraftParams | None, state: State, tokens: Array) -> State:
    """Run the prompts [B, P_pad] (P_pad a multiple of the chunk) through the target chunk by chunk,
    fill both caches, and choose the first token. ``state`` comes from :func:`init_state`."""
    b, p_pad = tokens.shape
    chunk = min(spec.tuning.prefill_chunk, p_pad)
    lengths = state.prompt_len
    bits = causal_bits(b, chunk)

    def step(carry, c):
        cache, dcache, last = carry
        start = c * chunk
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        positions = start + jnp.broadcast_to(jnp.arange(chunk), (b, chunk))
        cache = dataclasses.replace(cache, length=jnp.full((b,), start, jnp.int32))
        hidden, cache, taps = model.forward(
            target, spec.target, toks, positions, cache, bits, taps=spec.taps, attention=spec.attention,
            tuning=spec.tuning,
        )
        if dcache is not None:
            dcache = dataclasses.replace(dcache, length=jnp.full((b,), start, jnp.int32))
            dcache = dflash.extend(drafter, spec.draft, dcache, taps, jnp.clip(lengths - start, 0, chunk))
        here = (lengths - 1 >= start) & (lengths - 1 < start + chunk)
        pick = jnp.take_along_axis(hidden, jnp.clip(lengths - 1 - start, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where(here[:, None], pick, last)
        return (cache, dcache, last), None

    last0 = jnp.zeros((b, spec.target.hidden_size), target.embed.dtype)
    (cache, dcache, last), _ = jax.lax.scan(step, (state.cache, state.dcache, last0), jnp.arange(p_pad // chunk))
    cache = dataclasses.replace(cache, length=lengths)
    if dcache is not None:
        dcache = dataclasses.replace(dcache, length=lengths)

    logits = model.logits(target, last)[:, None]
    keys = accept.node_keys(state.keys, (lengths - 1)[:, None])
    first = accept.choose(logits, keys, state.temperature, state.top_p, state.top_k, spec.sampling,
                          spec.filtering)[:, 0]
    out = state.out.at[:, :p_pad].set(tokens).at[jnp.arange(b), lengths].set(first)
    return dataclasses.replace(state, cache=cache, dcache=dcache, bonus=first, out=out, n_out=lengths + 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rows:
    """Each sequence's settings, host arrays [B]: what :func:`state_from` needs besides the shapes."""

    prompt_len: np.ndarray  # int32
    limit: np.ndarray  # int32: prompt_len + max_new_tokens
    stop_ids: np.ndarray  # [B, MAX_STOP_IDS] int32, -1 padded
    seeds: np.ndarray  # uint32
    temperature: np.ndarray  # float32 (0 = greedy)
    top_p: np.ndarray  # float32
    top_k: np.ndarray  # int32 (0 = off)


def row_settings(spec: Spec, prompt_lens, options_per_seq) -> Rows:
    """The settings of a batch's sequences (options_per_seq: a GenerateOptions each), checked against what the
    Spec's programs can do; ValueError otherwise."""
    stop = np.full((len(prompt_lens), MAX_STOP_IDS), -1, np.int32)
    for i, o in enumerate(options_per_seq):
        if o.temperature > 0 and not spec.sampling:
            raise ValueError(f"temperature {o.temperature} needs a sampling program (Spec.sampling; make_spec sets "
                             f"it from the options' temperature), this one is greedy-only")
        if o.temperature > 0 and accept.filters(o.top_p, o.top_k) and not spec.filtering:
            raise ValueError(f"top_p {o.top_p} / top_k {o.top_k} need a filtering program (Spec.filtering; make_spec "
                             f"sets it from the options), this one samples without a filter")
        if len(o.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids are supported, got {len(o.stop_token_ids)}")
        stop[i, : len(o.stop_token_ids)] = o.stop_token_ids
    lens = np.asarray(prompt_lens, np.int32)
    return Rows(prompt_len=lens, limit=lens + np.asarray([o.max_new_tokens for o in options_per_seq], np.int32),
                stop_ids=stop, seeds=np.asarray([o.seed for o in options_per_seq], np.uint32),
                temperature=np.asarray([o.temperature for o in options_per_seq], np.float32),
                top_p=np.asarray([o.top_p for o in options_per_seq], np.float32),
                top_k=np.asarray([o.top_k for o in options_per_seq], np.int32))


def state_from(spec: Spec, rows: Rows, capacity: int, out_len: int, dtype) -> State:
    """Empty caches of ``capacity`` tokens and an output buffer of ``out_len`` for the sequences of ``rows``;
    traceable (the engine jits it: one device call an admission, not one per leaf)."""
    b = rows.prompt_len.shape[0]
    tc = spec.target
    cache = kvcache.init(tc.num_layers, b, capacity, tc.num_kv_heads, tc.head_dim, dtype)
    dcache = None
    if spec.draft is not None:
        dc = spec.draft.layers
        dcache = kvcache.init(dc.num_layers, b, capacity, dc.num_kv_heads, dc.head_dim, dtype)
    prompt_len = jnp.asarray(rows.prompt_len, jnp.int32)
    trace = None
    if spec.trace:
        r, n = spec.max_rounds, spec.nodes_room
        trace = {
            "tokens": jnp.zeros((b, r, n), jnp.int32),
            "depths": jnp.zeros((b, r, n), jnp.int32),
            "parents": jnp.zeros((b, r, n + 1), jnp.int32),
            "path": jnp.zeros((b, r, spec.path_len), jnp.int32),
            "length": jnp.zeros((b, r), jnp.int32),
            "choice": jnp.zeros((b, r, n + 1), jnp.int32),
        }
    return State(
        cache=cache,
        dcache=dcache,
        bonus=jnp.zeros((b,), jnp.int32),
        out=jnp.zeros((b, out_len), jnp.int32),
        n_out=jnp.array(rows.prompt_len, jnp.int32, copy=True),  # its own buffer (also under jit, which would
        # return an input as both outputs): State leaves are donated
        prompt_len=prompt_len,
        limit=jnp.asarray(rows.limit, jnp.int32),
        stop_ids=jnp.asarray(rows.stop_ids, jnp.int32),
        stop_at=jnp.full((b,), NEVER, jnp.int32),
        done=jnp.zeros((b,), bool),
        keys=jax.vmap(jax.random.key)(jnp.asarray(rows.seeds, jnp.uint32)),
        temperature=jnp.asarray(rows.temperature, jnp.float32),
        top_p=jnp.asarray(rows.top_p, jnp.float32),
        top_k=jnp.asarray(rows.top_k, jnp.int32),
        n_rounds=jnp.zeros((b,), jnp.int32),
        accept_hist=jnp.zeros((b, spec.max_rounds), jnp.int32),
        trace=trace,
        forms=jnp.zeros((b, spec.max_rounds), jnp.int32) if spec.auto else None,
        stats=jnp.zeros((b, policy.width(spec.predict)), jnp.float32) if spec.auto else None,
    )


@functools.lru_cache(maxsize=32)
def fresh_state(spec: Spec, batch: int, capacity: int, out_len: int, dtype,
                mesh: jax.sharding.Mesh | None = None) -> Callable[[Rows], State]:
    """:func:`state_from` of ``batch`` rows at these sizes, jitted (born sharded on ``mesh``) once per shape: one
    device call for the whole state, where building it leaf by leaf took 12 ms of host time (the fixture pair, 2
    cores), and on a mesh no new trace and compilation per call."""

    def fresh(rows: Rows) -> State:
        return state_from(spec, rows, capacity, out_len, dtype)

    if mesh is None:
        return jax.jit(fresh)
    return sharding.born_sharded(fresh, mesh, row_settings(spec, [1] * batch, [GenerateOptions()] * batch))


def init_state(spec: Spec, prompt_lens, options_per_seq, capacity: int, out_len: int, dtype) -> State:
    """Empty caches and per-sequence settings for a batch (:func:`row_settings`, :func:`state_from`).
    options_per_seq: list of GenerateOptions."""
    return state_from(spec, row_settings(spec, prompt_lens, options_per_seq), capacity, out_len, dtype)


# ----------------------------------------------------------------------------------------- host API


def layout(spec: Spec, prompt_lens: list[int], max_new_tokens: int) -> tuple[int, int, int]:
    """(padded prompt length, cache capacity, output buffer length) for a batch. Capacity and output length are
    rounded up to multiples of 64, so prompts of nearby lengths share shapes (and compiled programs)."""
    longest = max(prompt_lens)
    chunk = min(spec.tuning.prefill_chunk, round_up(longest, 16))
    p_pad = round_up(longest, chunk)
    capacity = round_up(max(p_pad, longest + max_new_tokens + spec.scratch_slots), 64)
    return p_pad, capacity, round_up(max(p_pad, longest + max_new_tokens + spec.path_len + 1), 64)


_COMPILED: collections.OrderedDict = collections.OrderedDict()  # (fn, spec, abstract args) -> executable
_COMPILED_MAX = 32


def compiled(fn, spec: Spec, *args):
    """``fn.lower(spec, *args).compile(XLA_OPTIONS)``, kept for later calls with the same spec and the same
    shapes, dtypes and shardings (what ``jax.jit`` keys on): ahead-of-time compilation is never cached by jax
    itself, and a caller that decodes many times at one shape (evaluations while training, a benchmark's prompts one at a
    time) would otherwise compile every call. Least recently used beyond ``_COMPILED_MAX`` are dropped."""
    leaves, treedef = jax.tree.flatten(args)
    key = (fn, spec, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x
                                    for x in leaves))  # static arguments (ints) by value
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    exe = _COMPILED[key] = fn.lower(spec, *args).compile(XLA_OPTIONS)
    if len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return exe


def start(spec: Spec, prompts: list[list[int]], per_row: list[GenerateOptions], max_new_tokens: int, dtype,
          mesh: jax.sharding.Mesh | None = None) -> tuple[State, Array]:
    """A batch laid out (:func:`layout`) for :func:`prefill` and :func:`run_rounds` under ``spec``: (the initial
    State, the padded prompt tokens [B, P] int32), each row with its own options (seed, sampling, max_new_tokens up
    to ``max_new_tokens``); on ``mesh``, placed there (the batch a multiple of its data axis:
    ``sharding.padded_batch``). The spec is not fitted to the batch (prefill cuts its chunk to P itself), so prompts
    whose buffers round to the same sizes share the compiled round loop whatever their padded lengths."""
    lens = [len(p) for p in prompts]
    p_pad, capacity, out_len = layout(spec, lens, max_new_tokens)
    tokens = np.zeros((len(prompts), p_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    state = fresh_state(spec, len(prompts), capacity, out_len, dtype, mesh)(row_settings(spec, lens, per_row))
    tokens = jnp.asarray(tokens) if mesh is None else jax.device_put(tokens, sharding.batch_sharding(mesh, 2))
    return state, tokens


def generate(
    target,
    prompts: list[list[int]],
    options: GenerateOptions,
    *,
    draft=None,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    stream_every: int = 4,
    proposer: Callable | None = None,
    mesh: jax.sharding.Mesh | None = None,
    tuning: Tuning = Tuning(),
    persist_costs: bool = False,
    chooser: policy.Policy | None = None,
) -> GenerateResult:
    """Generate for a batch of prompts. target: (ModelConfig, TargetParams); draft: (DraftConfig, DraftParams).

    on_tokens, when given, is called every ``stream_every`` rounds with the tokens each sequence gained, from the
    host's thread while a worker thread runs the next rounds (``autorun.stream``; under auto, ``autorun.AutoRun``).
    proposer, when given, replaces ``draft.propose`` (same signature): a research hook for other drafters.
    mesh, when given (``sharding.make_mesh``), runs tensor/data parallel: the weights are placed on it (KV
    heads repeated when the model axis exceeds them) and the batch is padded to a multiple of its data axis.
    tuning: how the decode runs on the device (its layout applied to the weights here; ``ddtree_jax.tuning``).

    ``options.tree_budget="auto"`` (dflash, ddtree): groups of rounds (``autorun.GROUP_ROUNDS``, doubling while
    speculative forms follow one another up to ``autorun.MAX_GROUP_ROUNDS``, or ``stream_every`` when streaming;
    the first ``autorun.FIRST_GROUP``, read before the second is chosen), each of the form a :class:`policy.Policy`
    (``chooser``, default a new one) picks from the statistics of the groups read so far, weighed against each
    program's seconds per round (timed here unless known; with ``persist_costs`` read from and kept in the cache
    directory's cost table, ``autorun.cost_table_for``). One worker thread runs the groups in order while the host
    reads group g - 1 and chooses group g + 1, so that after the second group the device does not wait for the
    host's choice (:class:`autorun.AutoRun`).

    A decode fault (round statistics no correct program gives: ``round_statistics_problem``) raises RuntimeError.
    """
    if mesh is not None:
        target = sharding.shard_model(target, mesh)
        draft = sharding.shard_model(draft, mesh) if draft is not None and options.method != "ar" else draft
    tcfg, tparams = target
    dcfg, dparams = draft if draft is not None else (None, None)
    auto = options.tree_budget == AUTO and options.method != "ar"
    tparams = device_layout(tparams, layout=tuning.layout, method=layout_method(options))
    dparams = device_layout(dparams, layout=tuning.layout)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if options.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < tcfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary (size {tcfg.vocab_size})")
    rows = prompts + [prompts[0][:1]] * (sharding.padded_batch(len(prompts), mesh) - len(prompts))  # + dummies
    spec = make_spec(tcfg, dcfg, options, tuning, proposer=proposer, mesh=mesh, batch=len(rows))
    if spec.method == "ar":
        dparams = None
    lens = [len(p) for p in rows]
    per_row = [dataclasses.replace(options, seed=options.seed + i) for i in range(len(prompts))]  # row i: seed + i
    per_row += [dataclasses.replace(options, max_new_tokens=1)] * (len(rows) - len(prompts))
    state, tokens = start(spec, rows, per_row, options.max_new_tokens, tparams.embed.dtype, mesh)

    t0 = time.perf_counter()  # compile ahead of time so that the timings below are execution only
    prefill_fn = compiled(prefill, spec, tparams, dparams, state, tokens)
    if auto or on_tokens is not None:
        from ddtree_jax import autorun  # here: autorun builds on this module (its State, programs and run_group)
    if auto:
        def fresh():
            return start(spec, rows, per_row, options.max_new_tokens, tparams.embed.dtype, mesh)[0]

        table = autorun.cost_table_for(spec, tparams.embed.dtype, persist=persist_costs)
        base, largest = (stream_every, stream_every) if on_tokens else (autorun.GROUP_ROUNDS, autorun.MAX_GROUP_ROUNDS)
        run = autorun.AutoRun(spec, options, tparams, dparams, fresh, len(prompts), base, table, chooser, largest)
    elif on_tokens is not None:
        starts = jax.ShapeDtypeStruct((len(rows),), jnp.int32)
        group_fn = compiled(run_group, spec, tparams, dparams, state, starts, jnp.int32(0), stream_every)
    else:
        all_rounds = jnp.int32(options.max_new_tokens + 1)  # one call: every round commits a token
        rounds_fn = compiled(run_rounds, spec, tparams, dparams, state, all_rounds)
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    state = prefill_fn(tparams, dparams, state, tokens)
    jax.block_until_ready(state.bonus)
    prefill_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    if auto:
        state = run.decode(state, lens, on_tokens)
    elif on_tokens is not None:  # groups run by a worker thread while the host delivers the last one's tokens
        chain = autorun.Chain(tparams, dparams, state, jnp.asarray(lens, jnp.int32))
        state = autorun.stream(spec, group_fn, chain, stream_every, len(prompts), on_tokens)
    else:
        state = rounds_fn(tparams, dparams, state, all_rounds)
        if not bool(jnp.all(state.done)):
            raise RuntimeError(fault_message(spec, f"unfinished after {spec.max_rounds} rounds"))
    jax.block_until_ready(state.out)
    decode_s = time.perf_counter() - t0 - (run.measure_s if auto else 0.0)  # warming and timing forms count as compiling

    ends = final_length(state)
    out = np.asarray(state.out)
    hist = np.asarray(state.accept_hist)
    n_rounds = np.asarray(state.n_rounds)
    problem = round_statistics_problem(spec, n_rounds[: len(prompts)], hist[: len(prompts)])
    if problem:
        raise RuntimeError(fault_message(spec, problem))
    return GenerateResult(
        output_ids=[out[i, : ends[i]].tolist() for i in range(len(prompts))],
        num_generated=[int(ends[i] - lens[i]) for i in range(len(prompts))],
        acceptance_lengths=[[] if spec.method == "ar" else hist[i, : n_rounds[i]].tolist() for i in range(len(prompts))],
        rounds=[trace_rounds(spec, state, i) for i in range(len(prompts))] if spec.trace else None,
        prefill_s=prefill_s,
        decode_s=decode_s,
        compile_s=compile_s + (run.measure_s if auto else 0.0),
        attention=spec.attention,
        round_forms=[round_forms(spec, state, i) for i in range(len(prompts))] if auto else None,
        form_costs_ms=run.form_costs_ms() if auto else None,
        groups=run.groups if auto else None,
    )
