"""README's performance tables rendered from the records (ddtree_jax.tables, ``bench table``)."""

import json
from pathlib import Path

import pytest

from ddtree_jax import bench, projection, tables


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


def test_the_readme_shows_what_bench_table_prints_from_the_recorded_results(capsys):
    """README's grid and breakdown tables and the peer ratios are `bench table`'s output on the shipped records: a
    new record without a README update fails here (as the projection's test does for its tables)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert bench.main(["table"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| ", "qwen3"))]
    assert len(lines) == 2 * (1 + 2 + 4) + 2 + 2 * 4 * 8  # two grids (heading, header, 4 rows), 64 breakdown rows
    missing = [line for line in lines if line not in readme]
    assert not missing, missing
    # the peer sentence, wrapped in README
    assert tables.peer(json.loads(projection.RESULTS.read_text())) in " ".join(readme.split())
