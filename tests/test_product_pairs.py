"""studies/product/product_pairs.py: the contrast through `verl-sat` (issue 35, item 3; docs/study.md)."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from study_scripts import load_study

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pairs():
    return load_study("product", "product_pairs")


def test_each_launch_is_the_protocols_overrides_then_the_arm_and_seed(pairs):
    protocol = pairs.read_protocol(pairs.PROTOCOL)
    assert pairs.cells(protocol, quick=False) == [(s, a) for s in range(1001, 1007) for a in ("sat_gspo_r3", "gspo_r3")]
    cmd = pairs.command(protocol, "gspo_r3", 1003, Path("/o"), quick=False)
    assert cmd[1:3] == ["-m", "verl_sat.main"]
    for item in (
        "sat.lag=8",
        "trainer.total_training_steps=30",
        "sat.routing_replay=R3",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "actor_rollout_ref.rollout.seed=0",
        "sat.heldout.problems=512",
        "actor_rollout_ref.actor.policy_loss.sat_enabled=false",
        "data.seed=1003",
        "data.train_files=/o/data/train.parquet",
        "sat.run_dir=/o/gspo_r3-seed1003",
    ):
        assert item in cmd, item
    quick = pairs.command(protocol, "sat_gspo_r3", 801, Path("/o"), quick=True)
    keys = [c.split("=", 1)[0] for c in quick[3:]]
    assert len(keys) == len(set(keys))  # a quick value replaces the protocol's, never repeats the key
    assert "trainer.total_training_steps=2" in quick and "sat.heldout.problems=64" in quick


def test_the_summary_pairs_complete_runs_and_carries_the_protocol(pairs, tmp_path):
    """Fake run directories in the product's metrics format: only runs with the last step's held-out
    row count; the CSV carries the provenance; the paired difference is the rows' own."""
    protocol = pairs.read_protocol(pairs.PROTOCOL)
    provenance = {"protocol_commit": "c0", "protocol_blob": "b0", "assets_fingerprint": "f0", "quick": False}
    (tmp_path / "provenance.json").write_text(json.dumps(provenance))
    accuracy = {("sat_gspo_r3", 1001): 0.8, ("gspo_r3", 1001): 0.7, ("sat_gspo_r3", 1002): 0.6, ("gspo_r3", 1002): 0.65}
    for (arm, seed), acc in accuracy.items():
        run_dir = tmp_path / pairs.name(arm, seed)
        run_dir.mkdir()
        rows = [{"step": t, "data": {"actor/mismatch_abs_mean": 0.02, "actor/sat_q": 0.05}} for t in range(1, 31)]
        for step, row in ((60, 7), (120, 14), (180, 22), (240, 29)):
            rows[row]["data"].update(
                {"eval/heldout_acc": acc, "eval/heldout_greedy_acc": 0.9, "eval/heldout_step": step}
            )
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / pairs.name("sat_gspo_r3", 1003)).mkdir()  # started, never finished: not a row
    result = pairs.summarize(tmp_path)
    primary = result["measures"]["heldout_acc"]
    assert primary["seeds"] == 2 and primary["diff"] == pytest.approx((0.1 - 0.05) / 2) and primary["positive"] == 1
    rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    assert len(rows) == 4 and {r["protocol_blob"] for r in rows} == {"b0"} and protocol["reference"] == "gspo_r3"
    assert "| heldout_acc | +0.025 |" in (tmp_path / "study.md").read_text()


def test_docs_quote_the_loops_committed_numbers_for_the_six_seeds(pairs):
    protocol = pairs.read_protocol(pairs.PROTOCOL)
    loop = pairs.loop_pairs(protocol["seeds"], protocol)
    low, high = loop["ci"]
    text = (REPO / "docs" / "study.md").read_text()
    quoted = f"{loop['diff']:+.3f} [{low:+.3f}, {high:+.3f}], {loop['positive']} of {loop['seeds']}"
    assert quoted in text and loop["assets"] == ["2b075c5327f3f62d"] and "`2b075c5327f3f62d`" in text
    assert re.search(r"\(the 16-seed primary: \+0\.049\)", text)


def test_docs_quote_the_committed_product_pairs(pairs):
    """docs/study.md's product-path numbers are recomputed here from the committed runs.csv."""
    import csv as _csv

    results = REPO / "studies" / "product" / "results"
    rows = list(_csv.DictReader((results / "runs.csv").open()))
    protocol = pairs.read_protocol(pairs.PROTOCOL)
    assert {r["protocol_blob"] for r in rows} == {pairs.protocol_state(pairs.PROTOCOL, REPO)["protocol_blob"]}
    text = (REPO / "docs" / "study.md").read_text()
    for key in ("heldout_acc", "heldout_acc@60", "heldout_acc@120", "heldout_acc@180"):

        def cell(arm, key=key):
            return {int(r["seed"]): float(r[key]) for r in rows if r["arm"] == arm and r[key]}

        c = pairs.compare(cell(protocol["treatment"]), cell(protocol["reference"]))
        low, high = c["ci"]
        quoted = (
            f"| {c['a_mean']:.3f} | {c['b_mean']:.3f} | {c['diff']:+.3f} [{low:+.3f}, {high:+.3f}] | "
            f"{c['wilcoxon_p']:.3f} | {c['positive']} of {c['seeds']} |"
        )
        assert quoted in text, quoted
