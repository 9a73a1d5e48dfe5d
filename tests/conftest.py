"""Shared fixtures: the tiny reference pair (Qwen3 target + DFlash drafter) and the Llama target, in f32."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No LLVM optimisation of the compiled programs (XLA's own HLO passes all run): compiling is most of the suite's time
# on CPU and this halves it, and skipping LLVM's expensive passes too saves another 12% of test_auto.py and
# test_decode.py (2026-12-07, 2 CPU cores); the programs compute the same values. Subprocesses (servers, the CLI)
# inherit it; those on fake devices take FAST_COMPILE with their device count.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FAST_COMPILE).strip()

import numpy as np
import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ddtree_reference")
CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
MODEL_DIRS = ("gguf", "models")  # what the run's $DDTREE_JAX_CACHE links from the user's (gguf_model's cache layout)


def pytest_configure(config):
    """One persistent JAX compilation cache per run, in a fresh temporary directory that the run removes at its end.

    Compilation is most of the suite's time on CPU, and the two xdist workers, the servers and CLI runs they start as
    subprocesses, and tests that empty jax's in-memory caches (the simulated faults) compile many of the same programs
    (the fixture pair's prefill and rounds at the reference prompts' shapes): each is compiled once per run, then read
    back. The key is a hash of the program, its compile options and XLA_FLAGS, so a program traced with a simulated
    fault or on 8 fake devices never serves another. Nothing outlives the run: no compiled program of an earlier
    checkout can mask a change. The xdist controller (or a run without xdist) makes the directory; the workers and
    every subprocess inherit it through the environment."""
    if hasattr(config, "workerinput"):
        skip_cache_eviction()  # the environment above is the controller's, inherited
        return
    config._jit_cache = tempfile.mkdtemp(prefix="ddtree_jax_test_jit_")
    os.environ[CACHE_ENV] = config._jit_cache
    # every program that takes a noticeable time to compile (the default, 1 s, leaves out most of the tiny pair's)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
    # a size bound turns on jax's file lock, so that a worker never reads an entry another is still writing
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
    skip_cache_eviction()
    if "jax" in sys.modules:  # imported before this hook ran (a plugin): the environment alone comes too late
        import jax

        jax.config.update("jax_compilation_cache_dir", config._jit_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
        jax.config.update("jax_compilation_cache_max_size", 8 << 30)
    config._cache = session_cache()


# Test modules, longest first (seconds on one of two busy xdist workers, 2026-12-02, after the suite-speed-2 branch's
# cuts): xdist hands whole modules (--dist loadfile) to whichever worker asks next, in collection order
# (--no-loadscope-reorder keeps it; xdist's own order is by test count), so the long ones start at once and the short
# ones fill the end, instead of the 8-device sharding subprocess or the sampling test (one test: it cannot be split)
# starting last on one worker while the other idles. Modules not listed run after these, in file order.
# test_engine.py starts first, in a fresh worker: after about half of the suite in one worker, the background
# compilation of the top-p programs in test_forms_and_slot_batches_run_only_the_live_slots crashed the worker (a
# segmentation fault or an abort inside XLA's compilation or jax's cache write of the program; 3 of 7 full runs on 2
# cores, 2026-12-07, jaxlib 0.11.2), and xdist then stalled until CI's limit. The module alone, and that test alone,
# never crashed (4 runs). Reproduced in the old order under glibc's MALLOC_CHECK_=3, which found no heap damage before
# it; the core dump shows the fault inside libgcc's unwinder called from jaxlib's serialize (a C++ exception or stack
# trace being unwound there); the cause is not found.
LONGEST_FIRST = (
    "test_engine.py",  # 70 beside a full run, about 300 alone: first, in a fresh worker (above)
    "test_sharding.py",  # 200: one 8-device subprocess, besides the worker
    "test_moe_sharding.py",  # 110 (CPU seconds, a busy 2-core machine): one 4-device subprocess
    "test_kernels.py",  # 180: the Pallas interpreter
    "test_decode.py",  # 180
    "test_auto.py",  # 47 alone, 171 beside a full run (2026-12-04): the forced forms, the oracle rounds
    "test_bench.py",  # 150
    "test_moe.py",  # 75 (CPU seconds, a busy 2-core machine)
    "test_sampling.py",  # 120: one test
    "test_train_draft.py",  # 130 (and the default pair's script, about 120 more, with the cached SmolLM2 target)
    "test_train_data.py",  # 70
    "test_train_sharding.py",  # 55: one 8-device subprocess
    "test_train_objective.py",  # 50
    "test_serve.py",  # 105: four servers, besides the worker
    "test_tree.py",  # 95
    "test_notebooks.py",  # 55
    "test_model.py",  # 40
    "test_convert.py",  # 30
    "test_oracle.py",  # 30
    "test_gguf.py",  # 25 (3 s without the cached SmolLM2 GGUF)
    "test_cli.py",  # 20
    "test_accept.py",  # 20
)


def skip_cache_eviction() -> None:
    """With a size bound, every write to jax's compilation cache first lists the whole directory and reads each entry's
    access time to evict the oldest (jax._src.lru_cache.LRUCache._evict_if_needed), under the lock: quadratic in the
    entries (0.14 s a write at 2000 on a busy 2-core machine), while the run stays far below the 8 GiB bound
    (test_decode.py and test_engine.py write 92 programs, 9 MB). This process (an xdist worker, or a run without
    xdist) keeps the lock and skips the scan; the suite's subprocesses write few programs each."""
    from jax._src import lru_cache

    if hasattr(lru_cache.LRUCache, "_evict_if_needed"):
        lru_cache.LRUCache._evict_if_needed = lambda self, **kw: None


def session_cache() -> str:
    """Point $DDTREE_JAX_CACHE at a fresh temporary directory for the run (removed at its end), so that nothing the
    suite measures (costs.json: each program's seconds a round on this machine) lands in the user's cache, while the
    downloaded and converted models (its ``gguf`` and ``models``, linked) stay where the tests look for them."""
    from ddtree_jax import gguf_model

    real = gguf_model.cache_dir()
    path = tempfile.mkdtemp(prefix="ddtree_jax_test_cache_")
    for name in MODEL_DIRS:  # made when missing, so that a model fetched by one worker serves the others and later runs
        os.makedirs(os.path.join(real, name), exist_ok=True)
        os.symlink(os.path.join(real, name), os.path.join(path, name))
    os.environ[gguf_model.CACHE_ENV] = path
    return path


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order otherwise


def pytest_unconfigure(config):
    path = getattr(config, "_jit_cache", None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get(CACHE_ENV) == path:
            del os.environ[CACHE_ENV]
    if getattr(config, "_cache", None) is not None:
        shutil.rmtree(config._cache, ignore_errors=True)  # the links to the models, not the models


def fake_device_report(script: str, out: str, devices: int) -> dict:
    """Run ``script`` (a test file whose ``__main__`` writes a JSON report to its argument) in a subprocess on
    ``devices`` fake CPU devices (a process's device count is fixed when jax starts) and return the report. No LLVM
    optimisation: compiling dominates, and the comparisons are within the one process."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
    proc = subprocess.run([sys.executable, os.path.abspath(script), out], env=env, cwd=repo, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    with open(out) as f:
        return json.load(f)


def decode_to_the_end(spec, tp, dp, state, tokens, rows: int):
    """decode.prefill, then decode.run_rounds until every row is done, each compiled ahead of time: (the first ``rows``
    rows' outputs, their acceptance lengths, the final state, the compiled prefill, the compiled round loop)."""
    import jax.numpy as jnp

    from ddtree_jax import decode

    rounds = jnp.int32(spec.max_rounds + 1)
    prefill = decode.prefill.lower(spec, tp, dp, state, tokens).compile()
    step = decode.run_rounds.lower(spec, tp, dp, state, rounds).compile()
    state = step(tp, dp, prefill(tp, dp, state, tokens), rounds)
    ends, out = decode.final_length(state), np.asarray(state.out)
    hist, n = np.asarray(state.accept_hist), np.asarray(state.n_rounds)
    return ([out[i, : ends[i]].tolist() for i in range(rows)], [hist[i, : n[i]].tolist() for i in range(rows)], state,
            prefill, step)


def blocking_like_a_gpu(fn, spans: list, extra_s: float):
    """``fn`` as a GPU runs a round loop: its call returns only once its work is done (XLA's runtime reads the loop's
    predicate on the host), here plus ``extra_s`` seconds; each call's (start, end) is appended to ``spans``."""
    import jax

    def call(*args):
        began = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        time.sleep(extra_s)
        spans.append((began, time.perf_counter()))
        return out
    return call


def fixture_path(*parts: str) -> str:
    return os.path.join(FIXTURES, *parts)


@pytest.fixture(scope="session")
def target():
    from ddtree_jax import weights

    return weights.load_target(fixture_path("target"))


@pytest.fixture(scope="session")
def drafter():
    from ddtree_jax import weights

    return weights.load_draft(fixture_path("draft"))


@pytest.fixture(scope="session")
def llama():
    from ddtree_jax import weights

    return weights.load_target(fixture_path("llama_target"))


@pytest.fixture(scope="session")
def reference_runs():
    with open(fixture_path("generate.json")) as f:
        return json.load(f)["runs"]


@pytest.fixture(scope="session")
def logits_npz():
    return dict(np.load(fixture_path("logits.npz")))


@pytest.fixture
def faulty_walk(monkeypatch):
    """A simulated decode fault: ``accept.walk`` (run as the XLA walk, whatever the attention) reports no accepted
    node (a round that commits nothing) whenever the target's choice at the root is a multiple of 3. jax's and
    decode's compile caches are emptied on the way in and out, so that programs traced with the fault never serve
    another test."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import accept, decode

    real = accept.walk

    def faulty(tree, choice, max_depth, impl="xla"):
        path, length, bonus = real(tree, choice, max_depth)
        return path, jnp.where(choice[:, 0] % 3 == 0, 0, length), bonus

    monkeypatch.setattr(accept, "walk", faulty)
    monkeypatch.setattr(decode, "_COMPILED", type(decode._COMPILED)())
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()
