"""Projected speedups: the DDTree paper's mean acceptance lengths x our measured round costs.

A projection, not a measurement. With random weights every round accepts about one token, so the benchmark
measures what a round costs, not how much it accepts. A trained pair that accepts tau tokens per round on
average would decode at

    speedup over AR = tau x (AR ms per token / round ms)

(rounds are static shapes: their cost does not depend on what they accept). tau comes from the paper's table
(``benchmarks/paper_tau.json``: per temperature, model and dataset, the chain DFlash's and DDTree's tau and the
paper's own measured speedup); the round costs from our records (``benchmarks/results/h200.json``). The paper's
DDTree tau is at its best node budget of 16..1024 for each dataset (not given), so pairing it with our round cost
at budget 64 or 256 assumes that budget accepts as much.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddtree_jax import policy

REPO = Path(__file__).resolve().parents[1]
PAPER_TAU = REPO / "benchmarks" / "paper_tau.json"
RESULTS = REPO / "benchmarks" / "results" / "h200.json"
# the target's layout, per method, of the records the performance tables read: decode's GPU defaults
# (weight_layout.GPU_AR_LAYOUT for ar, weight_layout.GPU_LAYOUT for the rounds; tests/test_decode.py checks that they
# agree)
LAYOUTS = {"ar": "stacked-out-major-fused", "dflash": "stacked-fused", "ddtree": "stacked-fused"}
# ... and the drafter's layouts of the records the tables read, preferred first: weight_layout.DRAFT_GPU_LAYOUT, then
# "stacked" (input-major, the earlier default; records without the field) for records not measured again.
DRAFT_LAYOUTS = ("stacked-out-major-fused", "stacked")


def load_json(path: str | Path, what: str):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not JSON: {e}") from None


def load_tau(path: str | Path = PAPER_TAU) -> dict:
    """{temperature: {model: {dataset: {"dflash"|"ddtree": {"tau", "speedup"}}}}} from the paper's table."""
    table = load_json(path, "the tau table")
    temps = table.get("temperatures") if isinstance(table, dict) else None
    if not isinstance(temps, dict) or not temps:
        raise ValueError(f"{path} has no 'temperatures' table")
    try:
        for t, models in temps.items():
            for model, rows in models.items():
                for dataset, row in rows.items():
                    for method in ("dflash", "ddtree"):
                        tau = row.get(method, {}).get("tau")
                        if not isinstance(tau, (int, float)) or tau < 1:
                            raise ValueError(f"{path}: {t}/{model}/{dataset}/{method} has no tau >= 1")
    except AttributeError:  # a level that is not an object
        raise ValueError(f"{path} is not laid out as {{temperature: {{model: {{dataset: {{method: {{tau}}}}}}}}}}") from None
    return temps


def round_costs(records: list[dict], model: str, prompt_len: int, batch: int, budgets: list[int],
                layouts: dict[str, str] | None = LAYOUTS,
                draft_layouts: tuple[str, ...] | None = DRAFT_LAYOUTS) -> dict[str, dict]:
    """The latest record of AR, dflash and ddtree at each budget for one model, prompt and batch, each method's in
    its target layout of ``layouts`` (None: any) and all in one drafter layout, the first of ``draft_layouts`` that
    has them all (None: any): {"ar" | "dflash" | "ddtree<B>": record}. Raises ValueError naming what is missing (in
    the drafter layout that lacks the fewest)."""
    want = [("ar", None), ("dflash", None)] + [("ddtree", b) for b in budgets]
    fewest: list[str] | None = None
    for draft_layout in draft_layouts or (None,):
        out, missing = {}, []
        for method, budget in want:
            hits = [r for r in records if (r.get("model"), r.get("method"), r.get("budget"), r.get("batch"),
                                           r.get("prompt_len")) == (model, method, budget, batch, prompt_len)
                    and (layouts is None or r.get("layout") == layouts[method])
                    and (draft_layout is None or r.get("draft_layout", "stacked") == draft_layout)
                    and r.get("ms_per_round")]
            if hits:
                out[f"{method}{budget or ''}"] = max(hits, key=lambda r: r.get("date", ""))
            else:
                missing.append(f"{method}{budget or ''}")
        if not missing:
            return out
        if fewest is None or len(missing) < len(fewest):
            fewest = missing
    raise ValueError(f"no record of {model} in its layouts at prompt {prompt_len}, batch {batch} for "
                     f"{', '.join(fewest)}")


def speedup(tau: float, ar_ms: float, round_ms: float) -> float:
    """Tokens per round over rounds per AR token: tau x AR ms / round ms."""
    return tau * ar_ms / round_ms


def project(taus: dict, costs: dict[str, dict], budgets: list[int]) -> list[dict]:
    """One row per dataset of one model and temperature (``taus``: {dataset: row of the paper}): the paper's tau and
    speedups, and the projected speedups of dflash and of ddtree at each budget."""
    ar = costs["ar"]["ms_per_round"]
    rows = []
    for dataset, paper in taus.items():
        row = {"dataset": dataset, "tau_dflash": paper["dflash"]["tau"], "tau_ddtree": paper["ddtree"]["tau"],
               "paper_dflash": paper["dflash"].get("speedup"), "paper_ddtree": paper["ddtree"].get("speedup"),
               "dflash": speedup(paper["dflash"]["tau"], ar, costs["dflash"]["ms_per_round"])}
        for b in budgets:
            row[f"ddtree{b}"] = speedup(paper["ddtree"]["tau"], ar, costs[f"ddtree{b}"]["ms_per_round"])
        rows.append(row)
    return rows


def choices(taus: dict, costs_ms: dict[str, float]) -> dict[str, dict]:
    """What ``--tree-budget auto`` would pick at batch 1 for each dataset of one model (``taus``: {dataset: row of the
    paper}) from round costs ``costs_ms`` ({form: ms a round}, e.g. {"ar": 3.6, "chain": 16.7, "64": 20.8}), were every
    form's expected acceptance the paper's tau (the chain: dflash's; every tree: ddtree's at its best budget, so small
    trees are credited with more than they accept): {dataset: {"choice": form, "tokens_per_s": {form: x}}}."""
    out = {}
    forms = tuple(costs_ms)
    for dataset, paper in taus.items():
        chooser = policy.Policy(forms, ())
        chooser.prior = policy.Estimate(preds={f: paper["dflash" if f == policy.CHAIN else "ddtree"]["tau"]
                                               for f in forms if f != policy.AR}, observed=True)
        options = {(f, 1): ms / 1e3 for f, ms in costs_ms.items()}
        form, _ = chooser.choose([0], options)
        out[dataset] = {"choice": form, "tokens_per_s": {f: round(chooser.total([0], f) / options[f, 1], 1)
                                                         for f in forms}}
    return out


def markdown(model: str, costs: dict[str, dict], rows: list[dict], budgets: list[int]) -> str:
    """The rows as a markdown table, the round costs they use in its heading."""
    ar = costs["ar"]["ms_per_round"]
    ratio = {k: costs[k]["ms_per_round"] / ar for k in ["dflash"] + [f"ddtree{b}" for b in budgets]}
    head = (["dataset", "τ dflash", "τ ddtree", f"dflash ({ratio['dflash']:.2f}x)"]
            + [f"ddtree {b} ({ratio[f'ddtree{b}']:.2f}x)" for b in budgets] + ["paper: dflash", "ddtree"])
    lines = [f"{model}: AR {ar:.2f} ms per token; a round's cost in AR steps in brackets",
             "| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in rows:
        cells = ([r["dataset"], f"{r['tau_dflash']:.2f}", f"{r['tau_ddtree']:.2f}", f"{r['dflash']:.1f}x"]
                 + [f"{r[f'ddtree{b}']:.1f}x" for b in budgets]
                 + [f"{r['paper_dflash']:.2f}x" if r["paper_dflash"] else "-",
                    f"{r['paper_ddtree']:.2f}x" if r["paper_ddtree"] else "-"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
