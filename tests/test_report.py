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
    # a log's tail, lines and bars in it, stays one row of as many cells; so does the plugin's reason
    run = data["versions"]["0.19.1"]["run"]
    run.update(stage="run", error="the server exited (1):\nTraceback | x\n  ModuleNotFoundError")
    run["plugin"] = {"ok": False, "cases": [], "error": "a\nb | c"}
    run["vllm_command"] = {"ok": False, "error": "`vllm --version` exited 1\nPackageNotFoundError"}
    table = report.versions_table(data).splitlines()
    assert len(table) == 4 and table[2].count("|") == table[0].count("|"), table
    assert "✗ run: the server exited (1): Traceback / x ModuleNotFoundError |" in table[2]
    assert "| ✗ a b / c | ✗ `vllm --version` exited 1 PackageNotFoundError |" in table[2]
    run["vllm_command"] = {"ok": True, "said": "0.19.1+ministream.0.1.0"}
    assert "| ✓ `0.19.1+ministream.0.1.0` |" in report.versions_table(data)


def test_two_runs_recording_at_once_each_keep_the_others_line(tmp_path):
    """A run that waits for the lock reads the file again when its turn comes: the line the other run wrote
    meanwhile stays (two `matrix --run` beside each other, each for its own versions)."""
    import select
    import subprocess
    import sys

    from ministream.atomic import lock

    report.write(tmp_path, {"versions": {"0.13.0": {"static": {}, "run": None}}})
    entry = {"0.32.0": {"static": {}, "run": None}}
    code = f"from ministream.checks import report; report.record({str(tmp_path)!r}, {entry!r})"
    with lock(tmp_path / report.DATA, "the other run"):
        waiting = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
        # the other run says it waits for the lock before it reads the file: change the file only then
        assert select.select([waiting.stderr], [], [], 60)[0], "the other run never said it was waiting"
        first = waiting.stderr.readline()
        data = report.load(tmp_path)
        data["versions"]["0.19.1"] = {"static": {}, "run": None}
        report.write(tmp_path, data)
    _, rest = waiting.communicate(timeout=60)
    said = first + rest
    assert waiting.returncode == 0 and "(the other run) to finish" in first, said
    assert set(report.load(tmp_path)["versions"]) == {"0.13.0", "0.19.1", "0.32.0"}
