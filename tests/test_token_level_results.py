"""Every number docs/study.md's "The token level, diagnosed" quotes, recomputed from the committed
rows: studies/token_level/results/runs.csv (this study) and studies/breadth/results/runs.csv (the
breadth study's part 3, read with this study's auc)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "studies" / "confirmatory"))
from studies.token_level import token_study  # noqa: E402

DOC = REPO / "docs" / "study.md"


def _section() -> str:
    text = DOC.read_text()
    start = text.index("## The token level, diagnosed")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _fmt(r: dict) -> str:
    lo, hi = r["ci"]
    return f"{r['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def test_the_breadth_rows_auc_contrasts_are_the_quoted_ones():
    rows = {(r["arm"], r["reference"]): r for r in token_study.breadth_auc(token_study.BREADTH_ROWS)}
    section = _section()
    for (arm, ref), r in rows.items():
        assert r["seeds"] == 16
        assert _fmt(r) in section, (arm, ref, _fmt(r))
        positive = sum(d > 0 for d in r["diffs"])
        assert f"{positive} of 16" in section
        assert _fmt(r) in (REPO / "README.md").read_text(), (arm, ref, "README")


RUNS = REPO / "studies" / "token_level" / "results" / "runs.csv"


def _recomputed() -> tuple[list[dict], dict]:
    stats = token_study.read_rows(RUNS)
    protocol = token_study.base.read_protocol(token_study.PROTOCOL)
    return stats, token_study.analyse(stats, protocol)


def test_every_table_line_the_docs_quote_recomputes_from_the_committed_rows():
    """The run table, the token classes and the accuracy contrasts, from runs.csv through the analysis."""
    stats, result = _recomputed()
    protocol = token_study.base.read_protocol(token_study.PROTOCOL)
    section = _section()
    lines = token_study.run_table(stats, protocol["arms_per_seed"]) + token_study.class_lines(result)
    lines += token_study.contrast_lines(result["family_a"], protocol["alpha"])
    for line in lines:
        assert line in section, line


def test_every_row_carries_the_protocols_commit_and_blob():
    stats = token_study.read_rows(RUNS)
    assert stats
    rel = token_study.PROTOCOL_REL
    state = {(r["protocol_commit"], r["protocol_blob"], r["protocol_path"]) for r in stats}
    assert state == {(token_study.base.content_commit(rel), _blob(rel), rel)}


def _blob(rel: str) -> str:
    import subprocess

    return subprocess.run(["git", "-C", str(REPO), "hash-object", rel], capture_output=True, text=True).stdout.strip()
