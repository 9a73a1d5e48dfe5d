"""Load benchmark of the OpenAI-compatible server: one server per configuration in turn, each load-tested.

A configuration is METHOD or METHOD:BUDGET (ar; dflash and ddtree under --tree-budget auto unless a budget is given,
e.g. ddtree:64). For each: start ``python -m ddtree_jax.serve --target T --method M [--tree-budget B] --max-batch 32
...`` in the background, time it to /health 200 (``startup_s``; the servers' cache directory is OUT/cache unless
--cache-dir says otherwise, so the first start compiles everything), optionally wait until every program is compiled
and timed (--wait-compiled: the steady state; ``compiled_s``), run ``python -m ddtree_jax.loadtest --json`` once per
concurrency level (max(K x c, MIN) closed-loop requests of exactly --max-tokens tokens), stop the server, and for the
configurations of --restart start it once more to time a second start on the persistent compilation cache
(``restart_s``). Each configuration gets an equal share of what is left of --time-limit; a level that would overrun it
is cut (and reported). With --interleave every configuration's server runs at once and each level runs on each in
turn (the order reversed every other level), so that a level's ratios do not carry the machine's drift between
configurations run minutes apart (on a shared 2-core CPU the same server's speed changes 2x within minutes).

Prompts: --prompt-len random token ids (random weights), or --prompts-file (text prompts as chat messages, or token
ids); with --target default (the default pair) the held-out prompts of ddtree_jax/data/prompts/python.json.

A level may repeat (--concurrency 1,1,1,...): with --wait-compiled 0 the levels then show what requests pay while the
server compiles its programs in the background (each level records when it ran after /health and the programs
compiled at its start and end).

Writes to OUT_DIR: CONFIG.json (the loadtest's JSON list, the levels that finished), CONFIG.server.log,
CONFIG.loadtest.log, run.json (parameters, startup times, failures) and summary.md (a Markdown table, throughput
relative to ar's, the forms auto ran). With --py-spy C,... (py-spy installed: ``pip install py-spy``), each
server's threads are sampled during its levels C (``py-spy record --threads --gil --nonblocking``, SIGINT at the
level's end) into CONFIG.c<C>.speedscope.json: where the engine, step and HTTP threads spend the host's time under
load.

    python benchmarks/load_bench.py OUT_DIR                   # H200: random:qwen3-8b, ar, dflash, ddtree (auto)
    python benchmarks/load_bench.py OUT_DIR --target default --methods ar,ddtree,ddtree:16,ddtree:32,ddtree:64 \\
        --concurrency 1,4,16,32 --wait-compiled 300          # the default pair: auto against fixed budgets
    python benchmarks/load_bench.py OUT_DIR --target random:tiny --prompt-len 32 --max-tokens 16   # CPU rehearsal
    python benchmarks/load_bench.py OUT_DIR --summarize       # summary.md again from OUT_DIR's JSON files

Random weights: the drafter never agrees with the target, so dflash/ddtree accept about one token per round (auto
then runs AR steps); the numbers are the serving cost of each configuration at that acceptance.
Needs the server's packages (starlette, uvicorn, sse-starlette, prometheus-client) and httpx (loadtest).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
METHODS = ("ar", "dflash", "ddtree")


def _ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of positive integers")
    return vals


def _configs(text: str) -> list[str]:
    """'ar,dflash,ddtree:64' -> those names, checked: METHOD or METHOD:BUDGET (BUDGET a positive integer or auto)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        method, _, budget = item.partition(":")
        if method not in METHODS or (budget and budget != "auto" and not (budget.isdigit() and int(budget) > 0)):
            raise argparse.ArgumentTypeError(f"{item!r}: expected METHOD or METHOD:BUDGET, METHOD one of "
                                             f"{', '.join(METHODS)}, BUDGET a positive integer or auto")
        out.append(method if budget in ("", "auto") else f"{method}:{budget}")
    if not out:
        raise argparse.ArgumentTypeError("no configuration given")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--target", default="random:qwen3-8b",
                   help="the served target: random:SHAPE, a model directory, or default (the default pair) "
                        "(default: %(default)s)")
    p.add_argument("--draft", default=None, help="the drafter directory of a --target directory")
    p.add_argument("--methods", type=_configs, default=_configs("ar,dflash,ddtree"), metavar="CONFIGS",
                   help="configurations, METHOD or METHOD:BUDGET (default: ar,dflash,ddtree; dflash and ddtree "
                        "under --tree-budget auto)")
    p.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16, 32, 64], help="levels (default: 1,...,64)")
    p.add_argument("--requests-per-client", type=int, default=2, metavar="K",
                   help="requests per level: max(K x concurrency, --min-requests) (default: %(default)s)")
    p.add_argument("--min-requests", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens (default: %(default)s)")
    p.add_argument("--prompts-file", default=None, help="prompts instead of random token ids (loadtest's option)")
    p.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="server slots (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="server --max-len (default: %(default)s)")
    p.add_argument("--wait-compiled", type=float, default=0.0, metavar="S",
                   help="before the levels, wait up to S seconds until the server has compiled and timed every "
                        "program and compiled every prefill (/health's programs_compiled, programs_timed and "
                        "prefills_to_compile), so that the levels measure the steady state (default: 0)")
    p.add_argument("--restart", type=_configs, default=[], metavar="CONFIGS",
                   help="configurations to start a second time, on the persistent compilation cache, to time it "
                        "(default: none)")
    p.add_argument("--cache-dir", default=None,
                   help="the servers' DDTREE_JAX_CACHE (compiled programs, measured costs) (default: OUT/cache)")
    p.add_argument("--time-limit", type=float, default=480.0,
                   help="seconds for everything; each configuration gets an equal share of what is left "
                        "(default: %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                   help="extra serve flag, repeatable, e.g. --server-arg=--attention=xla")
    p.add_argument("--interleave", action="store_true",
                   help="run every configuration's server at once and each level on each in turn (order reversed "
                        "every other level), so that a level's ratios do not carry the machine's drift between "
                        "configurations run minutes apart; --restart is ignored, --time-limit is shared")
    p.add_argument("--py-spy", type=_ints, default=[], metavar="C,...",
                   help="sample each server's threads with py-spy during its levels of these concurrencies (the "
                        "profile of level C: CONFIG.cC.speedscope.json; needs py-spy on PATH) (default: none)")
    p.add_argument("--step-logs", action="store_true",
                   help="each server logs its device steps (serve --step-log) into CONFIG.steps.jsonl; with each "
                        "level's Unix start and end (started_at, ended_at, in every level record) "
                        "benchmarks/step_summary.py OUT/CONFIG.steps.jsonl OUT/CONFIG.json breaks each level down by "
                        "program")
    p.add_argument("--summarize", action="store_true", help="only (re)write summary.md from OUT's JSON files")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def _health(url: str) -> dict | None:
    """/health's JSON when it answers 200, else None."""
    try:
        with _DIRECT.open(f"{url}/health", timeout=2) as r:
            return json.load(r) if r.status == 200 else None
    except (OSError, ValueError):  # URLError, HTTPError (503 while compiling), connection refused
        return None


def _env(args, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["DDTREE_JAX_CACHE"] = args.cache_dir
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the server's own cache: the cache directory's jit/
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


def server_command(args, config: str, port: int) -> list[str]:
    method, _, budget = config.partition(":")
    cmd = [sys.executable, "-m", "ddtree_jax.serve", "--target", args.target, "--method", method,
           "--max-batch", str(args.max_batch), "--max-len", str(args.max_len), "--port", str(port),
           "--log-level", "warning"]
    if args.draft and method != "ar":
        cmd += ["--draft", args.draft]
    if args.step_logs:
        cmd += ["--step-log", os.path.join(os.path.abspath(args.out), f"{config.replace(':', '-')}.steps.jsonl")]
    return cmd + (["--tree-budget", budget] if budget else []) + args.server_arg


def _start(args, config: str, log, deadline: float, env: dict | None = None
           ) -> tuple[subprocess.Popen, str, float]:
    """A server of ``config`` up: (process, url, seconds to /health 200). ``env``: the environment to start from."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(server_command(args, config, port), cwd=REPO, env=_env(args, env), stdout=log,
                            stderr=subprocess.STDOUT)
    while _health(url) is None:
        if proc.poll() is not None:
            log.flush()
            with open(log.name) as f:
                last = (f.read().strip().splitlines() or [""])[-1]
            raise RuntimeError(f"server exited with status {proc.returncode} before /health was 200: {last}")
        if time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"server not healthy after {time.monotonic() - t0:.0f}s (time share spent)")
        time.sleep(0.25)
    return proc, url, round(time.monotonic() - t0, 1)


def _wait_compiled(url: str, limit: float) -> tuple[float | None, dict]:
    """Seconds until /health says every program is compiled and timed and every prefill compiled (None when
    ``limit`` passed first), and its last JSON."""
    t0 = time.monotonic()
    while True:
        health = _health(url) or {}
        compiled = health.get("programs_compiled", 0)
        if (compiled >= health.get("programs", 1) and health.get("programs_timed", compiled) >= compiled
                and not health.get("prefills_to_compile")):
            return round(time.monotonic() - t0, 1), health
        if time.monotonic() - t0 > limit:
            return None, health
        time.sleep(0.5)


class Served:
    """One configuration's server, its logs and its results (CONFIG.json) and run.json entry (``info``)."""

    def __init__(self, args, config: str):
        self.args, self.config, self.name = args, config, config.replace(":", "-")
        self.info: dict = {"config": config, "server_command": " ".join(server_command(args, config, 0)[1:]),
                           "levels": [], "failures": []}
        self.results: list[dict] = []
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.up = 0.0  # time.monotonic() when /health turned 200
        self.slog = open(os.path.join(args.out, f"{self.name}.server.log"), "w")
        self.llog = open(os.path.join(args.out, f"{self.name}.loadtest.log"), "w")

    def start(self, deadline: float, env: dict | None = None) -> bool:
        """Start the server (and wait until it has compiled, with --wait-compiled); False (recorded) if it failed."""
        config, info = self.config, self.info
        try:
            self.proc, self.url, info["startup_s"] = _start(self.args, config, self.slog, deadline, env)
            self.up = time.monotonic()
            print(f"[{config}] /health 200 in {info['startup_s']}s", file=sys.stderr, flush=True)
            if self.args.wait_compiled > 0:
                info["compiled_s"], health = _wait_compiled(self.url, min(self.args.wait_compiled,
                                                                          deadline - time.monotonic()))
                info["programs"] = [health.get("programs_compiled"), health.get("programs")]
                when = f"after {info['compiled_s']}s more" if info["compiled_s"] is not None else "(not all in time)"
                print(f"[{config}] programs compiled / to compile: {info['programs']} {when}", file=sys.stderr,
                      flush=True)
            return True
        except Exception as e:  # noqa: BLE001 - one configuration failing must not stop the others
            self.fail(e)
            return False

    def fail(self, e: Exception) -> None:
        self.info["failures"].append(f"{type(e).__name__}: {e}")
        print(f"[{self.config}] failed: {e}", file=sys.stderr, flush=True)

    def level(self, c: int, deadline: float) -> None:
        """Load-test the server at concurrency ``c`` (the level recorded, or its failure)."""
        args, info = self.args, self.info
        n = max(args.requests_per_client * c, args.min_requests)
        left = deadline - time.monotonic()
        if left < 5:
            info["failures"].append(f"concurrency {c}: skipped, the configuration's time share is spent")
            return
        lcmd = [sys.executable, "-m", "ddtree_jax.loadtest", "--url", self.url, "--concurrency", str(c),
                "--requests", str(n), "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
                "--json"]
        if args.prompts_file:
            lcmd += ["--prompts-file", args.prompts_file]
        self.llog.write(f"$ {' '.join(lcmd[1:])}\n")
        self.llog.flush()
        since, compiled = round(time.monotonic() - self.up, 1), (_health(self.url) or {}).get("programs_compiled")
        spy, started_at = self._py_spy(c), time.time()
        try:
            r = subprocess.run(lcmd, cwd=REPO, env=_env(args), stdout=subprocess.PIPE, stderr=self.llog, text=True,
                               timeout=left)
        except subprocess.TimeoutExpired:
            info["failures"].append(f"concurrency {c}: cut after {left:.0f}s (the configuration's time share)")
            return
        finally:
            if spy is not None:  # py-spy writes its profile on SIGINT
                spy.send_signal(signal.SIGINT)
                try:
                    spy.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    spy.kill()
        if r.returncode != 0:
            info["failures"].append(f"concurrency {c}: loadtest exited with {r.returncode} (see the log)")
            return
        level = json.loads(r.stdout)[0]
        # when it ran: seconds after /health turned 200, and the programs compiled then and at its end (levels run
        # with --wait-compiled 0 show what requests pay while the server compiles)
        level.update(since_health_s=since, programs_compiled=[compiled, (_health(self.url) or {}).get(
            "programs_compiled")], started_at=round(started_at, 3), ended_at=round(time.time(), 3))
        self.results.append(level)
        info["levels"].append(c)
        if level["errors"]:
            info["failures"].append(f"concurrency {c}: {level['errors']} failed requests, first: "
                                    f"{level['first_error']}")
        print(f"[{self.config}] c={c}: {level['output_tokens_per_s'] or 0:.1f} tok/s, p50 "
              f"{level['latency_s']['p50'] or 0:.3f}s, forms {level.get('form_rounds')}, reasons "
              f"{level.get('reason_rounds')}, {level['errors']} errors", file=sys.stderr, flush=True)
        with open(os.path.join(args.out, f"{self.name}.json"), "w") as f:
            json.dump(sorted(self.results, key=lambda x: x["concurrency"]), f, indent=1)

    def _py_spy(self, c: int) -> subprocess.Popen | None:
        """At a level of --py-spy: ``py-spy record`` of the server's threads, running until SIGINT."""
        if c not in self.args.py_spy or self.proc is None:
            return None
        out = os.path.join(self.args.out, f"{self.name}.c{c}.speedscope.json")
        cmd = ["py-spy", "record", "--pid", str(self.proc.pid), "--threads", "--gil", "--nonblocking",
               "--rate", "250", "--format", "speedscope", "--output", out]
        self.llog.write(f"$ {' '.join(cmd)}\n")
        self.llog.flush()
        try:
            return subprocess.Popen(cmd, stdout=self.llog, stderr=self.llog)
        except OSError as e:
            self.info["failures"].append(f"py-spy: {e}")
            return None

    def stop(self) -> None:
        self.info["server_exit"] = _stop(self.proc) if self.proc is not None else None
        self.proc = None

    def close(self) -> None:
        self.slog.close()
        self.llog.close()


def run_config(args, config: str, deadline: float) -> dict:
    """One server, every level; returns this configuration's entry of run.json (results go to CONFIG.json)."""
    served = Served(args, config)
    info = served.info
    t0 = time.monotonic()
    try:
        if served.start(deadline):
            for c in args.concurrency:
                served.level(c, deadline)
    finally:
        served.stop()
    if config in args.restart and not info["failures"]:
        try:  # the second start: the persistent compilation cache holds every program the first compiled
            proc, url, info["restart_s"] = _start(args, config, served.slog, deadline + 120)
            if args.wait_compiled > 0:
                info["restart_compiled_s"], _ = _wait_compiled(url, args.wait_compiled)
            print(f"[{config}] second start: /health 200 in {info['restart_s']}s", file=sys.stderr, flush=True)
            _stop(proc)
        except Exception as e:  # noqa: BLE001
            info["failures"].append(f"second start: {type(e).__name__}: {e}")
    served.close()
    info["wall_s"] = round(time.monotonic() - t0, 1)
    return info


def run_interleaved(args, deadline: float) -> list[dict]:
    """--interleave: every configuration's server at once, then each level run on each server in turn (the order
    reversed at every other level), so that the configurations of a level meet the machine in the same state; the
    run.json entries. On a GPU each server may take 1/N of its memory (XLA_PYTHON_CLIENT_MEM_FRACTION). The servers
    start at once (each one's start-up then shares the machine with the others')."""
    t0 = time.monotonic()
    servers = [Served(args, m) for m in args.methods]
    env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{0.9 / len(servers):.3f}")
    try:
        with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
            started = list(pool.map(lambda s: s.start(deadline, env), servers))
        up = [s for s, ok in zip(servers, started) if ok]
        for i, c in enumerate(args.concurrency):
            for s in (up if i % 2 == 0 else up[::-1]):
                s.level(c, deadline)
    finally:
        for s in servers:
            s.stop()
            s.close()
            s.info["wall_s"] = round(time.monotonic() - t0, 1)
    return [s.info for s in servers]


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def _forms(counts: dict | None, reasons: dict | None = None) -> str:
    """'64 71%, ar 29% (probes 5%)': the forms auto ran at a level, by share of sequence rounds, and the shares of
    rounds its probes and its timings of stale costs took (loadtest's reason_rounds)."""
    if not counts:
        return "-"
    total = sum(counts.values())
    cell = ", ".join(f"{f} {100 * n / total:.0f}%" for f, n in sorted(counts.items(), key=lambda x: -x[1]))
    why = [f"{label} {100 * reasons[key] / total:.0f}%" for key, label in (("probe", "probes"), ("timing", "timings"))
           if reasons and reasons.get(key)]
    return f"{cell} ({', '.join(why)})" if why else cell


def summarize(out: str) -> str:
    """summary.md of OUT_DIR: one row per (configuration, level), throughput relative to ar's at that level (a level
    run twice, e.g. --concurrency 8,1,8, keeps both rows in run order, each against ar's run of the same rank)."""
    run = {}
    if os.path.exists(os.path.join(out, "run.json")):
        with open(os.path.join(out, "run.json")) as f:
            run = json.load(f)
    configs = [m["config"] for m in run.get("configs", [])] or sorted(
        x[:-5] for x in os.listdir(out) if x.endswith(".json") and x not in ("run.json", "prompts.json"))
    data = {}
    for m in configs:
        path = os.path.join(out, f"{m.replace(':', '-')}.json")
        if os.path.exists(path):
            with open(path) as f:
                data[m] = json.load(f)  # sorted by concurrency, a repeated level's rows in run order
    a = run.get("args", {})
    lines = []
    if a:
        prompts = (f"the prompts of {a['prompts_file']}" if a.get("prompts_file") else
                   f"prompt {a['prompt_len']} random token ids")
        lines.append(f"{a['target']} ({a.get('device') or 'no nvidia-smi'}), --max-batch {a['max_batch']}, "
                     f"--max-len {a['max_len']}; {prompts}, {a['max_tokens']} tokens generated per request "
                     f"(ignore_eos), greedy; closed loop, max({a['requests_per_client']} x concurrency, "
                     f"{a['min_requests']}) requests per level.")
        starts = ", ".join(f"{m['config']} {m['startup_s']}s" + (f" (second start {m['restart_s']}s)"
                                                                if "restart_s" in m else "")
                           for m in run.get("configs", []) if "startup_s" in m)
        if starts:
            lines.append(f"Server start to /health 200 (weights loaded or built + compilation): {starts}.")
        compiled = ", ".join(f"{m['config']} {m['compiled_s']}s" for m in run.get("configs", [])
                             if m.get("compiled_s") is not None)
        if compiled:
            lines.append(f"Then every program compiled in the background after: {compiled}.")
        lines.append("")
    lines += ["| config | concurrency | requests | errors | req/s | output tok/s | tok/s vs ar "
              "| latency p50 / p90 / p99 (s) | TTFT p50 (s) | TPOT p50 (ms) | engine TPOT (ms) "
              "| device / admission / host / gc busy "
              "| acceptance | forms (auto) |",
              "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for m in configs:
        for i, r in enumerate(data.get(m, [])):
            c = r["concurrency"]
            rank = sum(x["concurrency"] == c for x in data[m][:i])  # 0, then 1 for a level's second run, ...
            ars = [x for x in data.get("ar", []) if x["concurrency"] == c]
            ar = ars[rank]["output_tokens_per_s"] if rank < len(ars) else None
            tps = r["output_tokens_per_s"]
            lat = " / ".join(_f(r["latency_s"][q]) for q in ("p50", "p90", "p99"))
            tpot, engine = r["tpot_s"]["p50"], r.get("engine_tpot_s")
            lines.append(
                f"| {m} | {c} | {r['requests']} | {r['errors']} | {_f(r['requests_per_s'], '.2f')} | {_f(tps, '.1f')} "
                f"| {_f(tps / ar if tps and ar else None, '.2f')} | {lat} | {_f(r['ttft_s']['p50'])} "
                f"| {_f(tpot * 1000 if tpot is not None else None, '.1f')} "
                f"| {_f(engine * 1000 if engine is not None else None, '.1f')} "
                f"| {_f(r.get('device_busy'), '.2f')} / {_f(r.get('admission_busy'), '.2f')} "
                f"/ {_f(r.get('host_busy'), '.2f')} / {_f(r.get('gc_busy'), '.2f')} "
                f"| {_f(r['mean_acceptance_length'], '.2f')} "
                f"| {_forms(r.get('form_rounds'), r.get('reason_rounds'))} |")
    fails = [f"- {m['config']}: {x}" for m in run.get("configs", []) for x in m.get("failures", [])]
    if fails:
        lines += ["", "Failures:", *fails]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    return text


NEEDS = {"jax": "jax", "starlette": "starlette", "uvicorn": "uvicorn", "sse_starlette": "sse-starlette",
         "prometheus_client": "prometheus-client", "httpx": "httpx"}


def _default_pair(args) -> None:
    """--target default: the default pair's paths (fetched and converted here once), and its held-out prompts."""
    sys.path.insert(0, REPO)
    from ddtree_jax import defaults

    args.target, args.draft = defaults.target_path(), args.draft or defaults.draft_path()
    args.prompts_file = args.prompts_file or os.path.join(REPO, "ddtree_jax", "data", "prompts", "python.json")


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
    args.cache_dir = os.path.abspath(args.cache_dir or os.path.join(args.out, "cache"))
    if args.target == "default":
        _default_pair(args)
    t_start = time.monotonic()
    record = {"args": {k: v for k, v in vars(args).items() if k not in ("out", "summarize")},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "configs": []}
    try:  # the accelerator, for the summary's header (nvidia-smi where there is one)
        record["args"]["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                                  capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        record["args"]["device"] = None
    if args.interleave:
        record["configs"] = run_interleaved(args, t_start + args.time_limit)
    else:
        for i, m in enumerate(args.methods):
            share = (args.time_limit - (time.monotonic() - t_start)) / (len(args.methods) - i)
            record["configs"].append(run_config(args, m, time.monotonic() + share))
            with open(os.path.join(args.out, "run.json"), "w") as f:
                json.dump(record, f, indent=1)
    record["total_s"] = round(time.monotonic() - t_start, 1)
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(summarize(args.out), end="")
    print(f"total {record['total_s']}s; files in {args.out}", file=sys.stderr)
    complete = all(not m["failures"] and len(m["levels"]) == len(args.concurrency) for m in record["configs"])
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
