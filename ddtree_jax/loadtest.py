"""``python -m ddtree_jax.loadtest``: throughput and latency of a running server at several concurrencies.

For each concurrency c (default 1, 2, 4, 8, 16, 32), c clients send streamed ``/v1/completions`` requests
back to back (closed loop) until ``--requests`` requests have finished; every request has a random
token-id prompt of ``--prompt-len`` tokens and generates exactly ``--max-tokens`` tokens (``ignore_eos``),
so runs of ar, dflash and ddtree servers do the same work. With ``--prompts-file`` the prompts are that file's
instead, in turn: text (sent as one user message to ``/v1/chat/completions``, for a server with a tokenizer and a
chat template) or token ids (``/v1/completions``). Reported per level:

    output tok/s         generated tokens of the level / its wall time
    req/s                finished requests / wall time
    latency p50/p90/p99  submission to last token, seconds
    ttft p50/p90/p99     submission to first token, seconds
    tpot p50             (latency - ttft) / (tokens - 1): time per output token after the first
    acceptance           committed tokens per sequence round over the level, from the server's /metrics
    form_rounds          (--tree-budget auto) sequence rounds by the form they took, from /metrics
    slot_batch_steps     steps by the slot batch of the program that ran them, from /metrics
    reason_rounds        (--tree-budget auto) sequence rounds by why their program ran (policy, probe, timing)
    round_ms             at the level's end, the policy's cost of a round ('FORM@BATCH/VARIANT': ms) of each program
                         at the slot batches the level stepped, from /metrics (what its choices weighed)
    timed_ms             ... and each one's timing, without the offset the steps add to every cost
                         (ddtree_jax/costs.py)
    expected_tokens      (--tree-budget auto) the policy's expected tokens a round per sequence of each form, the
                         mean over the level's choices, from /metrics (beside round_ms: why it chose what it did)
    engine tpot          the engine's own time per token of one sequence, from /metrics: its rounds' mean wall time
                         (device step seconds / the batch's rounds) over the acceptance; TPOT over it is what the
                         server (HTTP, scheduling, admissions, detokenising) adds
    device busy          device step seconds / the level's wall time
    host busy            the engine thread's seconds at work between device calls (choices, statistics, deliveries,
                         admissions) / the level's wall time: near 1, the host paces the server, not the device
    admission busy       the step thread's waits for the prefills and inserts of the requests joining a step / the
                         level's wall time: device work outside the steps
    gc busy, gc full     seconds in Python's garbage collector (every thread stopped) / the level's wall time, and
                         its collections of the oldest generation (the ones that scan every tracked object)

Example (start the server first, e.g. with random Qwen3-8B-shaped weights):
    python -m ddtree_jax.loadtest --url http://127.0.0.1:8000 --concurrency 1,2,4,8,16,32 --json > load.json

Needs ``httpx`` (installed with the ``test`` extra, or ``pip install httpx``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import sys
import time
from typing import Any, Sequence

from ddtree_jax import cli


@dataclasses.dataclass
class Sample:
    latency: float
    ttft: float | None
    tokens: int
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


async def _one(client, url: str, body: dict) -> Sample:
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    endpoint = "chat/completions" if "messages" in body else "completions"
    try:
        async with client.stream("POST", f"{url}/v1/{endpoint}", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return Sample(time.perf_counter() - t0, None, 0, f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Sample(time.perf_counter() - t0, ttft, tokens, str(chunk["error"].get("message")))
                for c in chunk.get("choices", []):
                    n = len(c.get("token_ids") or [])
                    if n and ttft is None:
                        ttft = time.perf_counter() - t0
                    tokens += n
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not the end of the run
        return Sample(time.perf_counter() - t0, ttft, tokens, f"{type(e).__name__}: {e}")
    return Sample(time.perf_counter() - t0, ttft, tokens)


def _scrape(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


async def _metrics(client, url: str) -> dict[str, float]:
    try:
        r = await client.get(f"{url}/metrics")
        return _scrape(r.text) if r.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - metrics are optional
        return {}


def load_prompts(path: str) -> list[str] | list[list[int]]:
    """A prompts file: a JSON list of strings or of token-id lists, or a text file of one prompt a line."""
    with open(path) as f:
        text = f.read()
    try:
        prompts = json.loads(text)
    except ValueError:
        prompts = [line for line in text.splitlines() if line.strip()]
    ok = isinstance(prompts, list) and prompts and (all(isinstance(p, str) and p for p in prompts) or all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts))
    if not ok:
        raise ValueError(f"{path}: expected a JSON list of strings or of token-id lists, or one prompt a line")
    return prompts


async def run_level(url: str, model: str | None, concurrency: int, requests: int, prompt_len: int, max_tokens: int,
                    *, temperature: float = 0.0, vocab: tuple[int, int] = (100, 1000), seed: int = 0,
                    timeout: float = 600.0, prompts: list | None = None) -> dict[str, Any]:
    """One concurrency level: ``requests`` requests from ``concurrency`` closed-loop clients; their prompts random
    token ids, or ``prompts`` in turn (text: chat completions; token ids: completions)."""
    import httpx

    rng = random.Random(seed * 1000 + concurrency)
    bodies = []
    for i in range(requests):
        body = {"max_tokens": max_tokens, "temperature": temperature, "seed": seed + i, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        if prompts is None:
            body["prompt"] = [rng.randrange(*vocab) for _ in range(prompt_len)]
        elif isinstance(prompts[i % len(prompts)], str):
            body["messages"] = [{"role": "user", "content": prompts[i % len(prompts)]}]
        else:
            body["prompt"] = prompts[i % len(prompts)]
        if model:
            body["model"] = model
        bodies.append(body)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        before = await _metrics(client, url)
        queue = list(reversed(bodies))
        samples: list[Sample] = []

        async def worker():
            while queue:
                samples.append(await _one(client, url, queue.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = await _metrics(client, url)

    ok = [s for s in samples if s.error is None]
    tokens = sum(s.tokens for s in ok)
    lat = [s.latency for s in ok]
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [(s.latency - s.ttft) / (s.tokens - 1) for s in ok if s.ttft is not None and s.tokens > 1]

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    rounds, committed = grew("ddtree_sequence_rounds_total"), grew("ddtree_committed_tokens_total")
    step_s, batch_rounds = grew("ddtree_step_seconds_total"), grew("ddtree_batch_rounds_total")
    host_s, admit_s = grew("ddtree_host_seconds_total"), grew("ddtree_admission_wait_seconds_total")
    gc_s = sum(grew(f'ddtree_gc_pause_seconds_total{{generation="{g}"}}') for g in range(3))
    prefix = "ddtree_form_sequence_rounds_total{form=\""  # --tree-budget auto: sequence-rounds by form
    forms = {k[len(prefix):-2]: v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix)}
    prefix = "ddtree_reason_sequence_rounds_total{reason=\""  # ... by why: the policy's choice, a probe, a timing
    reasons = {k[len(prefix):-2]: v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix)}
    prefix = "ddtree_slot_batch_steps_total{batch=\""  # steps by the slot batch they ran at
    batches = {int(k[len(prefix):-2]): v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix)}
    prefix, choices = "ddtree_policy_expected_tokens_total{form=\"", grew("ddtree_policy_choices_total")
    expected = {k[len(prefix):-2]: round((v - before.get(k, 0)) / choices, 3) for k, v in after.items()
                if k.startswith(prefix) and choices}  # the mean over the level's choices
    costs, timed = {}, {}  # the cost table at the level's end, at the slot batches it stepped; each one's timing
    for k, v in after.items():
        for name, into in (("ddtree_program_round_seconds{", costs), ("ddtree_program_timed_round_seconds{", timed)):
            if k.startswith(name):
                labels = dict(re.findall(r'(\w+)="([^"]*)"', k))
                if batches.get(int(labels["batch"])):
                    into[f"{labels['form']}@{labels['batch']}/{labels['variant']}"] = round(1e3 * v, 4)
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if s.error), None),
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else None,
        "requests_per_s": len(ok) / wall if wall > 0 else None,
        "latency_s": {f"p{q}": percentile(lat, q) for q in (50, 90, 99)},
        "ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
        "tpot_s": {"p50": percentile(tpot, 50)},
        "mean_acceptance_length": committed / rounds if rounds else None,
        "engine_tpot_s": step_s / batch_rounds / (committed / rounds) if batch_rounds and committed else None,
        "device_busy": step_s / wall if wall > 0 else None,
        "host_busy": host_s / wall if wall > 0 else None,  # the engine thread's work between device calls
        "admission_busy": admit_s / wall if wall > 0 else None,  # the step thread's waits for joiners' prefills
        "gc_busy": gc_s / wall if wall > 0 else None,  # Python's garbage collector, every thread stopped
        "gc_full": grew('ddtree_gc_collections_total{generation="2"}'),  # its collections of the oldest generation
        "form_rounds": {f: n for f, n in forms.items() if n} or None,
        "reason_rounds": {f: n for f, n in reasons.items() if n} or None,
        "slot_batch_steps": {b: n for b, n in sorted(batches.items()) if n} or None,
        "round_ms": dict(sorted(costs.items())) or None,
        "timed_ms": dict(sorted(timed.items())) or None,
        "expected_tokens": dict(sorted(expected.items())) or None,
    }


def run_load(url: str, *, model: str | None = None, concurrency: Sequence[int] = (1, 2, 4, 8, 16, 32),
             requests: int | None = None, prompt_len: int = 128, max_tokens: int = 128, temperature: float = 0.0,
             vocab: tuple[int, int] = (100, 1000), seed: int = 0, warmup: int = 1,
             progress=None, prompts: list | None = None) -> list[dict[str, Any]]:
    """Every level in turn (after ``warmup`` untimed requests); a list of run_level results.
    ``requests`` defaults to max(4 * c, 16) per level."""
    url = url.rstrip("/")
    if warmup:
        asyncio.run(run_level(url, model, 1, warmup, prompt_len, max_tokens, temperature=temperature, vocab=vocab,
                              seed=seed + 99, prompts=prompts))
    results = []
    for c in concurrency:
        n = requests if requests is not None else max(4 * c, 16)
        res = asyncio.run(run_level(url, model, c, n, prompt_len, max_tokens, temperature=temperature,
                                    vocab=vocab, seed=seed, prompts=prompts))
        results.append(res)
        if progress is not None:
            progress(res)
    return results


def format_table(results: list[dict[str, Any]]) -> str:
    """A Markdown table of run_load results (for the README)."""
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    lines = ["| concurrency | requests | errors | output tok/s | req/s | latency p50 / p90 / p99 (s) | "
             "TTFT p50 / p90 / p99 (s) | TPOT p50 (ms) | engine TPOT (ms) | acceptance |",
             "|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in results:
        lat, ttft = r["latency_s"], r["ttft_s"]
        tpot, engine = r["tpot_s"]["p50"], r.get("engine_tpot_s")
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['errors']} | {f(r['output_tokens_per_s'], '.1f')} | "
            f"{f(r['requests_per_s'], '.2f')} | {f(lat['p50'])} / {f(lat['p90'])} / {f(lat['p99'])} | "
            f"{f(ttft['p50'])} / {f(ttft['p90'])} / {f(ttft['p99'])} | "
            f"{f(tpot * 1000 if tpot is not None else None, '.2f')} | "
            f"{f(engine * 1000 if engine is not None else None, '.2f')} | {f(r['mean_acceptance_length'], '.2f')} |")
    return "\n".join(lines)


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m ddtree_jax.loadtest",
                           description="Load-test a running ddtree_jax server (or any OpenAI-compatible server "
                                       "that accepts token-id prompts, ignore_eos and return_token_ids): "
                                       "throughput and latency percentiles per concurrency level.",
                           epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    p.add_argument("--model", default=None, help="model id to send (default: none, the server's own)")
    p.add_argument("--concurrency", type=cli.int_list, default=[1, 2, 4, 8, 16, 32], metavar="LIST",
                   help="comma-separated concurrency levels (default: 1,2,4,8,16,32)")
    p.add_argument("--requests", type=cli.positive_int, default=None, metavar="N",
                   help="requests per level (default: max(4 x concurrency, 16))")
    p.add_argument("--prompt-len", type=cli.positive_int, default=128, metavar="N",
                   help="prompt tokens per request (default: 128)")
    p.add_argument("--prompts-file", default=None, metavar="PATH",
                   help="prompts to send in turn instead of random token ids: a JSON list of strings (sent as chat "
                        "messages; the server needs a tokenizer) or of token-id lists, or a text file of one prompt "
                        "a line (e.g. ddtree_jax/data/prompts/python.json)")
    p.add_argument("--max-tokens", type=cli.positive_int, default=128, metavar="N",
                   help="generated tokens per request (default: 128)")
    p.add_argument("--temperature", type=cli.nonneg_float, default=0.0, help="sampling temperature (default: 0)")
    p.add_argument("--vocab", type=cli.int_list, default=[100, 1000], metavar="LO,HI",
                   help="prompt token ids are drawn from [LO, HI) (default: 100,1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the requests (default: 0)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON list instead of a table")
    return p


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.vocab) != 2 or args.vocab[0] >= args.vocab[1]:
        raise cli.UsageError(f"--vocab wants LO,HI with LO < HI, got {args.vocab}")
    if any(c < 1 for c in args.concurrency):
        raise cli.UsageError("--concurrency levels must be >= 1")
    prompts = None
    if args.prompts_file is not None:
        try:
            prompts = load_prompts(args.prompts_file)
        except OSError as e:
            raise cli.UsageError(f"--prompts-file: {e}") from None
        except ValueError as e:
            raise cli.UsageError(f"--prompts-file {e}") from None
    try:
        import httpx
    except ImportError:
        raise cli.UsageError("the load test needs httpx: pip install httpx") from None
    url = args.url.rstrip("/")
    try:
        health = httpx.get(f"{url}/health", timeout=10)
    except httpx.HTTPError as e:
        raise cli.UsageError(f"no server at {url}: {e}") from None
    if health.status_code != 200:
        raise cli.UsageError(f"the server at {url} is not ready: /health says {health.status_code} {health.text}")

    def progress(r):
        cli.info(f"concurrency {r['concurrency']}: {r['output_tokens_per_s'] or 0:.1f} tok/s, "
                 f"p50 latency {r['latency_s']['p50'] or 0:.3f}s, {r['errors']} errors"
                 + (f" (first: {r['first_error']})" if r["errors"] else ""))

    results = run_load(url, model=args.model, concurrency=args.concurrency, requests=args.requests,
                       prompt_len=args.prompt_len, max_tokens=args.max_tokens, temperature=args.temperature,
                       vocab=(args.vocab[0], args.vocab[1]), seed=args.seed, progress=progress, prompts=prompts)
    print(json.dumps(results, indent=1) if args.json else format_table(results))
    return cli.EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
