"""Load benchmark of the OpenAI-compatible server on random-weight models: ar, dflash and ddtree in turn.

For each method: start ``python -m ddtree_jax.serve --target random:SHAPE --method M --max-batch 32 ...`` in
the background, wait for /health (compilation), run ``python -m ddtree_jax.loadtest --json`` once per
concurrency level (max(K x c, MIN) closed-loop requests of exactly --max-tokens tokens on --prompt-len random
token ids), stop the server, and go on with the next method whatever happened. Each method gets an equal
share of what is left of --time-limit; a level that would overrun it is cut (and reported).

Writes to OUT_DIR: METHOD.json (the loadtest's JSON list, the levels that finished), METHOD.server.log,
METHOD.loadtest.log, run.json (parameters, startup times, failures) and summary.md (a Markdown table).

    python benchmarks/load_bench.py OUT_DIR                   # H200: random:qwen3-8b, about 4 minutes
    python benchmarks/load_bench.py OUT_DIR --shape tiny --prompt-len 32 --max-tokens 16   # CPU rehearsal
    python benchmarks/load_bench.py OUT_DIR --summarize       # summary.md again from OUT_DIR's JSON files

Random weights: the drafter never agrees with the target, so dflash/ddtree accept about one token per round;
the numbers are the serving cost of each method at that acceptance, not its speedup on a real pair.
Needs the server's packages (starlette, uvicorn, sse-starlette, prometheus-client) and httpx (loadtest).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive integers")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--shape", default="qwen3-8b", help="served as --target random:SHAPE (default: %(default)s)")
    p.add_argument("--methods", default="ar,dflash,ddtree", help="comma-separated (default: %(default)s)")
    p.add_argument("--tree-budget", type=int, default=64, help="ddtree's budget (default: %(default)s)")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16, 32], help="levels (default: 1,...,32)")
    p.add_argument("--requests-per-client", type=int, default=2, metavar="K",
                   help="requests per level: max(K x concurrency, --min-requests) (default: %(default)s)")
    p.add_argument("--min-requests", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="server slots (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="server --max-len (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=360.0,
                   help="seconds for everything; each method gets an equal share of what is left "
                        "(default: %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="extra serve flag, repeatable, e.g. --server-arg=--attention=xla")
    p.add_argument("--summarize", action="store_true", help="only (re)write summary.md from OUT's JSON files")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def _healthy(url: str) -> bool:
    try:
        with _DIRECT.open(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:  # URLError, HTTPError (503 while compiling), connection refused
        return False


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _stop(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run_method(args, method: str, deadline: float) -> dict:
    """One server, every level; returns this method's entry of run.json (results go to METHOD.json)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ddtree_jax.serve", "--target", f"random:{args.shape}", "--method", method,
           "--max-batch", str(args.max_batch), "--max-len", str(args.max_len), "--port", str(port),
           "--log-level", "warning", *(["--tree-budget", str(args.tree_budget)] if method == "ddtree" else []),
           *args.server_arg]
    info: dict = {"method": method, "server_command": " ".join(cmd[1:]), "levels": [], "failures": []}
    results: list[dict] = []
    out_json = os.path.join(args.out, f"{method}.json")
    t0 = time.monotonic()
    with open(os.path.join(args.out, f"{method}.server.log"), "w") as slog, \
            open(os.path.join(args.out, f"{method}.loadtest.log"), "w") as llog:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=slog, stderr=subprocess.STDOUT)
        try:
            while not _healthy(url):
                if proc.poll() is not None:
                    slog.flush()
                    with open(slog.name) as f:
                        last = (f.read().strip().splitlines() or [""])[-1]
                    raise RuntimeError(f"server exited with status {proc.returncode} before /health was 200: "
                                       f"{last}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy after {time.monotonic() - t0:.0f}s (time share spent)")
                time.sleep(0.5)
            info["startup_s"] = round(time.monotonic() - t0, 1)
            print(f"[{method}] ready in {info['startup_s']}s", file=sys.stderr, flush=True)
            for c in args.concurrency:
                n = max(args.requests_per_client * c, args.min_requests)
                left = deadline - time.monotonic()
                if left < 5:
                    info["failures"].append(f"concurrency {c}: skipped, the method's time share is spent")
                    continue
                lcmd = [sys.executable, "-m", "ddtree_jax.loadtest", "--url", url, "--concurrency", str(c),
                        "--requests", str(n), "--prompt-len", str(args.prompt_len), "--max-tokens",
                        str(args.max_tokens), "--json"]
                llog.write(f"$ {' '.join(lcmd[1:])}\n")
                llog.flush()
                try:
                    r = subprocess.run(lcmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=llog, text=True,
                                       timeout=left)
                except subprocess.TimeoutExpired:
                    info["failures"].append(f"concurrency {c}: cut after {left:.0f}s (the method's time share)")
                    continue
                if r.returncode != 0:
                    info["failures"].append(f"concurrency {c}: loadtest exited with {r.returncode} (see the log)")
                    continue
                level = json.loads(r.stdout)[0]
                results.append(level)
                info["levels"].append(c)
                if level["errors"]:
                    info["failures"].append(f"concurrency {c}: {level['errors']} failed requests, first: "
                                            f"{level['first_error']}")
                print(f"[{method}] c={c}: {level['output_tokens_per_s'] or 0:.1f} tok/s, p50 "
                      f"{level['latency_s']['p50'] or 0:.3f}s, {level['errors']} errors", file=sys.stderr,
                      flush=True)
                with open(out_json, "w") as f:
                    json.dump(results, f, indent=1)
        except Exception as e:  # noqa: BLE001 - one method failing must not stop the others
            info["failures"].append(f"{type(e).__name__}: {e}")
            print(f"[{method}] failed: {e}", file=sys.stderr, flush=True)
        finally:
            info["server_exit"] = _stop(proc)
    info["wall_s"] = round(time.monotonic() - t0, 1)
    return info


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def summarize(out: str) -> str:
    """summary.md of OUT_DIR: one row per (method, concurrency), throughput relative to ar's at that level."""
    run = {}
    if os.path.exists(os.path.join(out, "run.json")):
        with open(os.path.join(out, "run.json")) as f:
            run = json.load(f)
    methods = [m["method"] for m in run.get("methods", [])] or sorted(
        x[:-5] for x in os.listdir(out) if x.endswith(".json") and x != "run.json")
    data = {}
    for m in methods:
        path = os.path.join(out, f"{m}.json")
        if os.path.exists(path):
            with open(path) as f:
                data[m] = {r["concurrency"]: r for r in json.load(f)}
    a = run.get("args", {})
    lines = []
    if a:
        lines.append(f"random:{a['shape']} ({a.get('device') or 'no nvidia-smi'}), --max-batch {a['max_batch']}, "
                     f"--max-len {a['max_len']}, ddtree budget {a['tree_budget']}; prompt {a['prompt_len']} random "
                     f"token ids, {a['max_tokens']} tokens generated per request (ignore_eos), greedy; closed loop, "
                     f"max({a['requests_per_client']} x concurrency, {a['min_requests']}) requests per level.")
        starts = ", ".join(f"{m['method']} {m['startup_s']}s" for m in run.get("methods", []) if "startup_s" in m)
        if starts:
            lines.append(f"Server start to /health 200 (random weights built on device + compilation): {starts}.")
        lines.append("")
    lines += ["| method | concurrency | requests | errors | req/s | output tok/s | tok/s vs ar "
              "| latency p50 / p90 / p99 (s) | TTFT p50 / p90 / p99 (s) | TPOT p50 (ms) | acceptance |",
              "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]
    for m in methods:
        for c, r in sorted(data.get(m, {}).items()):
            ar = data.get("ar", {}).get(c, {}).get("output_tokens_per_s")
            tps = r["output_tokens_per_s"]
            lat, ttft = (" / ".join(_f(r[k][q]) for q in ("p50", "p90", "p99")) for k in ("latency_s", "ttft_s"))
            tpot = r["tpot_s"]["p50"]
            lines.append(
                f"| {m} | {c} | {r['requests']} | {r['errors']} | {_f(r['requests_per_s'], '.2f')} | {_f(tps, '.1f')} "
                f"| {_f(tps / ar if tps and ar else None, '.2f')} | {lat} | {ttft} "
                f"| {_f(tpot * 1000 if tpot is not None else None, '.1f')} "
                f"| {_f(r['mean_acceptance_length'], '.2f')} |")
    fails = [f"- {m['method']}: {x}" for m in run.get("methods", []) for x in m.get("failures", [])]
    if fails:
        lines += ["", "Failures:", *fails]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


NEEDS = {"jax": "jax", "starlette": "starlette", "uvicorn": "uvicorn", "sse_starlette": "sse-starlette",
         "prometheus_client": "prometheus-client", "httpx": "httpx"}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.summarize:
        print(summarize(args.out), end="")
        return 0
    missing = [pip for mod, pip in NEEDS.items() if importlib.util.find_spec(mod) is None]
    if missing:  # before any server starts: the servers and the loadtest run with this interpreter and path
        print(f"error: missing packages: {' '.join(missing)} (pip install {' '.join(missing)})", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    record = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "summarize")},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "methods": []}
    try:  # the accelerator, for the summary's header (nvidia-smi where there is one)
        record["args"]["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                                  capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        record["args"]["device"] = None
    for i, m in enumerate(args.methods):
        share = (args.time_limit - (time.monotonic() - t_start)) / (len(args.methods) - i)
        record["methods"].append(run_method(args, m, time.monotonic() + share))
        with open(os.path.join(args.out, "run.json"), "w") as f:
            json.dump(record, f, indent=1)
    record["total_s"] = round(time.monotonic() - t_start, 1)
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(summarize(args.out), end="")
    print(f"total {record['total_s']}s; files in {args.out}", file=sys.stderr)
    complete = all(not m["failures"] and len(m["levels"]) == len(args.concurrency) for m in record["methods"])
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
