"""report: docs/matrix.json holds a recorded run of every CPU line, and docs/versions.md is generated from it."""

from pathlib import Path

from ministream.checks import report
from ministream.fork.patchset import supported_versions
from ministream.fork.release import cpu_lines

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_versions_table_is_generated_from_docs_matrix_json(tmp_path):
    data = report.load(DOCS)
    written = report.write(tmp_path, data)
    assert [p.name for p in written] == [report.DATA, report.TABLE]
    assert (tmp_path / report.TABLE).read_text() == (DOCS / report.TABLE).read_text(), (
        "run `make matrix RUN=1` (never edit docs/versions.md)"
    )
    assert report.load(tmp_path) == report.load(DOCS)


def test_every_cpu_line_has_a_recorded_run_and_every_other_release_says_static_only():
    data = report.load(DOCS)["versions"]
    assert set(data) == set(supported_versions())
    for v, entry in data.items():
        if v in cpu_lines():
            run = entry["run"]
            assert run and run["version"] == v and run.get("machine"), v
            assert run["ok"] or (run.get("stage") and run.get("error")), f"{v}: a failure must name its stage and error"
        else:
            assert entry["run"] is None, v


def test_a_failed_line_shows_its_stage_and_error_in_the_table():
    data = {
        "versions": {
            "0.19.1": {
                "static": {"applies": True},
                "run": {"ok": False, "stage": "install", "error": "no wheel", "cases": [], "seconds": {"total": 60}},
            }
        }
    }
    row = report.versions_table(data).splitlines()[2]
    assert row.startswith("| 0.19.1 | ✓ | ✗ install: no wheel |")
