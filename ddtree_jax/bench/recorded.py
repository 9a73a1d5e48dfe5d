"""``bench project`` and ``bench table``: what the recorded results of ``bench models``
(benchmarks/results/h200.json) say, as the projected speedups of ddtree_jax.projection and README's tables of
ddtree_jax.tables."""

from __future__ import annotations

from ddtree_jax import cli, projection, tables
from ddtree_jax.bench.records import write_json


def load_records(path: str) -> list[dict]:
    """The records of `bench models` in ``path`` (a JSON list of objects); a usage error otherwise."""
    records = projection.load_json(path, "the results file")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise cli.UsageError(f"{path} is not a JSON list of records (the output of `bench models`)")
    return records


def project(args) -> int:
    """Print the projection tables (markdown) of ddtree_jax.projection for each model; --json writes the rows."""
    temps = projection.load_tau(args.tau)
    if args.temperature not in temps:
        raise cli.UsageError(f"--temperature {args.temperature} is not in {args.tau} (has {', '.join(temps)})")
    records = load_records(args.results)
    out = []
    for model in args.models:
        if model not in temps[args.temperature]:
            raise cli.UsageError(f"{args.tau} has no {model} (has {', '.join(temps[args.temperature])})")
        costs = projection.round_costs(records, model, args.prompt, args.batch, args.budgets)
        rows = projection.project(temps[args.temperature][model], costs, args.budgets)
        print(projection.markdown(model, costs, rows, args.budgets) + "\n")
        out.append({"model": model, "temperature": args.temperature, "prompt_len": args.prompt, "batch": args.batch,
                    "round_ms": {k: r["ms_per_round"] for k, r in costs.items()},
                    "round_dates": {k: r["date"] for k, r in costs.items()}, "rows": rows})
    print(f"A projection, not a measurement: tau (the paper's, temperature {args.temperature}) x AR ms / round ms "
          f"from {args.results}; the paper's ddtree tau is at its best budget per dataset.")
    if args.json:
        write_json(args.json, out)
    return 0


def table(args) -> int:
    """Print the grid table of each model, the breakdown table and the peer ratios (ddtree_jax.tables)."""
    records = load_records(args.results)
    for model in args.models:
        print(tables.grid(records, model, args.prompts, args.batches, args.budgets) + "\n")
    print(tables.breakdown(records, args.models, args.prompts, args.batches, args.budgets))
    print("\nAgainst the official PyTorch code (qwen3-8b, prompt 512, batch 1): " + tables.peer(records))
    return 0
