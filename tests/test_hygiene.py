"""Source hygiene of the package, the kernels, the converters, the tests and the notebooks (.py and .ipynb):

- no prose citing a numbered benchmark run (an ordinal word or number before "run", or "run" before a number):
  measurements live in docs/ and benchmarks/results/, and a comment says what and why;
- no ``DDTREE_JAX_*`` environment variable read outside the two modules that read user settings once
  (cli.py: DDTREE_JAX_DEBUG, gguf_model.py: DDTREE_JAX_CACHE): how a decode runs is ``ddtree_jax.tuning.Tuning``,
  carried by the static Spec, never the environment while tracing;
- no module-level ``NAME = True`` / ``NAME = False``: a boolean constant at module level is an A/B switch keeping a
  second code path alive.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIRS = ("ddtree_jax", "pallas_kernels", "convert", "tests", "notebooks")
ENV_PREFIX = "DDTREE_JAX_"
# (file, variable): the environment variables read on purpose, once, outside tracing
ENV_READERS = {("ddtree_jax/cli.py", ENV_PREFIX + "DEBUG"), ("ddtree_jax/gguf_model.py", ENV_PREFIX + "CACHE"),
               ("tests/test_gguf.py", ENV_PREFIX + "NETWORK_TESTS")}  # the suite's opt-in to downloading a model
BOOL_CONSTANTS: set[tuple[str, str]] = set()  # (file, name) of genuine non-A/B boolean constants: none today

_UNITS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth")
_TEENS = ("tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
          "eighteenth", "nineteenth")
_TENS = ("twenty", "thirty", "forty", "fifty", "sixty")
ORDINAL = "|".join((*(f"{t}-{u}" for t in _TENS for u in _UNITS), *(f"{t[:-1]}ieth" for t in _TENS), *_TEENS,
                    *_UNITS, r"\d+(?:st|nd|rd|th)"))
# an ordinal (or a list of them, and one word such as H200) before "run(s)", or "run(s)" before a number
NUMBERED_RUN = re.compile(
    rf"\b(?:{ORDINAL})(?:(?:,|,? and|,? or| to) (?:{ORDINAL}))*(?: [A-Za-z0-9]+)? runs?\b|\bruns? #?\d+\b",
    re.IGNORECASE)


def sources() -> list[Path]:
    return sorted(p for d in DIRS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".ipynb") and p.is_file()
                  and ".ipynb_checkpoints" not in p.parts)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def code_of(path: Path) -> list[str]:
    """The Python sources in a file: the file itself, or a notebook's code cells."""
    if path.suffix == ".py":
        return [path.read_text()]
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_the_checks_catch_what_they_are_for():
    """Each check on a sample that it must flag and one that it must not."""
    run = "run"  # (the samples are built, or this file would cite them)
    flagged = [f"the {w} {run}" for w in ("seventh", "twenty-second", "thirty-first", "12th")]
    flagged += [f"(tenth and eleventh {run}s)", f"its sixteenth H200 {run}", f"{run} 12", f"{run}s 7"]
    assert all(NUMBERED_RUN.search(text) for text in flagged), [t for t in flagged if not NUMBERED_RUN.search(t)]
    kept = ["a second call compiles nothing", "runs in 4 ms", "the first of equal maxima", "run_rounds(spec, 12)"]
    assert not any(NUMBERED_RUN.search(text) for text in kept), [t for t in kept if NUMBERED_RUN.search(t)]
    sample = f'import os\nNAME = "{ENV_PREFIX}X"\nA = os.environ.get(NAME)\nB = os.getenv("{ENV_PREFIX}Y")\n' \
             f'C = "{ENV_PREFIX}Z" in os.environ\nD = os.environ[f"{ENV_PREFIX}W"]\nSWITCH = False\nflag: bool = True\n'
    assert env_reads(sample, {}) == [ENV_PREFIX + v for v in "XYZW"]
    assert bool_constants(sample) == ["SWITCH", "flag"]
    assert env_reads(f'import os\nos.environ["{ENV_PREFIX}X"] = "1"\n', {}) == []  # setting is not reading
    switch = f'import os\nA = "{ENV_PREFIX}A"\ndef on(env):\n    return os.environ.get(env, "kernel")\n'
    assert env_reads(switch, {}) == [ENV_PREFIX + "?"]  # through a parameter


def test_no_numbered_runs():
    hits = [f"{rel(p)}:{n}: {m.group(0)!r}" for p in sources() for n, line in enumerate(p.read_text().splitlines(), 1)
            for m in NUMBERED_RUN.finditer(line)]
    assert not hits, "numbered benchmark runs cited (say what and why; numbers go to docs/):\n" + "\n".join(hits)


def _string_constants() -> dict[str, str]:
    """Module-level NAME = "DDTREE_JAX_..." across the sources, so that ``cli.DEBUG_ENV`` resolves too."""
    names = {}
    for path in sources():
        for text in code_of(path):
            for node in ast.parse(text).body:
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and isinstance(node.value.value, str) and node.value.value.startswith(ENV_PREFIX):
                    names.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return names


def env_reads(text: str, known: dict[str, str]) -> list[str]:
    """The DDTREE_JAX_* variables a Python source reads: ``os.environ.get / pop / setdefault(X)``,
    ``os.getenv(X)``, ``os.environ[X]`` (loaded), ``X in os.environ``; X a string, an f-string or a name bound to
    one (in the source, or ``known``). A key it cannot resolve (say a function's parameter) counts as one, as
    "DDTREE_JAX_?", where the source names such a variable."""
    tree = ast.parse(text)
    local = {**known}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            local.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})

    def value(x) -> str | None:
        if isinstance(x, ast.Constant) and isinstance(x.value, str):
            return x.value
        if isinstance(x, ast.JoinedStr) and x.values and isinstance(x.values[0], ast.Constant):
            return x.values[0].value + "*"
        name = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else None
        return local.get(name)

    def is_environ(x) -> bool:
        return isinstance(x, ast.Attribute) and x.attr == "environ" or isinstance(x, ast.Name) and x.id == "environ"

    read = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("get", "pop", "setdefault") and is_environ(node.func.value) \
                    or node.func.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops) \
                and is_environ(node.comparators[-1]):
            key = node.left
        if key is None:
            continue
        name = value(key)
        if name is None and any(v.startswith(ENV_PREFIX) for v in local.values()):
            name = ENV_PREFIX + "?"
        if name and name.startswith(ENV_PREFIX):
            read.append(name.rstrip("*"))
    return read


def test_no_environment_read_outside_the_cli_and_the_model_cache():
    known = _string_constants()
    hits = [f"{rel(p)}: {name}" for p in sources() for text in code_of(p) for name in env_reads(text, known)
            if (rel(p), name) not in ENV_READERS]
    assert not hits, "DDTREE_JAX_* read by library code (use ddtree_jax.tuning.Tuning):\n" + "\n".join(hits)


def bool_constants(text: str) -> list[str]:
    """Names a Python source binds to True or False at module level."""
    names = []
    for node in ast.parse(text).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if getattr(node, "value", None) is not None and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, bool):
            names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


@pytest.mark.parametrize("where", DIRS)
def test_no_module_level_boolean_switches(where):
    hits = [f"{rel(p)}: {name}" for p in sources() if rel(p).startswith(where + "/") for text in code_of(p)
            for name in bool_constants(text) if (rel(p), name) not in BOOL_CONSTANTS]
    assert not hits, "module-level boolean constants (an A/B switch? delete the losing path):\n" + "\n".join(hits)
