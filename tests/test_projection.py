"""The projected-speedup table: the paper's acceptance lengths x recorded round costs (ddtree_jax.projection)."""

import json

import pytest

from ddtree_jax import bench, projection


def _rec(method, budget, ms, date="2026-11-30T00:00:00+00:00", model="m", layout=None, batch=1):
    return {"model": model, "method": method, "budget": budget, "batch": batch, "prompt_len": 512,
            "ms_per_round": ms, "date": date, "layout": layout or projection.LAYOUTS[method]}


def test_speedup_is_tau_times_ar_over_round():
    records = [_rec("ar", None, 5.0), _rec("dflash", None, 7.5), _rec("ddtree", 64, 8.0)]
    costs = projection.round_costs(records, "m", 512, 1, [64])
    taus = {"d": {"dflash": {"tau": 6.0, "speedup": 4.0}, "ddtree": {"tau": 8.0, "speedup": 5.5}}}
    (row,) = projection.project(taus, costs, [64])
    assert row["dflash"] == pytest.approx(6.0 * 5.0 / 7.5) and row["ddtree64"] == pytest.approx(8.0 * 5.0 / 8.0)
    assert (row["paper_dflash"], row["paper_ddtree"]) == (4.0, 5.5)
    text = projection.markdown("m", costs, [row], [64])
    assert "| d | 6.00 | 8.00 | 4.0x | 5.0x | 4.00x | 5.50x |" in text and "dflash (1.50x)" in text


def test_round_costs_take_the_latest_record_of_the_layout_and_name_what_is_missing():
    records = [_rec("ar", None, 5.0, "2026-11-29T00:00:00+00:00"), _rec("ar", None, 4.0, "2026-11-30T00:00:00+00:00"),
               _rec("ar", None, 1.0, "2026-12-01T00:00:00+00:00", layout="unstacked"),
               _rec("ddtree", 64, 1.0, "2026-12-01T00:00:00+00:00", layout=projection.LAYOUTS["ar"]),  # not AR's
               _rec("dflash", None, 7.0), _rec("ddtree", 64, 8.0, batch=8)]
    with pytest.raises(ValueError, match="for ddtree64$"):
        projection.round_costs(records, "m", 512, 1, [64])
    assert projection.round_costs(records, "m", 512, 1, [])["ar"]["ms_per_round"] == 4.0


def test_round_costs_name_what_is_missing_in_the_drafter_layout_closest_to_complete():
    new = projection.DRAFT_LAYOUTS[0]
    records = [{**_rec(m, b, 5.0), "draft_layout": new} for m, b in (("ar", None), ("dflash", None), ("ddtree", 64))]
    with pytest.raises(ValueError, match="for ddtree256$"):  # not every method, as the older layout would say
        projection.round_costs(records, "m", 512, 1, [64, 256])


def test_round_costs_take_a_group_from_one_drafter_layout_the_first_that_has_it_all():
    """A (model, prompt, batch) group comes whole from the first drafter layout of DRAFT_LAYOUTS with every record
    (records without the field are "stacked"), never mixed: a partial newer grid leaves the older group in place."""
    new, old = projection.DRAFT_LAYOUTS[:2]
    assert old == "stacked"
    records = [_rec("ar", None, 5.0), _rec("dflash", None, 7.0), _rec("ddtree", 64, 8.0),
               {**_rec("ar", None, 4.5, "2026-12-01T00:00:00+00:00"), "draft_layout": new},
               {**_rec("dflash", None, 6.5, "2026-12-01T00:00:00+00:00"), "draft_layout": new}]
    got = projection.round_costs(records, "m", 512, 1, [64])  # the new layout lacks ddtree64: the old group whole
    assert [got[k]["ms_per_round"] for k in ("ar", "dflash", "ddtree64")] == [5.0, 7.0, 8.0]
    records.append({**_rec("ddtree", 64, 7.5, "2026-12-01T00:00:00+00:00"), "draft_layout": new})
    got = projection.round_costs(records, "m", 512, 1, [64])
    assert [got[k]["ms_per_round"] for k in ("ar", "dflash", "ddtree64")] == [4.5, 6.5, 7.5]


def test_the_papers_table_as_shipped(tmp_path):
    temps = projection.load_tau()
    assert set(temps) == {"0.0", "1.0"}
    for models in temps.values():
        assert {"qwen3-4b", "qwen3-8b"} <= set(models)
        for rows in models.values():
            assert len(rows) == 10
            for row in rows.values():  # the paper's trees accept more, and run faster, than its chains, everywhere
                assert row["ddtree"]["tau"] > row["dflash"]["tau"] and row["ddtree"]["speedup"] > row["dflash"]["speedup"]
    assert temps["0.0"]["qwen3-coder-30b-a3b"]["HumanEval"]["ddtree"]["speedup"] == 8.22  # the paper's headline
    bad = tmp_path / "tau.json"
    bad.write_text(json.dumps({"temperatures": {"0.0": {"m": {"d": {"dflash": {"tau": 0.5}, "ddtree": {"tau": 2}}}}}}))
    with pytest.raises(ValueError, match="tau >= 1"):
        projection.load_tau(bad)
    bad.write_text(json.dumps({"temperatures": {"0.0": {"m": ["not", "a", "table"]}}}))
    with pytest.raises(ValueError, match="not laid out"):
        projection.load_tau(bad)


def test_bench_project_prints_both_models_from_the_recorded_results(capsys, tmp_path):
    out = tmp_path / "rows.json"
    assert bench.main(["project", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "qwen3-8b: AR" in text and "qwen3-4b: AR" in text and "A projection, not a measurement" in text
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["qwen3-8b", "qwen3-4b"] and len(rows[0]["rows"]) == 10
    assert all(r["ddtree64"] > 1 for m in rows for r in m["rows"])


@pytest.mark.parametrize("argv", [["project", "--temperature", "0.5"], ["project", "--models", "qwen3-32b"],
                                  ["project", "--batch", "3"], ["project", "--tau", "/no/such/file.json"]])
def test_bench_project_bad_input_is_one_line(argv, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_the_performance_page_shows_what_bench_project_prints_from_the_recorded_results(capsys):
    """docs/PERFORMANCE.md's projected-speedup tables are `bench project`'s output on the shipped files, row for row: a
    new record or a changed tau table without a docs update fails here."""
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "PERFORMANCE.md").read_text()
    assert bench.main(["project"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 * 12
    missing = [row for row in rows if row not in page]
    assert not missing, missing


def test_choices_are_the_policys_pick_from_the_papers_tau_and_the_costs():
    taus = {"code": {"dflash": {"tau": 6.0}, "ddtree": {"tau": 8.0}},
            "chat": {"dflash": {"tau": 1.5}, "ddtree": {"tau": 2.0}}}
    got = projection.choices(taus, {"ar": 4.0, "chain": 10.0, "16": 12.0, "64": 20.0})
    assert got["code"]["choice"] == "16"  # 8 / 12 ms beats 6 / 10 ms, 8 / 20 ms and 1 / 4 ms
    assert got["code"]["tokens_per_s"] == {"ar": 250.0, "chain": 600.0, "16": 666.7, "64": 400.0}
    assert got["chat"]["choice"] == "ar"  # 2 / 12 ms < 1 / 4 ms
