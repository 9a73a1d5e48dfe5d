"""The performance tables of docs/PERFORMANCE.md and README.md rendered from the records (ddtree_jax.tables,
``bench table``; the default pair's from its ``bench pair`` records)."""

import json
from pathlib import Path

import pytest

from ddtree_jax import bench, projection, tables

ROOT = Path(__file__).parents[1]
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
RESULTS = ROOT / "benchmarks" / "results"
# the default pair's records shown, in table order: (file, key or None for the whole file, the rows' label, the
# drafter: "first" shipped until 2026-12-05 14:00, "second" until 17:40, "third" until 2026-12-06 07:55, "fourth"
# until 10:40, "fifth" until 15:45, "sixth" until 17:50, "seventh" until 20:26, "eighth" since)
PAIR_RECORDS = [("default_pair_h200.json", "batch1_budgets_32_64", "H200, batch 1", "first"),
                ("default_pair_h200.json", "batch1_budgets_16_128_256", "H200, batch 1", "first"),
                ("auto_pair_h200.json", "at_2026-12-05", "H200, batch 1", "first"),
                ("default_pair_h200.json", "batch8_budget_64", "H200, batch 8", "first"),
                ("default_pair_cpu.json", None, "2 CPU cores, batch 1", "first"),
                ("auto_pair_h100.json", "at_e5c796b", "H100, batch 1", "third"),
                ("auto_pair_h100.json", "at_2a585b9", "H100, batch 1", "third"),
                ("auto_pair_cpu.json", "at_2026-12-05", "2 CPU cores, batch 1", "third"),
                ("auto_pair_h100.json", "at_bd6b719", "H100, batch 1", "third"),
                ("auto_pair_h200.json", "at_d4b10bc", "H200, batch 1", "fourth"),
                ("auto_pair_h200.json", "at_3a82b79", "H200, batch 1", "fourth"),
                ("auto_pair_h200.json", "at_3a82b79_layer_unroll_30", "H200, batch 1", "fourth"),
                ("auto_pair_cpu.json", "at_1b07b35", "2 CPU cores, batch 1", "fifth"),
                ("auto_pair_h100.json", "at_c04a464", "H100, batch 1", "sixth"),
                ("auto_pair_h100.json", "at_8499030", "H100, batch 1", "eighth")]
PAIR_ROW_STARTS = ("| H200, batch", "| H100, batch", "| 2 CPU")


def headline_rows() -> list[str]:
    """README's round-cost rows: per model, at prompt 512 and batch 1, AR ms (x its roofline) and the dflash, ddtree 64
    and ddtree 256 rounds' ms (x the AR step), from the records `bench table` reads."""
    records = json.loads(projection.RESULTS.read_text())
    rows = []
    for model, name in (("qwen3-8b", "Qwen3-8B"), ("qwen3-4b", "Qwen3-4B")):
        costs = projection.round_costs(records, model, 512, 1, [64, 256])
        ar = costs["ar"]["ms_per_round"]
        cells = [f"{ar:.2f} ({ar / costs['ar']['roofline_ms']:.2f}x)"] + [
            f"{costs[k]['ms_per_round']:.2f} ({costs[k]['ms_per_round'] / ar:.2f}x)" for k in ("dflash", "ddtree64", "ddtree256")]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows

def pair_rows() -> list[str]:
    """The default pair's table rows, one per method of each record: | device, batch | drafter | date | method | tau |
    tok/s | vs AR |, each method against the AR of its own process."""
    rows = []
    for name, key, label, drafter in PAIR_RECORDS:
        record = json.loads((RESULTS / name).read_text())
        record = record[key] if key else record
        for method, m in record["methods"].items():
            tau = m.get("mean_acceptance_length")
            rows.append(f"| {label} | {drafter} | {record['date'][:16].replace('T', ' ')} | {method.replace('-', ' ')} | "
                        f"{'-' if tau is None else f'{tau:.2f}'} | {m['tokens_per_s']:,.1f} | {m['speedup']:.2f}x |")
    return rows


def _rec(method, budget, ms, batch=1, date="2026-11-30T06:21:00+00:00", **extra):
    return {"model": "m", "method": method, "budget": budget, "batch": batch, "prompt_len": 512, "ms_per_round": ms,
            "date": date, "layout": projection.LAYOUTS[method], **extra}


RECORDS = [
    _rec("ar", None, 6.0, roofline_ms=5.0, breakdown_ms={"verify": 5.9, "accept_commit": 0.3}),
    _rec("ar", None, 4.0, date="2026-11-30T06:31:00+00:00", roofline_ms=3.2,
         breakdown_ms={"verify": 3.9, "accept_commit": 0.2}),  # the latest AR record is the one shown
    _rec("dflash", None, 6.0, floor_ms=5.0,
         breakdown_ms={"draft": 1.0, "tree": 0.1, "verify": 4.5, "accept_commit": 0.5}),
    _rec("ddtree", 64, 7.0, floor_ms=5.6,
         breakdown_ms={"draft": 1.2, "tree": 0.2, "verify": 5.0, "accept_commit": 0.4}),
]


def test_grid_shows_the_latest_records_against_the_roofline_and_the_ar_step():
    text = tables.grid(RECORDS, "m", [512], [1], [64])
    assert text.splitlines()[0] == "m (records of 2026-11-30 06:21-06:31 UTC):"
    assert "| 512, 1 | 4.00 (1.25x of 3.20) | 6.00 (1.50) | 7.00 (1.75) |" in text
    with pytest.raises(ValueError, match="batch 8 for ar, dflash, ddtree64$"):
        tables.grid(RECORDS, "m", [512], [8], [64])  # nothing recorded at batch 8


def test_breakdown_shows_every_stage_and_the_round_against_its_floor():
    rows = tables.breakdown(RECORDS, ["m"], [512], [1], [64]).splitlines()[2:]
    assert rows == ["| m | 512, 1 | ar | 4.00 | 1.00 | - | - | 3.90 | 0.20 | 1.25x (3.20 ms) |",
                    "| m | 512, 1 | dflash | 6.00 | 1.50 | 1.00 | 0.10 | 4.50 | 0.50 | 1.20x (5.00 ms) |",
                    "| m | 512, 1 | ddtree 64 | 7.00 | 1.75 | 1.20 | 0.20 | 5.00 | 0.40 | 1.25x (5.60 ms) |"]


def test_peer_ratios_span_the_budgets_and_name_a_missing_ratio():
    trees = ((32, 5.0), (64, 6.0), (128, 8.0))
    records = [_rec("ar", None, 4.0, speedup_vs_peer=20.0), _rec("dflash", None, 6.0)] + [
        _rec("ddtree", b, ms, speedup_vs_peer_range=[100 / ms, 110 / ms]) for b, ms in trees]
    assert tables.peer(records, model="m") == ("AR **20.0x** faster (4.00 ms), ddtree rounds at budgets 32-128 "
                                               "**12.5-22.0x** (5.00-8.00 ms; budget 64: 16.7-18.3x)")
    with pytest.raises(ValueError, match="no peer ratio"):
        tables.peer(records[1:] + [_rec("ar", None, 4.0)], model="m")


def test_bench_table_bad_results_file_is_one_line(capsys, tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text('{"not": "a list"}')
    for results in (str(bad), "/no/such/file.json"):
        assert bench.main(["table", "--results", results]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:")


def test_the_performance_page_shows_what_bench_table_prints_from_the_recorded_results(capsys):
    """docs/PERFORMANCE.md's grid and breakdown tables and the peer ratios are `bench table`'s output on the shipped
    records: a new record without a docs update fails here (as the projection's test does for its tables)."""
    page = PERFORMANCE.read_text()
    assert bench.main(["table"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| ", "qwen3"))]
    assert len(lines) == 2 * (1 + 2 + 4) + 2 + 2 * 4 * 8  # two grids (heading, header, 4 rows), 64 breakdown rows
    missing = [line for line in lines if line not in page]
    assert not missing, missing
    # the peer sentence, wrapped
    assert tables.peer(json.loads(projection.RESULTS.read_text())) in " ".join(page.split())


def test_the_default_pairs_tables_are_its_records():
    """docs/PERFORMANCE.md's default-pair table is the `bench pair` records row for row, and every row README shows
    is one of them."""
    rows = pair_rows()
    assert len(rows) == 4 + 5 + 8 + 3 + 7 + 5 + 5 + 5 + 5 + 5 + 5 + 5 + 5 + 8 + 5
    page_rows = [line for line in PERFORMANCE.read_text().splitlines() if line.startswith(PAIR_ROW_STARTS)]
    assert page_rows == rows
    readme_rows = [line for line in (ROOT / "README.md").read_text().splitlines()
                   if line.startswith(PAIR_ROW_STARTS)]
    assert readme_rows and set(readme_rows) <= set(rows), set(readme_rows) - set(rows)


def test_the_readme_headline_is_the_records():
    """README's round-cost rows and peer ratios come from the same records as docs/PERFORMANCE.md's tables."""
    readme = (ROOT / "README.md").read_text()
    missing = [row for row in headline_rows() if row not in readme]
    assert not missing, missing
    assert tables.peer(json.loads(projection.RESULTS.read_text())) in " ".join(readme.split())


def test_the_readme_pair_under_load_is_its_record():
    """README's table of the default pair under load: each tree's ratios (fixed and auto) and AR's tokens/s are the
    load record's steady-state run, level by level."""
    record = json.loads((ROOT / "benchmarks" / "results" / "load_pair_h100.json").read_text())
    run = record["runs"]["offset_costs_at_66614ea"]
    levels = sorted({r["concurrency"] for r in run["results"]})
    at = {(r["config"], r["concurrency"]): r for r in run["results"]}
    want = ["| AR tok/s | " + " | ".join(f"{at['ar', c]['output_tokens_per_s']:,.1f}" for c in levels) + " |"]
    want += [f"| ddtree {name} | " + " | ".join(f"{at[config, c]['vs_ar']:.2f}x" for c in levels) + " |"
             for name, config in (("16", "ddtree:16"), ("32", "ddtree:32"), ("auto", "ddtree"))]
    readme = (ROOT / "README.md").read_text().splitlines()
    assert all(row in readme for row in want), [row for row in want if row not in readme]
