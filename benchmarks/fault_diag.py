"""Decode faults per configuration: one process runs ``decode.generate`` for each CONFIG on the same prompts and
prints, per prompt, the state after prefill and after the round loop (round counter, output count, cache length),
the round statistics ``decode.round_statistics_problem`` objects to, and whether the tokens equal the first
configuration's. Written for the default pair's batch-1 fault on the H200 (benchmarks/PERF.md, twelfth run).

    PYTHONPATH=. python benchmarks/fault_diag.py SOURCE CONFIG...

SOURCE: ``default`` (the default pair, converted in the cache) or ``random`` (a random SmolLM2-shaped target with
the shipped drafter; no download). CONFIG: ``name=attention/walk[/option=value,...]``: the attention
implementation, the walk's implementation, and ``decode.XLA_OPTIONS`` overrides; an attention prefixed ``old:``
runs the kernel wrapper from the file in ``TA_OLD`` (e.g. ``git show e320082:pallas_kernels/tree_attention.py``,
the wrapper before the fix). Example (the twelfth run):

    PYTHONPATH=. python benchmarks/fault_diag.py random base=xla/xla inplace=pallas-inplace/pallas \
        nodsf=pallas-inplace/pallas/xla_gpu_enable_dynamic_slice_fusion=false

Environment: PROMPTS (2), NEW (64 new tokens), BUDGETS (32), METHOD (ddtree), TRACE (0/1), BATCHED (0/1: all
prompts as one batch), HLO=1 with OUT=DIR: write each compiled program's HLO text there and count its
dynamic-slice-fusion lines.
"""
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import accept, bench, decode, defaults, train_draft, weights
from ddtree_jax.config import ModelConfig, RopeConfig
from pallas_kernels import tree_attention as ta_lib

# SmolLM2-135M's shape (docs/DEFAULT_PAIR.md)
SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope=RopeConfig(theta=1e5),
                      tie_word_embeddings=True, qk_norm=False, max_position_embeddings=8192)


def load(source: str, dtype):
    """(target, draft, prompts, stop ids) of the default pair or of a random SmolLM2-shaped target."""
    draft = weights.load_draft(defaults.draft_path(), dtype)
    if source == "default":
        from ddtree_jax.tokenizer import load_tokenizer

        path = defaults.target_path()
        target, tok = weights.load_target(path, dtype), load_tokenizer(path)
        _, prompts = train_draft.make_prompts(tok, 256)
        stop = tuple(dict.fromkeys(tok.eos_token_ids + target[0].eos_token_ids))
    elif source == "random":
        from ddtree_jax import params

        tp = jax.jit(lambda k: params.init_random(params.target_shapes(SMOLLM2, dtype), k))(jax.random.key(0))
        target, stop = (SMOLLM2, tp), ()
        _, prompts = train_draft.make_prompts_without_tokenizer(SMOLLM2.vocab_size, 64, 90, seed=1)
    else:
        sys.exit(f"error: SOURCE must be default or random, not {source!r}")
    laid = [(cfg, decode.device_layout(p)) for cfg, p in (target, draft)]  # for the rounds (ar turns it again)
    return laid[0], laid[1], prompts, stop


class Probe:
    """The overrides: the walk's implementation, the round statistics recorded instead of raised, and every
    compiled program wrapped to print the state it returns (and, with HLO=1, to save its HLO)."""

    def __init__(self):
        self.walk_impl, self.name, self.problem = None, "", None
        self.real_walk, self.real_check, self.real_compiled = accept.walk, decode.round_statistics_problem, decode.compiled
        accept.walk = self.walk
        decode.round_statistics_problem = self.check
        decode.compiled = self.compiled

    def walk(self, tree, choice, max_depth, impl="xla"):
        return self.real_walk(tree, choice, max_depth, impl=self.walk_impl or impl)

    def check(self, spec, n_rounds, hist):
        self.problem = self.real_check(spec, n_rounds, hist)
        return None  # generate returns the outputs; main prints the problem

    def compiled(self, fn, spec, *args):
        exe = self.real_compiled(fn, spec, *args)
        out_dir = os.environ.get("OUT")
        if os.environ.get("HLO") == "1" and out_dir:
            txt = exe.as_text()
            with open(os.path.join(out_dir, f"{self.name}_{fn.__name__}.hlo.txt"), "w") as f:
                f.write(txt)
            n = sum("dynamic-slice-fusion" in ln for ln in txt.splitlines())
            print(f"  [{self.name} {fn.__name__}] dynamic-slice-fusion lines: {n}", flush=True)

        def call(*a):
            out = exe(*a)
            print(f"  [{self.name} {fn.__name__}] n_rounds={out.n_rounds.tolist()} n_out={out.n_out.tolist()} "
                  f"length={out.cache.length.tolist()}", flush=True)
            return out

        return call


def main(argv: list[str]) -> None:
    if len(argv) < 2 or any("=" not in c or c.split("=", 1)[1].count("/") < 1 for c in argv[1:]):
        sys.exit("usage: fault_diag.py default|random name=attention/walk[/option=value,...] ...")
    env = os.environ.get
    n_prompts, new, method = int(env("PROMPTS", "2")), int(env("NEW", "64")), env("METHOD", "ddtree")
    budgets = [int(x) for x in env("BUDGETS", "32").split(",")]
    target, draft, prompts, stop = load(argv[0], jnp.bfloat16)
    prompts = prompts[:n_prompts]
    groups = [prompts] if env("BATCHED") == "1" else [[p] for p in prompts]
    print("prompt lengths", [len(p) for p in prompts], flush=True)
    probe, base_options, current = Probe(), dict(decode.XLA_OPTIONS), ta_lib.tree_attention
    old = None
    if env("TA_OLD"):
        spec = importlib.util.spec_from_file_location("ta_old", env("TA_OLD"))
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    first: dict = {}
    for config in argv[1:]:
        name, rest = config.split("=", 1)
        attention, walk_impl, *options = rest.split("/")
        decode.XLA_OPTIONS.clear()
        decode.XLA_OPTIONS.update(base_options)
        update = bench.xla_options(options[0]) if options else {}
        if update is None:
            sys.exit(f"error: {options[0]!r} is not option=value,...")
        decode.XLA_OPTIONS.update(update)
        probe.name, probe.walk_impl = name, walk_impl
        ta_lib.tree_attention = current
        if attention.startswith("old:"):
            if old is None:
                sys.exit("error: an old: attention needs TA_OLD=FILE (the old kernel wrapper)")
            ta_lib.tree_attention, attention = old.tree_attention, attention[4:]
        jax.clear_caches()  # the walk and the kernel are picked at trace time
        decode._COMPILED.clear()
        for budget in budgets:
            for gi, group in enumerate(groups):
                opts = decode.GenerateOptions(method=method, tree_budget=budget, max_new_tokens=new,
                                              attention=attention, stop_token_ids=stop, trace=env("TRACE") == "1")
                probe.problem = None
                tag = f"{name} b{budget} g{gi}"
                try:
                    r = decode.generate(target, group, opts, draft=draft)
                except RuntimeError as e:
                    print(f"{tag}: {e}", flush=True)
                    continue
                ref = first.setdefault((budget, gi), r)
                same = [a == b for a, b in zip(r.output_ids, ref.output_ids)]
                hist = r.acceptance_lengths
                print(f"{tag}: {'FAULT ' + probe.problem if probe.problem else 'ok'}; attention {r.attention}, "
                      f"generated {r.num_generated}, rounds {[len(h) for h in hist]}, accepted in all "
                      f"{[int(sum(h)) for h in hist]}, tokens as the first config's {same}, "
                      f"mean acceptance {[round(float(np.mean(h)), 2) if h else None for h in hist]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
