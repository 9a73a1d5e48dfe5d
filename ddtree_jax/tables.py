"""README's performance tables, rendered from the recorded results (``benchmarks/results/h200.json``).

Each cell is the latest record of its configuration in the current GPU layout (:func:`projection.round_costs`, as
``bench project`` reads them), so a table can be regenerated after a run (``python -m ddtree_jax.bench table``) and
tested against README: a figure there that no record holds fails the tests.

    grid       ms per round (per token for ar) at each prompt and batch; ar against its HBM roofline, every
               round against the AR step of the same prompt and batch
    breakdown  the stage breakdown (draft, tree build, verify, accept + commit) of each method, and each round
               against its floor (max(bytes / copy bandwidth, FLOPs / matmul rate); for ar: the roofline)
    peer       the ratio to the official PyTorch code on the same H200 and shapes (the records' ``peer_ms`` and
               ``peer_ms_range``, set by ``bench models`` for Qwen3-8B at prompt 512, batch 1)
"""

from __future__ import annotations

from ddtree_jax import projection


def _costs(records: list[dict], model: str, prompts: list[int], batches: list[int], budgets: list[int]):
    """[((prompt, batch), {"ar" | "dflash" | "ddtree<B>": record})] in table order."""
    return [((p, b), projection.round_costs(records, model, p, b, budgets)) for p in prompts for b in batches]


def _dates(groups) -> str:
    """The records' dates as one span, e.g. "2026-11-30 06:21-06:31 UTC" (the records' dates are UTC, ISO 8601)."""
    dates = sorted(r["date"] for _, costs in groups for r in costs.values())
    first, last = dates[0][:16].replace("T", " "), dates[-1][:16].replace("T", " ")
    return first + ("-" + last[11:] if last[:10] == first[:10] else " - " + last) + " UTC"


def grid(records: list[dict], model: str, prompts: list[int], batches: list[int], budgets: list[int]) -> str:
    """One model's ms per round at each prompt and batch, as a markdown table with a heading line."""
    groups = _costs(records, model, prompts, batches, budgets)
    head = ["prompt, batch", "ar (vs roofline)", "dflash"] + [f"ddtree {budgets[0]}"] + [str(b) for b in budgets[1:]]
    lines = [f"{model} (records of {_dates(groups)}):", "", "| " + " | ".join(head) + " |",
             "| --- |" + " ---: |" * (len(head) - 1)]
    for (p, b), costs in groups:
        ar = costs["ar"]["ms_per_round"]
        roof = costs["ar"]["roofline_ms"]
        cells = [f"{p}, {b}", f"{ar:.2f} ({ar / roof:.2f}x of {roof:.2f})"]
        cells += [f"{costs[k]['ms_per_round']:.2f} ({costs[k]['ms_per_round'] / ar:.2f})"
                  for k in ["dflash"] + [f"ddtree{x}" for x in budgets]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def breakdown(records: list[dict], models: list[str], prompts: list[int], batches: list[int],
              budgets: list[int]) -> str:
    """The stage breakdown of every method at each model, prompt and batch, as one markdown table."""
    head = ["model", "prompt, batch", "method", "ms / round", "x AR", "draft", "tree", "verify", "accept + commit",
            "round / its floor"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | --- |" + " ---: |" * (len(head) - 3)]
    for model in models:
        for (p, b), costs in _costs(records, model, prompts, batches, budgets):
            ar = costs["ar"]["ms_per_round"]
            for key, r in costs.items():
                ms, bd = r["ms_per_round"], r.get("breakdown_ms") or {}
                floor = r["roofline_ms"] if key == "ar" else r.get("floor_ms")
                stage = [f"{bd[s]:.2f}" if s in bd else "-" for s in ("draft", "tree", "verify", "accept_commit")]
                name = f"ddtree {key[6:]}" if key.startswith("ddtree") else key
                cells = [model, f"{p}, {b}", name, f"{ms:.2f}", f"{ms / ar:.2f}", *stage,
                         f"{ms / floor:.2f}x ({floor:.2f} ms)" if floor else "-"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer(records: list[dict], model: str = "qwen3-8b", prompt: int = 512, batch: int = 1,
         budgets: tuple[int, ...] = (32, 64, 128), middle: int = 64) -> str:
    """How many times faster than the official PyTorch code AR and the ddtree rounds at ``budgets`` are, as one
    markdown sentence fragment (the peer's ddtree round is a range over those budgets)."""
    costs = projection.round_costs(records, model, prompt, batch, list(budgets))
    trees = [costs[f"ddtree{b}"] for b in budgets]
    if "speedup_vs_peer" not in costs["ar"] or any("speedup_vs_peer_range" not in t for t in trees):
        raise ValueError(f"the latest records of {model} at prompt {prompt}, batch {batch} have no peer ratio")
    ms = [t["ms_per_round"] for t in trees]
    lo, hi = min(t["speedup_vs_peer_range"][0] for t in trees), max(t["speedup_vs_peer_range"][1] for t in trees)
    mid = costs[f"ddtree{middle}"]["speedup_vs_peer_range"]
    ar = costs["ar"]
    return (f"AR **{ar['speedup_vs_peer']:.1f}x** faster ({ar['ms_per_round']:.2f} ms), ddtree rounds "
            f"at budgets {budgets[0]}-{budgets[-1]} **{lo:.1f}-{hi:.1f}x** ({min(ms):.2f}-{max(ms):.2f} ms; budget "
            f"{middle}: {mid[0]:.1f}-{mid[1]:.1f}x)")
