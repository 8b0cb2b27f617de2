"""`ministream tune`: the CPU defaults chosen on the machine against vLLM's own (bench/tune.py), the record every
engine follows (run/tuned.py, engine.cpu_defaults), and an engine that follows it for real (full)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ministream.bench.tune import candidates, decide, faster
from ministream.run import engine, tuned


def rows(*cells):
    """Rows as workers.measure writes them: (batch, median, slowest, fastest)."""
    return [{"batch": b, "tokens_per_s": m, "tokens_per_s_range": [lo, hi]} for b, m, lo, hi in cells]


@pytest.mark.parametrize(
    "ours, vllm, want",
    [
        (rows((1, 60, 58, 62), (8, 400, 390, 410)), rows((1, 59, 55, 61), (8, 300, 290, 310)), True),  # apart at 8
        (rows((1, 62, 55, 70), (8, 400, 350, 420)), rows((1, 59, 50, 65), (8, 390, 380, 410)), False),  # overlap
        (rows((1, 80, 75, 85), (8, 300, 290, 310)), rows((1, 60, 55, 65), (8, 400, 390, 410)), False),  # loses at 8
        (rows((1, 60, 58, 62)), rows((1, 70, 68, 72)), False),  # slower beyond spread
        # the serving batch decides where it tells them apart, whatever batch 1 says (the cost stays recorded)
        (rows((1, 55, 50, 61), (64, 1600, 1500, 1700)), rows((1, 88, 79, 100), (64, 1000, 950, 1100)), True),
        (rows((1, 90, 85, 95), (64, 1000, 950, 1100)), rows((1, 60, 55, 65), (64, 1600, 1500, 1700)), False),
        # where it cannot, a smaller batch beyond the spread, and no loss
        (rows((1, 90, 85, 95), (64, 1000, 950, 1100)), rows((1, 60, 55, 65), (64, 1010, 940, 1090)), True),
    ],
)
def test_the_serving_batch_decides_else_faster_beyond_the_spread_and_slower_nowhere(ours, vllm, want):
    assert faster(ours, vllm) is want
    assert decide({"ours": ours, "vllm": vllm}) == {"binding": "ours" if want else "vllm", "zentorch": None}


def test_zentorch_is_judged_against_the_plain_platform_at_the_chosen_binding():
    vllm, ours = rows((1, 60, 58, 62)), rows((1, 50, 48, 52))  # vLLM's binding chosen
    assert decide({"vllm": vllm, "ours": ours, "zentorch": rows((1, 70, 65, 75))})["zentorch"] is True
    assert decide({"vllm": vllm, "ours": ours, "zentorch": rows((1, 55, 53, 57))})["zentorch"] is False
    assert decide({"vllm": vllm, "ours": ours, "zentorch": rows((1, 61, 57, 66))}) == {
        "binding": "vllm",
        "zentorch": False,  # within the spread: vLLM's own platform
    }
    with pytest.raises(ValueError, match="no batch size"):
        faster(rows((1, 1, 1, 1)), rows((8, 1, 1, 1)))


def test_candidates_hide_zentorch_but_the_zentorch_one_and_bind_as_named():
    envs = candidates("vllm")
    assert envs["vllm"][engine.BIND] == "auto" and envs["ours"][engine.BIND] == engine.core_binding(1)
    assert all(str(tuned.NO_ZENTORCH) in envs[n]["PYTHONPATH"].split(os.pathsep) for n in ("vllm", "ours"))
    assert envs["zentorch"] == {engine.BIND: "auto"}  # at the chosen binding, zentorch importable


def test_engines_follow_the_choice_at_one_rank_and_keep_a_core_per_rank_under_tp(monkeypatch):
    monkeypatch.setattr(engine, "has_gpu", lambda: False)
    vllms = {"binding": "vllm", "zentorch": False}
    assert engine.BIND not in engine.cpu_defaults(1, vllms)  # vLLM's own "auto"
    assert engine.cpu_defaults(1, vllms)["PYTHONPATH"] == str(tuned.NO_ZENTORCH)
    assert engine.cpu_defaults(2, vllms)[engine.BIND] == engine.core_binding(2)  # auto wants a core per rank more
    ours = engine.cpu_defaults(1, {"binding": "ours", "zentorch": True})
    assert ours[engine.BIND] == engine.core_binding(1) and "PYTHONPATH" not in ours
    monkeypatch.setattr(tuned, "chosen", lambda path=None: vllms)
    env = engine.engine_env(1, {"PYTHONPATH": "/mine", engine.BIND: "1"})
    assert env["PYTHONPATH"] == os.pathsep.join([str(tuned.NO_ZENTORCH), "/mine"]) and env[engine.BIND] == "1"
    again = engine.engine_env(1, env)
    assert again["PYTHONPATH"] == env["PYTHONPATH"]  # said once however often it is applied


def test_a_record_counts_only_on_the_machine_and_releases_it_was_measured_on(tmp_path, monkeypatch):
    record = tmp_path / "tune.json"
    monkeypatch.setenv(tuned.RECORD_ENV, str(record))
    assert tuned.chosen() is None and "not checked on this machine" in tuned.describe(None)
    choice = {"binding": "vllm", "zentorch": False}
    record.write_text(json.dumps({"schema": tuned.SCHEMA, "fingerprint": tuned.fingerprint(), "choice": choice}))
    assert tuned.chosen() == choice and str(record) in tuned.describe(choice)
    for changed in ({"cpu": "another CPU"}, {"cores": 64}, {"vllm": "0.33.0"}, {"torch": "2.14.0"}):
        other = {**tuned.fingerprint(), **changed}
        record.write_text(json.dumps({"schema": tuned.SCHEMA, "fingerprint": other, "choice": choice}))
        assert tuned.chosen() is None, changed
    hand_edited = [{"binding": "mine", "zentorch": False}, {"binding": "ours"}, {"binding": "ours", "zentorch": 1}, []]
    bad_records = [{"schema": 99, "fingerprint": tuned.fingerprint(), "choice": choice}] + [
        {"schema": tuned.SCHEMA, "fingerprint": tuned.fingerprint(), "choice": c} for c in hand_edited
    ]
    for bad in ("{", "[]", *map(json.dumps, bad_records)):
        record.write_text(bad)
        assert tuned.chosen() is None


def test_the_hidden_zentorch_fails_to_import_as_vllm_expects():
    r = subprocess.run(
        [sys.executable, "-c", "import zentorch"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tuned.NO_ZENTORCH)},
    )
    assert r.returncode == 1 and "ImportError: zentorch hidden by ministream tune" in r.stderr


def _record(path: Path, choice: dict) -> Path:
    path.write_text(json.dumps({"schema": tuned.SCHEMA, "fingerprint": tuned.fingerprint(), "choice": choice}))
    return path


@pytest.mark.full
@pytest.mark.vllm
def test_tune_measures_every_candidate_and_records_the_rule_s_choice(cli, tiny_hf, tmp_path):
    record = tmp_path / "record.json"
    env = {**os.environ, tuned.RECORD_ENV: str(record)}
    r = cli("tune", "--quick", "--model", tiny_hf, "--out", tmp_path / "out", env=env, timeout=1800)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = json.loads(record.read_text())
    assert got["fingerprint"] == tuned.fingerprint()
    runs = got["runs"]
    assert runs["vllm"]["env"][engine.BIND] == "auto" and runs["vllm"]["vllm_platform"] == "CpuPlatform"
    assert runs["ours"]["env"][engine.BIND] == engine.core_binding(1) and runs["ours"]["vllm_platform"] == "CpuPlatform"
    cells = {name: run["rows"] for name, run in runs.items() if run.get("vllm_platform") != "ZenCpuPlatform"}
    if tuned.fingerprint()["zentorch"] is not None and runs["zentorch"]["vllm_platform"] == "ZenCpuPlatform":
        cells["zentorch"] = runs["zentorch"]["rows"]
        assert (
            runs["zentorch"]["env"][engine.BIND]
            == {"ours": engine.core_binding(1), "vllm": "auto"}[got["choice"]["binding"]]
        )
    assert got["choice"] == decide(cells)
    assert all(len(run["rows"][0]["seconds"]) == 3 for run in runs.values())  # --quick's repeats, each a median
    assert f"(ministream tune, {record})" in r.stdout.splitlines()[-1]
    again = cli("tune", "--quick", "--model", tiny_hf, "--out", tmp_path / "out", env=env, timeout=120)
    assert again.returncode == 0 and "measured before on this machine" in again.stdout  # no engine started


@pytest.mark.full
@pytest.mark.vllm
@pytest.mark.parametrize("choice", [{"binding": "vllm", "zentorch": False}, {"binding": "ours", "zentorch": True}])
def test_an_engine_follows_the_record(cli, tiny_hf, tmp_path, choice):
    env = {**os.environ, tuned.RECORD_ENV: str(_record(tmp_path / "record.json", choice))}
    env.pop(engine.BIND, None)
    # the offline engine `generate` and `verify` start (generate.vllm_engine), and the platform vLLM picked
    code = (
        "import sys; from pathlib import Path; from ministream.run import engine, generate; "
        "settings = engine.EngineSettings(dtype='float32', max_model_len=64, enforce_eager=True); "
        "generate.vllm_engine(Path(sys.argv[1]), settings); from vllm.platforms import current_platform; "
        "print('platform:', type(current_platform).__name__)"
    )
    r = subprocess.run([sys.executable, "-c", code, tiny_hf], capture_output=True, text=True, env=env, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    bind = "auto" if choice["binding"] == "vllm" else engine.core_binding(1)
    assert f"VLLM_CPU_OMP_THREADS_BIND='{bind}'" in log  # the engine core's own report of its binding
    zen = tuned.fingerprint()["zentorch"] is not None and "avx512" in Path("/proc/cpuinfo").read_text()
    assert f"platform: {'ZenCpuPlatform' if zen and choice['zentorch'] else 'CpuPlatform'}" in r.stdout


def test_doctor_names_the_defaults_or_that_this_machine_was_never_measured(tmp_path, monkeypatch):
    from ministream.run.doctor import check_tuned

    monkeypatch.setenv(tuned.RECORD_ENV, str(tmp_path / "none.json"))
    found = check_tuned()
    assert found.level == "ok" and "not checked on this machine" in found.text and "`make tune` measures" in found.text
    monkeypatch.setenv(tuned.RECORD_ENV, str(_record(tmp_path / "r.json", {"binding": "vllm", "zentorch": None})))
    found = check_tuned()
    assert found.level == "ok" and found.text.startswith("vLLM's own core binding") and "r.json" in found.text
