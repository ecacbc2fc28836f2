"""studies/breadth/breadth_study.py (issue 33): the runs follow the protocol, the seeds are fresh,
part 4's rule picks as written, and the families are Holm-adjusted."""

from __future__ import annotations

from pathlib import Path

import pytest
from study_scripts import load_study

REPO = Path(__file__).resolve().parents[1]
USED_SEEDS = {801, 802, 901, 2901, *range(1001, 1017), *range(2001, 2019)}


@pytest.fixture(scope="module")
def breadth():
    return load_study("breadth", "breadth_study")


def test_each_phase_is_the_protocols_runs_on_fresh_seeds(breadth):
    protocol = breadth.base.read_protocol(breadth.PROTOCOL)
    counts = {phase: len(breadth.phase_specs(protocol, phase)) for phase in ("part1", "part2", "part3", "search")}
    assert counts == {"part1": 112, "part2": 96, "part3": 64, "search": 16}
    specs = [s for phase in counts for s in breadth.phase_specs(protocol, phase)]
    assert len({s.name for s in specs}) == len(specs)  # no run shared between parts by accident
    seeds = {s.seed for s in specs} | set(protocol["part4"]["confirm_seeds"])
    assert not seeds & USED_SEEDS and len(protocol["seeds"]) == 16 == len(protocol["part4"]["confirm_seeds"])
    assert not set(protocol["seeds"]) & set(protocol["part4"]["confirm_seeds"]) and protocol["part4"][
        "seed"
    ] not in seeds - {3901}
    part2 = {s.tag: s.config() for s in breadth.phase_specs(protocol, "part2")}
    assert (part2["draw1"].mismatch_seed, part2["draw2"].mismatch_seed) == (1, 2)
    assert (part2["noise"].router_bias_std, part2["noise"].logit_noise_std) == (0.0, 0.2)
    for spec in breadth.phase_specs(protocol, "part1"):
        cfg = spec.config()
        assert (cfg.lag, cfg.steps, cfg.lr, cfg.router_bias_std, cfg.mismatch_seed, cfg.eval_problems) == (
            8,
            240,
            2e-4,
            0.5,
            0,
            512,
        )
    grpo = {s.arm: s.config() for s in breadth.phase_specs(protocol, "part3")}
    assert grpo["grpo_r3"].routing_replay == "R3" and grpo["grpo"].routing_replay == "disabled"
    assert not grpo["grpo_r3"].sat_enabled and grpo["sat_grpo_r3"].loss_agg_mode == "token-mean"
    search = breadth.phase_specs(protocol, "search")
    assert {s.config().routing_replay for s in search} == {"disabled"} and {s.seed for s in search} == {3901}
    assert breadth.phase_specs(protocol, "confirm", out=None) == []  # nothing to confirm before the search


def row(arm, tag, lag, collapsed, q_share, acc, seed=3901):
    return {
        "arm": arm,
        "tag": tag,
        "lag": lag,
        "seed": seed,
        "collapsed": collapsed,
        "q_below_radius_frac": q_share,
        "heldout_acc": acc,
    }


def test_the_collapse_rule_as_the_protocol_writes_it(breadth):
    protocol = breadth.base.read_protocol(breadth.PROTOCOL)
    hi, lo = breadth.search_tag(1e-3, 1.5), breadth.search_tag(2e-4, 0.5)
    # a collapse where SAT cannot act (q above the radius) does not qualify
    stats = [row("gspo", hi, 16, True, 0.3, 0.1), row("grpo", lo, 8, False, 0.9, 0.8)]
    assert breadth.pick_collapse(stats, protocol)["picked"] is None
    # two settings qualify for one arm each, a third for both: the third wins, whatever its accuracy
    stats = [
        row("gspo", hi, 16, True, 0.6, 0.05),
        row("grpo", lo, 16, True, 0.7, 0.20),
        row("gspo", lo, 8, True, 0.8, 0.50),
        row("grpo", lo, 8, True, 0.8, 0.60),
    ]
    picked = breadth.pick_collapse(stats, protocol)["picked"]
    assert (picked["lag"], picked["lr"], picked["router_bias"]) == (8, 2e-4, 0.5) and sorted(picked["arms"]) == [
        "grpo",
        "gspo",
    ]
    # among settings qualifying for as many arms, the lowest accuracy
    picked = breadth.pick_collapse(stats[:2], protocol)["picked"]
    assert (picked["lag"], picked["lr"], picked["router_bias"]) == (16, 1e-3, 1.5)


def test_a_family_is_holm_adjusted_on_its_wilcoxon_p(breadth):
    stats = []
    for seed in range(16):
        stats.append({"arm": "t", "tag": "", "lag": 8, "seed": seed, "heldout_acc": 0.8 + 0.001 * seed})
        stats.append({"arm": "a", "tag": "", "lag": 8, "seed": seed, "heldout_acc": 0.7})  # t always ahead
        stats.append(
            {"arm": "b", "tag": "", "lag": 8, "seed": seed, "heldout_acc": 0.8 + 0.001 * seed + (-1) ** seed * 0.01}
        )
    rows = breadth.family(stats, [("t", "a", "", 8), ("t", "b", "", 8)])
    by_ref = {r["reference"]: r for r in rows}
    assert by_ref["a"]["wilcoxon_p"] == pytest.approx(2 / 2**16)
    assert by_ref["a"]["holm_p"] == pytest.approx(2 * by_ref["a"]["wilcoxon_p"])  # the smallest p times m = 2
    assert by_ref["b"]["holm_p"] == pytest.approx(max(by_ref["b"]["wilcoxon_p"], by_ref["a"]["holm_p"]))
    assert (
        breadth._reading(by_ref["a"], 0.05) == "differs"
        and breadth._reading(by_ref["b"], 0.05) == "no difference detected"
    )
    # one contrast under several conditions keeps each condition's tag
    tagged = [dict(r, tag=tag) for r in stats for tag in ("draw1", "draw2")]
    assert [r["tag"] for r in breadth.family(tagged, [("t", "a", "draw1", 8), ("t", "a", "draw2", 8)])] == [
        "draw1",
        "draw2",
    ]


def test_the_committed_csv_reads_back_as_the_runs_wrote_it(breadth, tmp_path):
    """read_rows(runs.csv) gives the analysis the numbers summarize had: same families, same pick,
    the same quoted table (None, booleans, checkpoints and tags survive the CSV)."""
    protocol = breadth.base.read_protocol(breadth.PROTOCOL)
    stats = []
    for seed in range(3001, 3005):
        for arm in ("sat_gspo_r3", "gspo_r3", "gspo_r3_tis", "sat_grpo", "grpo"):
            acc = 0.5 + 0.01 * (seed % 7) + (0.02 if arm.startswith("sat") else 0.0) + 0.003 * len(arm)
            stats.append({**row(arm, "", 8, False, 0.75, acc, seed), "heldout_acc@60": None, "dbar_pi_final": 0.1})
        stats.append({**row("sat_gspo_r3", "draw1", 8, None, None, 0.4, seed), "heldout_acc@60": 0.3})
        stats.append({**row("gspo_r3", "draw1", 8, True, 0.5, 0.35 + 0.001 * seed, seed), "heldout_acc@60": 0.3})
    stats.append(row("gspo", breadth.search_tag(1e-3, 1.5), 16, True, 0.6, 0.05))
    stats = [{**s, "intercepted_frac": 0.01 * (i % 3) or None} for i, s in enumerate(stats)]
    back = breadth.read_rows(breadth.base.write_csv(tmp_path / "runs.csv", stats))
    assert [r["collapsed"] for r in back] == [r["collapsed"] for r in stats]
    assert [r["heldout_acc@60"] for r in back] == [r.get("heldout_acc@60") for r in stats]
    before, after = breadth.from_rows(stats, protocol), breadth.from_rows(back, protocol)
    assert breadth.quote_lines(before, 0.05) == breadth.quote_lines(after, 0.05)
    assert len(breadth.quote_lines(after, 0.05)) == 2 + 1 + 1 + 1 + 1  # header, replication, TIS, draw1, GRPO
    assert before["search"] == after["search"] and after["search"]["picked"]["lag"] == 16
    assert before["activity"] == after["activity"]


RESULTS = REPO / "studies" / "breadth" / "results"


def test_docs_and_readme_quote_the_committed_breadth_results(breadth):
    """docs/study.md's breadth table, the search's verdict and the README's breadth sentence are
    recomputed here from the committed runs.csv, whose every row carries the protocol's hash; each
    arm of parts 1-3 has the protocol's 16 seeds."""
    protocol = breadth.base.read_protocol(breadth.PROTOCOL)
    rows = breadth.read_rows(RESULTS / "runs.csv")
    state = breadth.base.protocol_state(breadth.PROTOCOL, REPO)
    assert {r["protocol_blob"] for r in rows} == {state["protocol_blob"]} and {r["quick"] for r in rows} == {False}
    for phase in ("part1", "part2", "part3"):
        for spec in breadth.phase_specs(protocol, phase):
            assert any(r["name"] == spec.name and r["heldout_acc"] is not None for r in rows), spec.name
    result = breadth.from_rows(rows, protocol)
    assert all(r["seeds"] == 16 for key, _ in breadth.QUOTED for r in result[key])
    page = (REPO / "docs" / "study.md").read_text()
    for line in [*breadth.quote_lines(result, protocol["alpha"]), *breadth.secondary_lines(rows, protocol)]:
        assert line in page, line
    assert breadth.search_line(result["search"], protocol["part4"]["q_below_radius_min"]) in " ".join(page.split())
    readme = " ".join((REPO / "README.md").read_text().split())
    for r in [*result["part1_replication"], *result["part1"], *result["part2"], *result["part3"]]:
        lo, hi = r["ci"]
        assert f"{r['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]" in readme, (r["arm"], r["reference"], r["tag"])
