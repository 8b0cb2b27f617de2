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
from ministream.run.generate import reference_generate


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
    assert decide({"ours": ours, "vllm": vllm}) == {
        "binding": "ours" if want else "vllm",
        "zentorch": None,
        "in_process": None,
    }


def test_zentorch_is_judged_against_the_plain_platform_at_the_chosen_binding():
    vllm, ours = rows((1, 60, 58, 62)), rows((1, 50, 48, 52))  # vLLM's binding chosen
    assert decide({"vllm": vllm, "ours": ours, "zentorch": rows((1, 70, 65, 75))})["zentorch"] is True
    assert decide({"vllm": vllm, "ours": ours, "zentorch": rows((1, 55, 53, 57))})["zentorch"] is False
    assert decide({"vllm": vllm, "ours": ours, "zentorch": rows((1, 61, 57, 66))}) == {
        "binding": "vllm",
        "zentorch": False,  # within the spread: vLLM's own platform
        "in_process": None,
    }
    with pytest.raises(ValueError, match="no batch size"):
        faster(rows((1, 1, 1, 1)), rows((8, 1, 1, 1)))


def test_the_core_in_process_is_judged_against_the_settings_chosen_before_it():
    vllm, ours, zen = rows((1, 60, 58, 62)), rows((1, 50, 48, 52)), rows((1, 80, 78, 82))
    # against zentorch where it won: 75 beats vLLM's 60 but not zentorch's 80
    assert decide({"vllm": vllm, "ours": ours, "zentorch": zen, "in_process": rows((1, 75, 73, 77))}) == {
        "binding": "vllm",
        "zentorch": True,
        "in_process": False,
    }
    # against the plain platform at vLLM's binding where zentorch lost
    slow_zen = rows((1, 40, 38, 42))
    assert decide({"vllm": vllm, "ours": ours, "zentorch": slow_zen, "in_process": rows((1, 75, 73, 77))}) == {
        "binding": "vllm",
        "zentorch": False,
        "in_process": True,
    }
    # the serving batch decides for it too: a batch-1 win does not outweigh a loss at 64
    fast1_slow64 = rows((1, 90, 88, 92), (64, 900, 880, 920))
    assert (
        decide(
            {
                "vllm": rows((1, 60, 58, 62), (64, 1000, 980, 1020)),
                "ours": rows((1, 50, 48, 52), (64, 800, 790, 810)),
                "in_process": fast1_slow64,
            }
        )["in_process"]
        is False
    )


def test_candidates_hide_zentorch_but_the_zentorch_one_and_bind_as_named():
    envs = candidates("vllm")
    assert envs["vllm"][engine.BIND] == "auto" and envs["ours"][engine.BIND] == engine.core_binding(1)
    assert all(str(tuned.NO_ZENTORCH) in envs[n]["PYTHONPATH"].split(os.pathsep) for n in ("vllm", "ours"))
    assert envs["zentorch"] == {engine.BIND: "auto"}  # at the chosen binding, zentorch importable
    # the core in process at the settings chosen: zentorch hidden unless it won
    assert envs["in_process"] == {**envs["vllm"], engine.IN_PROCESS: "0"}
    assert candidates("ours", True)["in_process"] == {engine.BIND: engine.core_binding(1), engine.IN_PROCESS: "0"}
    assert "in_process" not in candidates()


@pytest.mark.every_core  # tensor parallelism: a core per rank
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


def test_an_offline_engine_s_core_runs_in_process_only_where_chosen_and_at_one_rank(monkeypatch):
    monkeypatch.setattr(engine, "has_gpu", lambda: False)
    inproc = {"binding": "ours", "zentorch": None, "in_process": True}
    assert engine.offline_defaults(1, 1, inproc) == {engine.IN_PROCESS: "0"}
    assert engine.offline_defaults(2, 1, inproc) == {} and engine.offline_defaults(1, 2, inproc) == {}
    for other in (
        {**inproc, "in_process": False},
        {**inproc, "in_process": None},
        {"binding": "ours", "zentorch": None},
    ):
        assert engine.offline_defaults(1, 1, other) == {}
    assert engine.IN_PROCESS not in engine.cpu_defaults(1, inproc)  # a server's environment never gets it
    monkeypatch.setattr(engine, "has_gpu", lambda: True)
    assert engine.offline_defaults(1, 1, inproc) == {}


@pytest.mark.every_core  # tensor parallelism: a core per rank
def test_the_in_process_default_is_taken_back_for_an_engine_it_does_not_fit_and_a_user_s_own_kept(monkeypatch):
    monkeypatch.setattr(engine, "has_gpu", lambda: False)
    monkeypatch.setattr(tuned, "chosen", lambda path=None: {"binding": "ours", "zentorch": None, "in_process": True})
    monkeypatch.setattr(engine, "_SET_HERE", set())
    before = dict(os.environ)  # use_defaults writes this process's environment: restored whole below
    try:
        os.environ.pop(engine.IN_PROCESS, None)
        engine.use_defaults(1)
        assert os.environ[engine.IN_PROCESS] == "0"
        engine.use_defaults(2)  # vLLM starts its ranks from processes of their own: the caller's set is gone
        assert engine.IN_PROCESS not in os.environ
        os.environ[engine.IN_PROCESS] = "1"  # the user's word
        engine.use_defaults(1)
        engine.use_defaults(2)
        assert os.environ[engine.IN_PROCESS] == "1"
    finally:
        os.environ.clear()
        os.environ.update(before)


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
    before_in_process = {"binding": "ours", "zentorch": None}  # a record tune wrote before it measured the core
    record.write_text(
        json.dumps({"schema": tuned.SCHEMA, "fingerprint": tuned.fingerprint(), "choice": before_in_process})
    )
    assert tuned.chosen() == before_in_process
    hand_edited = [
        {"binding": "mine", "zentorch": False},
        {"binding": "ours"},
        {"binding": "ours", "zentorch": 1},
        {"binding": "ours", "zentorch": None, "in_process": 1},
        {"binding": "ours", "zentorch": None, "in_process": "yes"},
        [],
    ]
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
    chosen_bind = {"ours": engine.core_binding(1), "vllm": "auto"}[got["choice"]["binding"]]
    cells = {name: runs[name]["rows"] for name in ("vllm", "ours", "in_process")}
    if tuned.fingerprint()["zentorch"] is not None and runs["zentorch"]["vllm_platform"] == "ZenCpuPlatform":
        cells["zentorch"] = runs["zentorch"]["rows"]
        assert runs["zentorch"]["env"][engine.BIND] == chosen_bind
    # the core in process, at the binding and platform chosen before it
    inproc = runs["in_process"]
    assert inproc["engine_core"] == "InprocClient" and inproc["env"][engine.IN_PROCESS] == "0"
    assert all(runs[n]["engine_core"] == "SyncMPClient" for n in runs if n != "in_process")
    assert inproc["env"][engine.BIND] == chosen_bind
    assert inproc["vllm_platform"] == ("ZenCpuPlatform" if got["choice"]["zentorch"] else "CpuPlatform")
    assert got["choice"] == decide(cells) and got["choice"]["in_process"] in (True, False)
    assert all(len(run["rows"][0]["seconds"]) == 3 for run in runs.values())  # --quick's repeats, each a median
    assert f"(ministream tune, {record})" in r.stdout.splitlines()[-1]
    again = cli("tune", "--quick", "--model", tiny_hf, "--out", tmp_path / "out", env=env, timeout=120)
    assert again.returncode == 0 and "measured before on this machine" in again.stdout  # no engine started


@pytest.mark.full
@pytest.mark.vllm
@pytest.mark.parametrize(
    "choice",
    [
        {"binding": "vllm", "zentorch": False},
        {"binding": "ours", "zentorch": True},
        {"binding": "ours", "zentorch": False, "in_process": True},
    ],
)
def test_an_engine_follows_the_record(cli, tiny_hf, tmp_path, choice):
    env = {**os.environ, tuned.RECORD_ENV: str(_record(tmp_path / "record.json", choice))}
    env.pop(engine.BIND, None)
    # the offline engine `generate` and `verify` start (generate.vllm_engine), and the platform vLLM picked
    code = (
        "import sys; from pathlib import Path; from ministream.run import engine, generate; "
        "settings = engine.EngineSettings(dtype='float32', max_model_len=64, enforce_eager=True); "
        "llm = generate.vllm_engine(Path(sys.argv[1]), settings); from vllm.platforms import current_platform; "
        "print('platform:', type(current_platform).__name__); "
        "print('core:', type(llm.llm_engine.engine_core).__name__); import os; "
        "print('bind:', os.environ.get('VLLM_CPU_OMP_THREADS_BIND')); "
        "print('ids:', generate.vllm_generate(llm, [[0, 5, 9, 13]], 8)[0]['ids'])"
    )
    r = subprocess.run([sys.executable, "-c", code, tiny_hf], capture_output=True, text=True, env=env, timeout=900)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    bind = "auto" if choice["binding"] == "vllm" else engine.core_binding(1)
    if choice.get("in_process"):  # the worker runs in this process and reads this environment
        assert f"bind: {bind}" in r.stdout
    else:
        assert f"VLLM_CPU_OMP_THREADS_BIND='{bind}'" in log  # the engine core's own report of its binding
    zen = tuned.fingerprint()["zentorch"] is not None and "avx512" in Path("/proc/cpuinfo").read_text()
    assert f"platform: {'ZenCpuPlatform' if zen and choice['zentorch'] else 'CpuPlatform'}" in r.stdout
    # the core in the caller's process where the record says so, in its own elsewhere; the tokens the same
    assert f"core: {'InprocClient' if choice.get('in_process') else 'SyncMPClient'}" in r.stdout
    assert f"ids: {reference_generate(tiny_hf, [[0, 5, 9, 13]], 8)[0]['ids']}" in r.stdout


def test_doctor_names_the_defaults_or_that_this_machine_was_never_measured(tmp_path, monkeypatch):
    from ministream.run.doctor import check_tuned

    monkeypatch.setenv(tuned.RECORD_ENV, str(tmp_path / "none.json"))
    found = check_tuned()
    assert found.level == "ok" and "not checked on this machine" in found.text and "`make tune` measures" in found.text
    monkeypatch.setenv(tuned.RECORD_ENV, str(_record(tmp_path / "r.json", {"binding": "vllm", "zentorch": None})))
    found = check_tuned()
    assert found.level == "ok" and found.text.startswith("vLLM's own core binding") and "r.json" in found.text


def test_the_core_in_process_is_named_where_offline_engines_take_it_and_not_on_serve_s_line(tmp_path, monkeypatch):
    choice = {"binding": "ours", "zentorch": None, "in_process": True}
    monkeypatch.setenv(tuned.RECORD_ENV, str(_record(tmp_path / "r.json", choice)))
    assert "an offline engine's core in its caller's process" in tuned.describe(choice)
    assert "core in its caller's process" not in tuned.describe(choice, offline=False)
    assert "core in its caller's process" not in tuned.describe({**choice, "in_process": False})


def test_the_suites_offline_engines_run_with_the_core_in_process_and_its_servers_do_not():
    """conftest.py's record holds on this machine (a fingerprint that no longer matched would silently give the
    suite vLLM's own layout back, and two vLLM imports more per engine)."""
    assert tuned.chosen() == {"binding": "ours", "zentorch": None, "in_process": True}
    assert engine.offline_defaults(1) == {engine.IN_PROCESS: "0"} and engine.offline_defaults(2) == {}
    assert engine.IN_PROCESS not in engine.defaults(1)  # what a server's environment gets
