"""The host-side choice of each group's form (ddtree_jax/policy.py) and the cost table (ddtree_jax/costs.py): pure
numpy, no device."""

import json

import numpy as np
import pytest

from ddtree_jax import autorun, costs, policy

TREES = (16, 32, 64, 128, 256)
FORMS = ("ar", "chain") + tuple(map(str, TREES))


def stats(rounds, accepted, used, chain, trees, seen=None):
    """One group's statistics row (policy's columns) for ``rounds`` rounds with the per-round values given; ``seen``:
    {tree budget: acceptance length} the trees the rounds' tree held would have had (the policy reads those up to the
    group's form; default: each tree's prediction corrected by the ratio of the form used, as if one ratio held)."""
    if seen is None:
        r = (accepted - 1) / (used - 1) if used > 1 else 0.0
        seen = {str(b): 1 + r * (t - 1) for b, t in zip(TREES, trees)}
    return np.asarray([rounds, rounds * accepted, rounds * used, rounds * chain] + [rounds * t for t in trees]
                      + [rounds * seen.get(str(b), 0) for b in TREES], np.float32)


def curve(top, scale=64.0, budgets=TREES):
    """A drafter's predicted acceptance length at each budget: rising to 1 + top, half-way near ``scale`` nodes."""
    return [1 + top * (1 - np.exp(-b / scale)) for b in budgets]


# An H200-like cost table at one slot batch: seconds per round
COSTS = {"ar": 5.6e-3, "chain": 6.0e-3, "16": 6.2e-3, "32": 6.4e-3, "64": 7.2e-3, "128": 9.0e-3, "256": 13.0e-3}


def options(batch=1, table=COSTS):
    return {(f, batch): c for f, c in table.items()}


def test_forms_and_their_codes():
    assert policy.candidates("ar", "gpu") == ("ar",)
    assert policy.candidates("dflash", "cpu") == ("ar", "chain")
    assert policy.candidates("ddtree", "gpu") == FORMS
    assert policy.candidates("ddtree", "cpu") == ("ar", "chain", "4", "8", "16")
    assert policy.candidates("ddtree", "gpu", moe=True) == ("ar", "chain", "8", "16", "32", "64", "128")
    assert policy.candidates("ddtree", "cpu", moe=True) == policy.candidates("ddtree", "cpu")
    assert [policy.name(policy.code(f)) for f in FORMS] == list(FORMS)
    assert policy.parse_forms(["AR", "chain", "064", 16, "16"]) == ("ar", "chain", "64", "16")
    for bad in (["tree"], ["0"], ["-4"], []):
        with pytest.raises(ValueError):
            policy.parse_forms(bad)
    # rows = batch x (1 + nodes) within the cap; ar always
    assert policy.allowed(FORMS, 1, 16) == FORMS
    assert policy.allowed(FORMS, 8, 16) == ("ar", "chain", "16", "32", "64")
    assert policy.allowed(FORMS, 32, 16) == ("ar", "chain", "16")
    assert policy.allowed(FORMS, 128, 16) == ("ar",)


def test_picks_the_form_with_the_most_tokens_per_second():
    """With predictions that the target confirms (ratio 1): the most expected tokens per second over the cost table,
    a small tree for a hesitant drafter, a large one for a confident one."""
    winners = set()
    for top, scale in ((0.6, 8), (2.0, 24), (4.0, 64), (8.0, 128), (12.0, 256)):
        pred = curve(top, scale)
        p = policy.Policy(FORMS, TREES)
        p.start(0)
        used = pred[TREES.index(64)]
        p.observe(0, "64", stats(8, used, used, 1.2, pred))  # accepted as predicted: ratio 1
        rate = {f: (1.0 if f == "ar" else 1.2 if f == "chain" else pred[TREES.index(int(f))]) / c
                for f, c in COSTS.items()}
        want = max(rate, key=rate.get)
        assert p.choose([0], options()) == (want, 1)
        assert p.expected(0, want) == pytest.approx(rate[want] * COSTS[want], rel=1e-5)
        winners.add(want)
    assert {"32", "256"} <= winners and len(winners) >= 3, winners


def test_rounds_that_predict_the_next_tree_up_climb_to_the_best_one():
    """Tree rounds predict only up to the next tree size (spec.build_budget): each group's choice then moves at most
    one size up, and a confident drafter's run climbs from the smallest tree to the one full predictions pick."""
    pred = curve(8.0, 128)
    rate = {f: pred[TREES.index(int(f))] / COSTS[f] for f in map(str, TREES)}
    best = max(rate, key=rate.get)
    assert best == "128"
    p = policy.Policy(FORMS, TREES)
    p.start(0)
    form, path = "16", ["16"]
    for _ in range(6):
        shown = [t if b <= 2 * int(form) else 0 for b, t in zip(TREES, pred)]  # up to the next size
        used = pred[TREES.index(int(form))]
        p.observe(0, form, stats(8, used, used, 1.2, shown))
        form = p.choose([0], options())[0]
        path.append(form)
    assert path == ["16", "32", "64", "128", "128", "128", "128"], path


def test_the_ratio_corrects_an_overconfident_drafter_and_the_slot_batch_counts():
    pred = curve(12.0, 256)
    p = policy.Policy(FORMS, TREES, prior_rounds=0)
    p.start(0)
    used = pred[TREES.index(256)]
    p.observe(0, "256", stats(8, 1 + 0.25 * (used - 1), used, 1.5, pred))  # a quarter of what it predicted
    assert p.seqs[0].ratio == pytest.approx(0.25, rel=1e-5)
    e = {f: p.expected(0, f) for f in FORMS}
    assert e["ar"] == 1 and e["256"] == pytest.approx(1 + 0.25 * (used - 1), rel=1e-5)
    choice = p.choose([0], options())
    rate = {f: e[f] / c for f, c in COSTS.items()}
    assert choice == (max(rate, key=rate.get), 1)
    # the same form is cheaper per round at a smaller slot batch holding the sequence: that one is chosen
    both = {**options(1), **{(f, 2): 1.5 * c for f, c in COSTS.items()}}
    assert p.choose([0], both)[1] == 1


def test_each_tree_keeps_its_own_ratio_so_overrated_extra_nodes_do_not_hide_a_better_smaller_tree():
    """The drafter's predictions hold up to 64 nodes, but its next 64 add little: a round of 128 accepts hardly more
    than one of 64. That round shows what the trees of 16-64 would have accepted (ratio 1 each) and its own ratio
    (low), so 64 is chosen, as the true rates say. A single ratio fitted on the round of 128 would underrate every
    smaller tree by as much and keep 128."""
    pred = curve(8.0, 128)
    true = {str(b): p for b, p in zip(TREES, pred)}
    true["128"] = true["64"] + 0.1
    seen = {f: true[f] for f in ("16", "32", "64", "128")}
    rate = {f: (1.0 if f == "ar" else true[f]) / c for f, c in COSTS.items() if f not in ("chain", "256")}
    assert max(rate, key=rate.get) == "64"
    p = policy.Policy(FORMS, TREES, prior_rounds=0)
    p.start(0)
    p.observe(0, "128", stats(8, true["128"], pred[3], 1.1, pred, seen))
    for f in ("16", "32", "64", "128"):
        assert p.expected(0, f) == pytest.approx(true[f], rel=1e-5)
    assert p.expected(0, "256") < pred[4]  # never seen: the ratio of 128, the largest tree seen
    assert p.choose([0], options()) == ("64", 1)
    r = p.seqs[0].ratio  # the one ratio of the round of 128: by it every smaller tree is underrated, 128 kept
    single = {f: (1.0 if f == "ar" else 1 + r * (pred[TREES.index(int(f))] - 1)) / c for f, c in COSTS.items()
              if f not in ("chain", "256")}
    assert 1 + r * (pred[2] - 1) < 0.9 * true["64"] and max(single, key=single.get) == "128"


def test_settles_on_the_best_tree_when_each_larger_tree_is_overrated_more():
    """The drafter overrates each larger tree's extra nodes more (predicted 3.0, 3.6, 4.3, 5.0 at 16-128 nodes, true
    2.8, 3.0, 3.1, 3.15): the tree of 32 commits the most tokens per second. A round of 32 (built at 64) shows the
    trees of 16 and 32 and predicts 64; a round of 64 shows 64 too. Once 64 has run, its factor is kept relative to
    the tree of 32's (what it showed), so after groups of 32 the tree of 64 is expected at its true 3.1 and the policy
    stays at 32. (Before, 64's factor stayed 1 against whatever form ran last, the ratio of 32's groups made 64 look
    better than it is, and the policy alternated: 64 in 60% of the groups.)"""
    true = {"16": 2.8, "32": 3.0, "64": 3.1, "128": 3.15, "256": 3.18}
    pred = {"16": 3.0, "32": 3.6, "64": 4.3, "128": 5.0, "256": 5.6}
    table = {"ar": 0.9, "16": 1.0, "32": 1.04, "64": 1.12, "128": 1.3, "256": 1.6}
    rate = {f: true[f] / table[f] for f in true}
    assert max(rate, key=rate.get) == "32" and rate["32"] > 1.04 * rate["64"]

    def group(form):  # 4 rounds of a tree of ``form`` nodes, built at the next size up
        built = TREES[min(TREES.index(int(form)) + 1, len(TREES) - 1)]
        trees = [pred[str(b)] if b <= built else 0.0 for b in TREES]
        return stats(4, true[form], pred[form], 2.0, trees, {str(b): true[str(b)] for b in TREES if b <= int(form)})

    p = policy.Policy(FORMS, TREES)
    p.start(0)
    choices = []
    for _ in range(60):
        form, _ = p.choose([0], options(table=table))
        choices.append(form)
        if form != "ar":
            p.observe(0, form, group(form))
    assert "64" in choices and choices[-40:] == ["32"] * 40, choices
    for f in ("16", "32", "64"):
        assert p.expected(0, f) == pytest.approx(true[f], rel=1e-3)


def test_falls_back_to_ar_when_the_drafter_is_useless_and_probes_less_and_less():
    """Predictions near 1 (random drafter) or a ratio near 0: AR wins. Every so many AR groups one group probes the
    cheapest speculative form; each probe that changes nothing doubles the wait, up to MAX_PROBE_EVERY AR groups
    times the probe's cost over AR's."""
    for pred, accepted in ((curve(0.02), 1.0), (curve(6.0), 1.0)):  # flat curve; confident but never right
        p = policy.Policy(FORMS, TREES, prior_rounds=0)
        p.start(0)
        p.observe(0, "16", stats(8, accepted, pred[0], 1.01, pred))
        choices, probes = [], []
        for group in range(400):
            form, _ = p.choose([0], options())
            choices.append(form)
            if form != "ar":
                probes.append(group)
                p.observe(0, form, stats(4, accepted, pred[0] if form == "16" else 1.01, 1.01, pred))
        assert choices[0] == "ar"
        assert set(choices) <= {"ar", "chain"}  # probes take the cheapest speculative form
        gaps = np.diff(probes)
        longest = int(np.ceil(policy.MAX_PROBE_EVERY * COSTS["chain"] / COSTS["ar"]))
        assert (np.diff(gaps) >= 0).all() and gaps[0] < gaps[2] and gaps[-1] == longest, gaps
        # what the probes cost AR: under 2 % of a run of AR rounds at these costs
        spent = sum(COSTS[f] for f in choices)
        assert spent / (len(choices) * COSTS["ar"]) < 1.02


def test_dear_probes_wait_longer_so_a_useless_drafter_costs_little_under_load():
    """At a large slot batch a probe (the chain: 16 verify rows a sequence) costs several AR steps; the wait between
    probes grows by that ratio, so what the probes of a useless drafter cost AR stays under 1/MAX_PROBE_EVERY (plus
    the first, shorter waits): 1.1% here, where waits of MAX_PROBE_EVERY AR groups alone would cost 2.5%."""
    pred = curve(0.02)
    dear = {"ar": 7.1e-3, "chain": 18.0e-3, "16": 19.0e-3}  # slot batch 32: the chain verifies 512 rows
    p = policy.Policy(FORMS, TREES)
    seqs = list(range(32))
    for s in seqs:
        p.start(s)
        p.observe(s, "16", stats(8, 1.0, pred[0], 1.01, pred))
    choices = []
    for _ in range(4000):
        form, _ = p.choose(seqs, options(32, dear))
        choices.append(form)
        if form != "ar":
            for s in seqs:
                p.observe(s, form, stats(4, 1.0, 1.01, 1.01, pred))
    assert set(choices) == {"ar", "chain"}
    gaps = np.diff([i for i, f in enumerate(choices) if f != "ar"])
    assert gaps[-1] == int(np.ceil(policy.MAX_PROBE_EVERY * dear["chain"] / dear["ar"])), gaps
    overhead = sum(dear[f] for f in choices) / (len(choices) * dear["ar"]) - 1
    assert overhead < 1.25 / policy.MAX_PROBE_EVERY, overhead


def test_speculation_before_ar_won_is_not_a_failed_probe():
    """Statistics arrive a group late: when AR starts winning, the last speculative group's statistics are still to
    come. They are not a probe's, so they do not double the wait: the probe comes when FIRST_PROBE_EVERY AR groups
    (times the probe's cost over AR's) have run since AR took over."""
    pred = curve(6.0)
    p = policy.Policy(FORMS, TREES)
    p.start(0)
    p.observe(0, "16", stats(8, pred[0], pred[0], 1.3, pred))  # speculation pays: accepted as predicted
    assert p.choose([0], options())[0] not in ("ar", "chain")
    p.observe(0, "16", stats(32, 1.0, pred[0], 1.3, pred))  # the text turned unpredictable: nothing accepted
    assert p.choose([0], options())[0] == "ar"
    p.observe(0, "16", stats(8, 1.0, pred[0], 1.3, pred))  # the group dispatched before AR won, read late
    wait = int(np.ceil(policy.FIRST_PROBE_EVERY * COSTS["chain"] / COSTS["ar"]))  # AR groups, counted from the first
    choices = [p.choose([0], options())[0] for _ in range(wait - 1)]
    assert choices[:-1] == ["ar"] * (wait - 2) and choices[-1] != "ar", choices
    assert p.probing[1].every == policy.FIRST_PROBE_EVERY and p.probes == 1  # (the engine's metrics count them)


def test_steps_with_nothing_to_probe_keep_the_wait_between_probes():
    """A step whose slot batch has only AR timed (nothing speculative to choose) is no evidence for speculation:
    the wait the useless probes earned stays."""
    pred = curve(0.02)
    p = policy.Policy(FORMS, TREES)
    p.start(0)
    p.observe(0, "16", stats(8, 1.0, pred[0], 1.01, pred))
    for _ in range(40):
        form, _ = p.choose([0], options())
        if form != "ar":
            p.observe(0, form, stats(4, 1.0, 1.01, 1.01, pred))
    earned = p.probing[1].every
    assert earned > policy.FIRST_PROBE_EVERY
    assert p.choose([0], {("ar", 1): COSTS["ar"]}) == ("ar", 1)
    assert p.probing[1].every == earned


def test_each_slot_batch_keeps_its_own_wait_between_probes():
    """A drafter accepting 2 tokens a round: speculation pays for a lone request, not for a full batch where a tree
    costs several AR steps. The wait that useless probes earned at slot batch 8 survives a win at slot batch 1 (which
    restarts the waits of its own and smaller batches only); a win at 8 restarts it."""
    pred = curve(6.0)
    dear = {"ar": 7.1e-3, "chain": 18.0e-3, "16": 19.0e-3}
    p = policy.Policy(FORMS, TREES)
    seqs = list(range(8))
    group = stats(8, 2.0, pred[0], 1.01, pred)
    for s in seqs:
        p.start(s)
        p.observe(s, "16", group)
    for _ in range(200):
        form, size = p.choose(seqs, options(8, dear))
        assert size == 8
        if form != "ar":
            for s in seqs:
                p.observe(s, form, group)
    earned = p.probing[8].every
    assert earned > 2 * policy.FIRST_PROBE_EVERY
    assert p.choose([0], options(1))[0] not in ("ar", "chain")  # a lone request: speculation pays
    assert p.probing[8].every == earned
    assert p.choose(seqs, options(8))[0] not in ("ar", "chain")  # cheap trees at 8 too: the wait there restarts
    assert 8 not in p.probing


def test_a_slot_batch_first_met_starts_from_the_wait_a_smaller_one_earned():
    """A useless drafter while the load grows (as a server's does, and load_bench.py's levels): the wait that probes
    earned at slot batch 1 carries to 2, 4 and 8 when AR first wins there, so each new slot batch does not probe
    from FIRST_PROBE_EVERY again; a larger slot batch's wait is not lent to a smaller one."""
    pred = curve(0.02)
    p = policy.Policy(FORMS, TREES)

    def run(batch, groups):
        seqs = list(range(batch))
        for s in seqs:
            p.start(s)
        probes = 0
        for _ in range(groups):
            form, size = p.choose(seqs, options(batch))
            if form != "ar":
                probes += 1
                for s in seqs:
                    p.observe(s, form, stats(4, 1.0, 1.01, 1.01, pred))
        return probes

    run(1, 400)
    earned = p.probing[1].every
    assert earned == policy.MAX_PROBE_EVERY
    for batch in (2, 4, 8):
        assert run(batch, 60) == 0  # waits of MAX_PROBE_EVERY AR groups: no probe within 60 groups
        assert p.probing[batch].every == earned
    fresh = policy.Policy(FORMS, TREES)
    fresh.probing[8] = policy.Probing(earned)
    fresh.start(0)
    fresh.observe(0, "16", stats(8, 1.0, pred[0], 1.01, pred))
    assert [fresh.choose([0], options(1))[0] for _ in range(3)] == ["ar", "ar", "chain"]  # from 1, not 8's wait
    assert fresh.probing[1].every == policy.FIRST_PROBE_EVERY


def test_returns_to_speculation_when_a_probe_shows_acceptance():
    pred = curve(6.0)
    p = policy.Policy(FORMS, TREES, prior_rounds=0)
    p.start(0)
    p.observe(0, "16", stats(8, 1.0, pred[0], 1.3, pred))  # off-domain: nothing accepted
    seen = []
    for _ in range(50):
        form, _ = p.choose([0], options())
        seen.append(form)
        if form != "ar":  # the text turned predictable: the probe accepts what the drafter predicts
            p.observe(0, form, stats(8, 1.3, 1.3, 1.3, pred))
            p.observe(0, form, stats(8, pred[2], pred[2], 1.3, pred))
    assert seen[0] == "ar" and seen[-1] not in ("ar", "chain")
    assert 1 not in p.probing  # the win restarted the wait


def test_new_sequences_start_from_what_the_others_showed_and_unknown_forms_are_explored():
    p = policy.Policy(FORMS, TREES, prior_rounds=0)  # (a first group's ratio replaces the prior: exact values)
    p.start("a")
    # nothing known: to learn, the largest tree within EXPLORE_SPREAD times the cheapest form's cost (its rounds
    # predict every smaller tree and show what each would have accepted): 64 (1.2x the chain's), not 128 (1.5x)
    assert p.choose(["a"], options()) == ("64", 1)
    # the next group is chosen before its statistics arrive: the next largest within the spread, not 64 again
    assert p.choose(["a"], options()) == ("32", 1)
    # ... and when no other is that cheap, the same again; the chain when every tree costs more
    q = policy.Policy(FORMS, TREES)
    dear = {**COSTS, "16": policy.EXPLORE_SPREAD * 1.01 * COSTS["chain"]}
    dear.update({f: 2 * dear["16"] for f in ("32", "64", "128", "256")})
    assert q.choose([0], options(table=dear)) == ("chain", 1) and q.choose([0], options(table=dear)) == ("chain", 1)
    r = policy.Policy(FORMS, TREES)
    cheap16 = {**dear, "16": COSTS["chain"]}
    assert r.choose([0], options(table=cheap16)) == ("16", 1) and r.choose([0], options(table=cheap16)) == ("chain", 1)
    assert r.choose([0], options(table=cheap16)) == ("16", 1)
    pred = curve(4.0)
    p.observe("a", "chain", stats(8, 1.0, 1.4, 1.4, pred))  # ratio 0
    p.start("b")
    assert p.seqs["b"].ratio == pytest.approx(0.0) and p.expected("b", "256") == pytest.approx(1.0)
    # a budget never predicted (above the tree the rounds built) takes the largest predicted one's value
    q = policy.Policy(FORMS, TREES)
    q.start(0)
    q.observe(0, "16", stats(4, 2.0, 2.0, 1.5, pred[:2] + [0, 0, 0]))
    assert q.pred(q.seqs[0], "256") == pytest.approx(pred[1])
    assert q.summary([0], "32")[0] == pytest.approx(q.expected(0, "32"))


def test_a_first_group_weighs_against_the_prior_so_a_slow_start_keeps_the_trees():
    """A response's first rounds accept little: generate's first group (4 rounds) of a tree of 32 accepting a twentieth
    of what the drafter predicted beyond the root does not send the decode to AR steps; the same shortfall kept up for
    four groups of 8 does."""
    pred = curve(4.0)
    used = pred[TREES.index(32)]
    p = policy.Policy(FORMS, TREES)
    p.start(0)
    p.observe(0, "32", stats(autorun.FIRST_GROUP, 1 + 0.05 * (used - 1), used, 1.5, pred))
    w = autorun.FIRST_GROUP / (autorun.FIRST_GROUP + policy.PRIOR_ROUNDS)
    assert p.seqs[0].ratio == pytest.approx(1 + w * (0.05 - 1), rel=1e-5)
    assert p.choose([0], options())[0] != "ar"
    for _ in range(4):
        p.observe(0, "32", stats(8, 1 + 0.05 * (used - 1), used, 1.5, pred))
    assert p.choose([0], options())[0] == "ar"
    alone = policy.Policy(FORMS, TREES, prior_rounds=0)  # the first group alone would have
    alone.start(0)
    alone.observe(0, "32", stats(autorun.FIRST_GROUP, 1 + 0.05 * (used - 1), used, 1.5, pred))
    assert alone.choose([0], options())[0] == "ar"
    # a new sequence starts from the others' ratio, which weighs as much against its own first group
    p.start(1)
    before = p.seqs[1].ratio
    p.observe(1, "32", stats(autorun.FIRST_GROUP, used, used, 1.5, pred))
    assert p.seqs[1].ratio == pytest.approx(before + w * (1 - before), rel=1e-5)


def test_the_cost_table_persists_per_signature(tmp_path):
    path = str(tmp_path / "costs.json")
    sig = costs.signature("model", "bfloat16", "NVIDIA H200")
    table = costs.CostTable(sig, path)
    key = costs.program_key("64", 8, "greedy")
    assert key == "64@8/greedy" and table.get(key) is None
    table.measured(key, 0.010, 512)
    table.save()
    other = costs.CostTable(costs.signature("other"), path)
    other.measured("ar@1/greedy", 0.005, 64)
    other.save()
    again = costs.CostTable(sig, path)
    assert again.get(key) == pytest.approx(0.010) and again.get("ar@1/greedy") is None
    assert set(json.load(open(path))) == {sig, costs.signature("other")}
    assert costs.CostTable(sig).get(key) is None  # in memory only


def test_steps_move_every_cost_by_one_offset():
    """A step takes longer than its program's timing by about the same time a round whatever the program (the host's
    work beside it): its excess moves one offset that every program's cost holds, so a form that ran is not set at
    served speed against the others' timings. A step chosen to time its program gives its timing less the offset."""
    table = costs.CostTable("test")
    table.measured("16@4/greedy", 0.010, 64)
    table.measured("64@4/greedy", 0.012, 64)
    table.observe("64@4/greedy", 0.017, 64)  # 5 ms over its cost
    assert table.offset == pytest.approx(costs.REFINE * 0.005)
    assert table.get("16@4/greedy") == pytest.approx(0.010 + costs.REFINE * 0.005)  # moved with it
    assert table.get("64@4/greedy") - table.get("16@4/greedy") == pytest.approx(0.002)
    assert {k: t for k, (_, t) in table.entries().items()} == {"16@4/greedy": 0.010, "64@4/greedy": 0.012}
    for _ in range(60):
        table.observe("64@4/greedy", 0.017, 64)
    assert table.get("16@4/greedy") == pytest.approx(0.015, rel=1e-3)  # 16 is timed 2 ms under 64: 5 ms over that
    table.measured("16@4/greedy", 0.013, 64, step=True)  # a step of 16 chosen to time it, at served speed
    assert table.entries()["16@4/greedy"][1] == pytest.approx(0.008, rel=1e-3)
    table.observe("ar@4/greedy", 0.009, 64)  # a program not timed yet: its step, less the offset, is its timing
    assert table.get("ar@4/greedy") == pytest.approx(0.009)
    assert table.entries()["ar@4/greedy"][1] == pytest.approx(0.004, rel=1e-3)
    before = table.get("64@4/greedy")
    table.observe("64@4/greedy", 10.0, 64)  # a host hiccup: clipped to OUTLIER x the cost
    assert table.get("64@4/greedy") == pytest.approx(before + costs.REFINE * (costs.OUTLIER - 1) * before)
