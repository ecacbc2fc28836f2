"""The replication figures README.md and docs/study.md quote recompute from the committed rows (issue 46).

docs/study.md's table between ``<!-- replications:begin -->`` and ``<!-- replications:end -->``
names, per row, the rows file, the reference arm and the measure; each difference, its paired t
95% interval and its positive pairs are recomputed here from ``studies/curve/replications/``
(``studies.lib.stats.paired_comparison``, paired by seed). README.md's two stabilizer bullets are
parsed too: each replication figure there must be the table's, in the order the README names them.
The committed rows are copies of ``../shared/replications/``; where that folder exists they must
match it byte for byte.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from studies.lib.stats import paired_comparison

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "studies" / "curve" / "replications"
SHARED = REPO.parent / "shared" / "replications"
TREATMENT = "sat_gspo_r3"
ARMS = {
    "DPPO-TV + R3": "dppo_tv_r3",
    "GSPO + R3 + TIS": "gspo_r3_tis",
    "GSPO + R3 + IcePop": "gspo_r3_icepop",
    "GSPO + R3 + geometric rejection": "gspo_r3_geo_rs",
    "CISPO + R3": "cispo_r3",
}
CHECKPOINTS = (60, 120, 180, 240)
FIGURE = re.compile(r"([+-]\d\.\d{3}) \[([+-]\d\.\d{3}), ([+-]\d\.\d{3})\]")


def doc_table() -> list[dict[str, str]]:
    """The rows of docs/study.md's replication table, keyed by its header."""
    text = (REPO / "docs" / "study.md").read_text()
    block = text.split("<!-- replications:begin -->", 1)[1].split("<!-- replications:end -->", 1)[0]
    lines = [line.strip().strip("|").split("|") for line in block.strip().splitlines()]
    header = [c.strip() for c in lines[0]]
    return [dict(zip(header, (c.strip() for c in cells), strict=True)) for cells in lines[2:]]


def measure(row: dict[str, str], name: str) -> float:
    """``after step N``: held-out accuracy after step N; ``mean of 60-240``: the mean over the checkpoints."""
    if name == "mean of 60-240":
        return sum(float(row[f"heldout_acc@{k}"]) for k in CHECKPOINTS) / len(CHECKPOINTS)
    step = re.fullmatch(r"after step (\d+)", name)
    assert step, f"unknown measure {name!r}"
    return float(row[f"heldout_acc@{step.group(1)}"])


def recompute(file: str, reference: str, name: str) -> tuple[str, str]:
    """(``+d [+lo, +hi]``, ``k of n``) of SAT-GSPO + R3 minus ``reference`` from the committed rows."""
    rows = list(csv.DictReader((ROWS / file).open()))

    def cell(arm: str) -> dict[int, float]:
        return {int(r["seed"]): measure(r, name) for r in rows if r["arm"] == arm}

    c = paired_comparison(cell(TREATMENT), cell(ARMS[reference]))
    assert c is not None, f"{file}: no paired seeds for {reference}"
    lo, hi = c["ci"]
    return f"{c['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]", f"{sum(d > 0 for d in c['diffs'])} of {c['seeds']}"


def test_docs_table_recomputes_from_the_committed_rows():
    table = doc_table()
    assert len(table) >= 10, "the replication table lost rows"
    for row in table:
        figure, positive = recompute(row["rows"], row["SAT-GSPO + R3 minus"], row["measure"])
        assert row["difference [paired t 95%]"] == figure, row
        assert row["positive pairs"] == positive, row
        seeds = {int(r["seed"]) for r in csv.DictReader((ROWS / row["rows"]).open())}
        assert row["seeds"] == f"{min(seeds)}-{max(seeds)}", row


def readme_bullet(text: str, start: str) -> str:
    """The README bullet beginning with ``start``, whitespace collapsed (bullets wrap)."""
    tail = text.split(f"- {start}", 1)[1]
    return " ".join(tail.split("\n- ", 1)[0].split())


def test_readme_quotes_the_table_in_order():
    readme = (REPO / "README.md").read_text()
    table = {(r["SAT-GSPO + R3 minus"], r["measure"]): r["difference [paired t 95%]"] for r in doc_table()}

    def figures(text: str) -> list[str]:
        return [f"{d} [{lo}, {hi}]" for d, lo, hi in FIGURE.findall(text)]

    stabilizers = readme_bullet(readme, "Ahead of TIS, IcePop, geometric rejection and CISPO")
    replicated = figures(stabilizers.split("on 8 more seeds each", 1)[1])
    order = ["GSPO + R3 + TIS", "GSPO + R3 + IcePop", "GSPO + R3 + geometric rejection", "CISPO + R3"]
    assert replicated == [table[(ref, "after step 240")] for ref in order]

    dppo_bullet = readme_bullet(readme, "Ahead of DPPO-TV + R3 early, close at step 240")
    dppo = figures(dppo_bullet.split(" here,", 1)[1].split("; on 16 fresh seeds", 1)[0])
    steps = ("after step 240", "after step 60", "after step 120", "after step 180")
    assert dppo == [table[("DPPO-TV + R3", s)] for s in steps]


def test_committed_rows_are_the_shared_ones():
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} absent (the committed copies are what the figures recompute from)")
    for path in sorted(SHARED.glob("*.csv")):
        assert (ROWS / path.name).read_bytes() == path.read_bytes(), path.name
