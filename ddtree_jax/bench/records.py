"""What every benchmark subcommand writes: log lines (stderr, timestamped), the date and command line of each
record, JSON files (written whole, then renamed over the old one) and plain-text tables (stdout)."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
import time


def now() -> str:
    """The current UTC time, to the second (a record's date)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


ARGV: list[str] = []  # the arguments of this process's command (set by ddtree_jax.bench.main)


def command() -> str:
    """The command line that made a record."""
    return "python -m ddtree_jax.bench " + " ".join(shlex.quote(a) for a in ARGV)


def write_json(path: str, obj) -> None:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_jsonable)
    os.replace(tmp, path)


def _jsonable(x):
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
        if isinstance(x, np.ndarray):
            return x.tolist()
    except ImportError:
        pass
    return str(x)


def print_table(records: list[dict], cols: list[str], breakdown: bool = False) -> None:
    """The records' ``cols`` as aligned text columns on stdout (floats to 3 decimals), the breakdown last if asked."""
    rows = []
    for r in records:
        row = []
        for c in cols:
            v = r.get(c)
            row.append(f"{v:.3f}" if isinstance(v, float) else "-" if v is None else str(v))
        if breakdown:
            row.append(fmt_breakdown(r.get("breakdown_ms")))
        rows.append(row)
    head = cols + (["breakdown_ms"] if breakdown else [])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    sys.stdout.flush()


def fmt_breakdown(d) -> str:
    """A record's ``breakdown_ms`` ({stage: ms}) on one line; "-" for none."""
    if not d:
        return "-"
    return " ".join(f"{k}={v:.3f}" for k, v in d.items() if isinstance(v, (int, float)))
