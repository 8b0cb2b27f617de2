"""The matrix's `internals` check: what our tools reach inside vLLM (fork/internals.py), resolved in each release's
own files. A name a release moved is a failing cell naming the tool, the name and the release; vLLM 0.34.0's
changes (the V1 model runner, its sampler and VLLM_USE_V2_MODEL_RUNNER deleted; the x86 CPU platform needing
triton-cpu) are the cases. Real release files throughout (build/cache/members, else PyPI's wheels by range).
"""

import importlib.util
from pathlib import Path

import pytest

from ministream.checks.internals_check import _Source, import_needs, internals, runners
from ministream.checks.model_checks import Failed, Release
from ministream.fork.internals import BENCH_STEP, RUNNER_PARTS, Env, Name, Need, Runner, cpu_needs_triton
from ministream.fork.patchset import patch_set_dir
from ministream.fork.release import release_files
from ministream.run.doctor import check_triton


def check(version: str, tmp_path, needs=None) -> str:
    """The check on `version`'s own files (an empty tree: every file comes from the release wheel)."""
    return internals(tmp_path, tmp_path, version, patch_set_dir(version), needs)


def test_the_newest_release_resolves_every_name_our_tools_reach(tmp_path):
    detail = check("0.34.0", tmp_path)
    assert "bench-step 10" in detail and "doctor 3" in detail and "CPU part (fork/cpu.py) 2" in detail
    assert detail.endswith("the x86 CPU platform requires Triton (triton-cpu)")


def test_an_old_release_says_which_tools_begin_later(tmp_path):
    assert "later eras: " in check("0.6.3", tmp_path) and f"bench-step from {BENCH_STEP}" in check("0.6.3", tmp_path)


# what 0.34.0 deleted, as a tool reached it before -> (a release where it resolves, what the failing cell names)
DELETED_IN_0_34 = {
    "the switch between the runners": (
        Env("VLLM_USE_V2_MODEL_RUNNER"),
        "0.31.0",
        "vllm/envs.py has no VLLM_USE_V2_MODEL_RUNNER",
    ),
    "the V1 runner's module": (
        Name("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
        "0.31.0",
        "no module vllm.v1.worker.gpu_model_runner",
    ),
    "the V1 sampler": (Name("vllm.v1.sample.sampler", "Sampler"), "0.31.0", "no module vllm.v1.sample.sampler"),
    # bench-step's timers as they were: the V1 runner's names only (0.12-0.33 build the V2 runner too, with Triton)
    "a V1 runner method": (
        Runner("forward", ("_model_forward",)),
        "0.11.2",
        "StandaloneCPUModelRunner (vllm/v1/worker/cpu/standalone_model_runner.py) that CPUWorker builds has none of "
        "_model_forward",
    ),
}


@pytest.mark.parametrize("case", DELETED_IN_0_34)
def test_a_name_0_34_deleted_is_a_failing_cell_not_a_traceback(case, tmp_path):
    what, resolves, said = DELETED_IN_0_34[case]
    needs = (Need("bench-step", BENCH_STEP, what),)
    assert check(resolves, tmp_path, needs).startswith("bench-step 1, CPU part")
    with pytest.raises(Failed) as failed:
        check("0.34.0", tmp_path, needs)
    assert str(failed.value).startswith("bench-step: ") and said in str(failed.value)
    assert "in vLLM 0.34.0" in str(failed.value) and "ministream/fork/internals.py" in str(failed.value)


def test_bench_steps_parts_have_a_name_on_every_runner_of_both_eras(tmp_path):
    # 0.32.0's CPU worker builds the V1 runner, or the V2 one with Triton; 0.34.0's only the V2 one (or, on a
    # CPU other than x86 without Triton, its standalone runner)
    for version, built in (("0.32.0", 4), ("0.34.0", 4)):
        found = runners(_Source(Release(version, tmp_path)))
        assert len(found) == built, found
        needs = tuple(Need("bench-step", BENCH_STEP, Runner(p, names)) for p, names in RUNNER_PARTS.items())
        assert check(version, tmp_path, needs).startswith(f"bench-step {len(RUNNER_PARTS)}, CPU part")


def test_a_need_before_its_era_is_not_asked(tmp_path):
    needs = (Need("a later tool", "0.35.0", Name("vllm.not_yet")),)
    assert check("0.34.0", tmp_path, needs).startswith("CPU part (fork/cpu.py) 2 resolve; later eras: a later tool")


def test_a_module_that_imports_vllm_without_an_era_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "newtool.py").write_text("def go():\n    from vllm.v1.engine import core\n")
    with pytest.raises(Failed, match=r"ministream/run/newtool.py imports vllm \(vllm.v1.engine\) and states no era"):
        import_needs(tmp_path)


def test_a_version_ask_the_cpu_part_would_miss_is_caught(tmp_path):
    main = "vllm/entrypoints/cli/main.py"
    text = release_files("0.34.0", [main])[main]
    planted = text.replace("importlib.metadata.version(", "metadata_version(")
    assert planted != text
    (tmp_path / main).parent.mkdir(parents=True)
    (tmp_path / main).write_text("from importlib.metadata import version as metadata_version\n" + planted)
    with pytest.raises(Failed, match=r"CPU part \(fork/cpu.py\): vllm/entrypoints/cli/main.py asks version\('vllm'\)"):
        check("0.34.0", tmp_path, ())


@pytest.mark.parametrize("version, needs", [("0.33.0", False), ("0.34.0", True)])
def test_doctor_reports_the_triton_cpu_that_0_34s_x86_platform_needs(version, needs, tmp_path):
    cpu_py = "vllm/platforms/cpu.py"
    text = release_files(version, [cpu_py])[cpu_py]
    assert cpu_needs_triton(text) is needs
    (tmp_path / cpu_py).parent.mkdir(parents=True)
    (tmp_path / cpu_py).write_text(text)
    found = check_triton(tmp_path / "vllm", machine="x86_64")
    if not needs:
        assert found is None
    else:
        spec = importlib.util.find_spec("triton")
        has_cpu = spec is not None and spec.origin is not None and (Path(spec.origin).parent / "backends/cpu").is_dir()
        assert found is not None and found.level == ("ok" if has_cpu else "error"), found
        assert "triton-cpu" in found.text
        assert check_triton(tmp_path / "vllm", machine="aarch64") is None  # vLLM's rule is for x86 only
