"""Helpers shared by the command-line entry points (generate, bench, serve, train).

The contract every entry point keeps: a bad input is ONE line on stderr (``error: ...``) and exit status 2,
never a traceback; Ctrl-C is exit 130; machine-readable output on stdout stays clean (see
:func:`stdout_to_stderr`). Use it as::

    def main(argv=None) -> int:
        return cli.run(_main, argv)

``DDTREE_JAX_DEBUG=1`` in the environment re-raises instead, to get the traceback while debugging.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Iterator, Sequence, TextIO

from ddtree_jax import tuning

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
DEBUG_ENV = "DDTREE_JAX_DEBUG"
# --attention of every command (kernels.resolve_attention): the Pallas kernels, the kernels with the attention
# reading each layer's K/V in place from the stacked cache, the XLA path, or auto (Pallas on a GPU where it works)
ATTENTIONS = ("auto", "pallas", "pallas-inplace", "xla")
DTYPES = ("bfloat16", "float32")  # --dtype of every command: weights and matmul operands
ATTENTION_HELP = ("attention: pallas (GPU kernels), pallas-inplace (the same, the attention kernel reading each "
                  "layer's K/V in place from the stacked cache: no per-layer copy), xla (portable), auto (on a GPU "
                  "pallas-inplace, else pallas, whichever passes its probe first; xla elsewhere; default)")


class UsageError(ValueError):
    """A bad command line or input file: reported as one line, exit status 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports errors as one line (through :func:`run`) instead of usage + message."""

    def error(self, message: str):  # argparse calls this for every parse error
        raise UsageError(f"{message} (see {self.prog} --help)")


def one_line(message: object) -> str:
    text = " ".join(str(message).split())
    return text or type(message).__name__


def error(message: object, code: int = EXIT_USAGE) -> int:
    """Print ``error: message`` on one line of stderr and return ``code``."""
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()
    return code


def warn(message: object) -> None:
    sys.stderr.write(f"warning: {one_line(message)}\n")
    sys.stderr.flush()


def info(message: object) -> None:
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input. ConfigError/WeightsError/TokenizerError subclass ValueError."""
    return (UsageError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def run(fn: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Call ``fn(argv)`` and turn every failure into one stderr line and an exit status."""
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        code = fn(argv)
        return EXIT_OK if code is None else int(code)
    except SystemExit as e:  # argparse --help / --version
        return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else error(e.code))
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        return EXIT_INTERNAL
    except KeyboardInterrupt:
        if debug:
            raise
        return error("interrupted", EXIT_INTERRUPTED)
    except _user_errors() as e:
        if debug:
            raise
        return error(e, EXIT_USAGE)
    except Exception as e:  # a bug, not bad input: still one line, but say how to get the traceback
        if debug:
            raise
        if "RESOURCE_EXHAUSTED" in str(e):  # XLA's allocation failure: the device's memory, not a bug
            return error(out_of_memory(e), EXIT_INTERNAL)
        return error(f"internal error: {type(e).__name__}: {e} (set {DEBUG_ENV}=1 for the traceback)",
                     EXIT_INTERNAL)


def out_of_memory(e: BaseException) -> str:
    """The one line for an allocation that failed on the device: what XLA said, what JAX may take, how to ask for
    more or need less (Qwen3-Coder-30B-A3B's 61 GB of weights fit an H100 80GB only above JAX's default 0.75)."""
    share = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75 (JAX's default)")
    return (f"out of device memory: {one_line(e)[:300]}; JAX may take {share} of each GPU's memory: "
            "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 gives it more, or need less (--max-batch, --max-len, --dtype "
            f"bfloat16, a mesh over more GPUs; {DEBUG_ENV}=1 for the traceback)")


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[TextIO]:
    """Keep stdout for the program's own output: inside the block, anything else written to stdout goes
    to stderr, both Python prints and (through a dup of file descriptor 1) C/C++ writes from XLA or absl.
    Yields the stream that still reaches the real stdout; write the program's output there.
    """
    real = sys.stdout
    real.flush()
    try:
        real_on_fd1 = real.fileno() == 1
    except (AttributeError, OSError, ValueError):  # stdout replaced (pytest capture, a notebook)
        real_on_fd1 = False
    saved = out = None
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
        if real_on_fd1:  # fd 1 now leads to stderr: reach the real stdout through the saved descriptor
            out = os.fdopen(os.dup(saved), "w", encoding=real.encoding or "utf-8", errors="replace")
    except OSError:  # no usable fd 1 (embedded interpreter): the Python-level redirect still applies
        pass
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield out if out is not None else real
    finally:
        sys.stderr.flush()
        if out is not None:
            with contextlib.suppress(OSError):
                out.close()  # flushes
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


# ---------------------------------------------------------------------------- argparse value types
def _typed(name: str, convert: Callable[[str], object], check: Callable[[object], bool], what: str):
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not check(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = name  # argparse names the type in messages
    return parse


positive_int = _typed("positive_int", int, lambda v: v >= 1, "an integer >= 1")
nonneg_int = _typed("nonneg_int", int, lambda v: v >= 0, "an integer >= 0")
nonneg_float = _typed("nonneg_float", float, lambda v: v >= 0 and v == v and v != float("inf"), "a number >= 0")
probability = _typed("probability", float, lambda v: 0 < v <= 1, "a number in (0, 1]")


_budget_int = _typed("tree_budget", int, lambda v: v >= 1, "auto or an integer >= 1")


def tree_budget(text: str) -> int | str:
    """``auto`` or a positive integer (argparse type of --tree-budget)."""
    if text.strip().lower() == "auto":
        return "auto"
    return _budget_int(text)


def form_list(text: str) -> tuple[str, ...]:
    """``"ar,chain,16,64"`` -> the forms (argparse type of --forms; ddtree_jax.policy.parse_forms)."""
    from ddtree_jax import policy

    try:
        return policy.parse_forms(text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


TREE_BUDGET_HELP = (
    "an integer N: every round the same, a tree of N nodes (ddtree; dflash: the chain); or auto (the default of "
    "dflash and ddtree): every group of rounds takes the form with the most expected tokens per second among an AR "
    "step, the DFlash chain and trees of 16-256 nodes (8-128 for a mixture-of-experts target; 4-16 on CPU; "
    "--forms), expecting from each what the drafter's own path probabilities predict, corrected by what the target "
    "has accepted, over its cost measured on the device at the live slot batch (kept in $DDTREE_JAX_CACHE/costs.json, "
    "default ~/.cache/ddtree_jax); speculation stops where it would lose to AR. "
    "Greedy output is AR's token for token, sampled output AR's for the same seed, whatever the forms")
FORMS_HELP = ("the forms --tree-budget auto chooses among, comma-separated: ar (an AR step), chain (DFlash's chain) "
              "and tree budgets, e.g. ar,chain,32,128 (default: ar,chain,16,32,64,128,256 on a GPU, "
              "ar,chain,8,16,32,64,128 there for a mixture-of-experts target, ar,chain,4,8,16 elsewhere; dflash: "
              "ar,chain). Each is compiled at each slot batch")


def int_list(text: str) -> list[int]:
    """``"1,2, 3"`` -> [1, 2, 3] (argparse type). Empty entries and non-integers are errors."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} has a negative number")
    return values


def tuning_arg(text: str) -> tuning.Tuning:
    """``--tuning KEY=VALUE,...`` (argparse type): :func:`ddtree_jax.tuning.parse`, its error as one line."""
    try:
        return tuning.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_tuning(parser: argparse.ArgumentParser) -> None:
    """The ``--tuning`` flag of the commands that decode (default: ``Tuning()``, the backend's defaults)."""
    parser.add_argument("--tuning", type=tuning_arg, default=tuning.Tuning(), metavar="KEY=VALUE,...",
                        help=tuning.HELP)


def existing_dir(what: str, path: str) -> str:
    if not os.path.exists(path):
        raise UsageError(f"{what}: no such directory: {path}")
    if not os.path.isdir(path):
        raise UsageError(f"{what}: not a directory: {path}")
    return path
