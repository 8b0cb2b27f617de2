"""vllm-tests: vLLM's own tests that concern MiniStream, run from the patched source tree against the
installed patched vLLM, offline.

    ministream vllm-tests 0.32.0              the MiniStream cases of tests/models/test_registry.py and
                                              test_initialization.py, and the patch set's generation test
    ministream vllm-tests 0.32.0 --compare    also every other case of test_registry.py, and the small
                                              subset of test_initialization.py, before and after the patch

The example models named in the tree's tests/models/registry.py (ministream/ministream-<preset>) are
made by `checkpoint` + `convert` and put in a Hugging Face cache of our own (build/vllm-tests/hf-home),
read with HF_HUB_OFFLINE=1: no test looks anything up on the network.

pytest runs with the tree's root as its folder but `--import-mode=append` and `python -P`, so `import
vllm` is the installed build (with its compiled kernels), never the tree's bare vllm/ source.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import git

from .. import MiniStreamError
from ..checkpoint.convert import convert
from ..checkpoint.demo import PRESETS, make_checkpoint
from ..fork import patchset
from ..fork.install import installed_vllm
from ..fork.patch import applied_hash
from ..fork.release import release_wheel
from ..fork.wheel import LOCAL_LABEL
from ..paths import BUILD, CACHE
from ..run.engine import IN_PROCESS
from ..spec import ARCH

EXAMPLES = "tests/models/registry.py"
TEST_FILES = ["tests/models/test_registry.py", "tests/models/test_initialization.py"]
# The cases that concern MiniStream: ours by name, and the check that every architecture has an example.
SELECT = f"{ARCH} or ministream or test_hf_registry_coverage"
# --quick (make test): the generation test's fp32 case of the extra example model (ministream-tiny: MHA, tied)
# left to the full run; the main one (ministream-tiny-gqa) holds every variant, and make test's own suite
# holds the MHA model to the reference model in fp32 (test_verify.py)
QUICK = f"({SELECT}) and not (test_models_float32 and not gqa)"
REPO = re.compile(r"^ministream/ministream-(?P<preset>[\w-]+)$")  # example model id -> checkpoint preset
# What the before/after comparison runs in full, and test_initialization.py's representative subset.
COMPARE = ["tests/models/test_registry.py", "tests/models/test_initialization.py::test_can_initialize_small_subset"]


def example_models(tree: Path) -> list[str]:
    """The hub ids of the MiniStream example models, read from the tree's tests/models/registry.py."""
    text = (tree / EXAMPLES).read_text()
    m = re.search(rf'"{ARCH}": _HfExamplesInfo\((?P<body>.*?)\n    \),', text, re.S)
    if not m:
        raise MiniStreamError(
            f"{tree / EXAMPLES} has no {ARCH} entry: the tree lacks the patch set's upstream "
            f"part; run `make patch` on a source tree (the sdist, a checkout) first"
        )
    ids = re.findall(r'"([\w.-]+/[\w.-]+)"', m.group("body"))
    for repo in ids:
        match = REPO.match(repo)
        if not match or match["preset"] not in PRESETS:
            raise MiniStreamError(
                f"{tree / EXAMPLES}: example model {repo} is not ministream/ministream-<preset> "
                f"with a preset of `ministream checkpoint` ({', '.join(PRESETS)})"
            )
    return ids


def _quiet(*args, **kwargs):
    pass


def hf_cache(repos: list[str], home: Path, log=print) -> Path:
    """A Hugging Face cache (HF_HOME) holding each example model, made once: checkpoint + convert."""
    for repo in repos:
        entry = home / "hub" / f"models--{repo.replace('/', '--')}"
        if (entry / "refs" / "main").is_file():
            continue
        match = REPO.match(repo)
        assert match, f"{repo} is not an example model's id (example_models checks them)"
        preset = match["preset"]
        log(f"making the example model {repo} (preset {preset}) in {home}")
        with tempfile.TemporaryDirectory(dir=home.parent if home.parent.exists() else None) as tmp:
            make_checkpoint(Path(tmp) / "raw", preset, log=_quiet, cache=CACHE)
            convert(Path(tmp) / "raw", Path(tmp) / "hf", log=_quiet)
            # a snapshot is named by a commit hash; ours is the content's, so it is the same each time
            h = hashlib.sha1()
            for f in sorted((Path(tmp) / "hf").iterdir()):
                h.update(f.name.encode() + f.read_bytes())
            partial = Path(tmp) / "entry"
            shutil.copytree(Path(tmp) / "hf", partial / "snapshots" / h.hexdigest())
            (partial / "refs").mkdir()
            (partial / "refs" / "main").write_text(h.hexdigest())
            entry.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(entry, ignore_errors=True)
            shutil.move(partial, entry)
    return home


def _environment(home: Path, device: str, extra: dict | None = None, quick: bool = False) -> dict:
    """The environment vLLM's tests run in. quick (make test): each engine's core and worker in the test's own
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's own switch): two vLLM imports fewer per engine, about 1 min
    of make test on 2 cores; the full run keeps vLLM's own layout. A user's own setting wins."""
    env = dict(
        os.environ,
        HF_HOME=str(home.resolve()),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        **(extra or {}),
    )
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if quick:
        env.setdefault(IN_PROCESS, "0")
    if device == "cpu":
        # The sdist's vllm.egg-info (at the tree's root, on sys.path under pytest) names a distribution
        # "vllm" without "cpu" in its version, which vLLM's platform detection would take for a GPU build.
        env["VLLM_TARGET_DEVICE"] = "cpu"
    return env


def pytest_run(tree: Path, args: list[str], env: dict, report: Path, python: Path | None = None) -> dict:
    """Run pytest in `tree` (by `python`, this interpreter by default); {test id: passed|failed|skipped|error}
    from its JUnit report."""
    report.unlink(missing_ok=True)
    cmd = [
        str(python) if python else sys.executable,
        "-P",
        "-m",
        "pytest",
        "--import-mode=append",
        "-p",
        "no:cacheprovider",
        "-ra",
        f"--junitxml={report}",
        *args,
    ]
    print("+ (cd", tree, "&&", " ".join(cmd[1:]) + ")", flush=True)
    subprocess.run(cmd, cwd=tree, env=env)
    if not report.is_file():
        raise MiniStreamError(f"pytest wrote no report ({report}); see its output above")
    return outcomes(report)


def counts(results: dict[str, str]) -> dict[str, int]:
    """How many cases ended each way."""
    return {k: sum(o == k for o in results.values()) for k in ("passed", "failed", "skipped", "error")}


def outcomes(report: Path) -> dict[str, str]:
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("error", "failure", "skipped") if k in kinds), "passed")
        results[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(outcome, outcome)
    return results


def _check_installed(version: str, tree: Path) -> str:
    """The device of the installed vLLM, refused unless it is our patched build of `version`."""
    installed = installed_vllm()
    if not installed or installed[0].split("+")[0] != version or f"+{LOCAL_LABEL}" not in installed[0]:
        found = installed[0] if installed else "none"
        raise MiniStreamError(
            f"vLLM's tests run against the installed patched vLLM {version}, but the installed "
            f"vLLM is {found}; run `make install VLLM_VERSION={version}` first"
        )
    head = git.Repo(tree).head.commit
    if applied_hash(head) is None:
        raise MiniStreamError(
            f"{tree} is not patched (HEAD is not a MiniStream patch commit); run "
            f"`make patch VLLM_VERSION={version}` first"
        )
    return installed[1]


def run_vllm_tests(
    version: str,
    tree: Path | None = None,
    compare: bool = False,
    out: Path = BUILD / "vllm-tests",
    quick: bool = False,
) -> int:
    """`ministream vllm-tests VERSION`: the exit status (1 when a MiniStream case fails or is skipped)."""
    tree = Path(tree) if tree else BUILD / f"vllm-{version}"
    if not patchset.is_source_tree(tree):
        raise MiniStreamError(
            f"{tree} is not a vLLM source tree (no tests/); `make patch VLLM_VERSION={version}` "
            f"makes one from the release's sdist, or pass a patched checkout with --tree"
        )
    device = _check_installed(version, tree)
    out.mkdir(parents=True, exist_ok=True)
    home = hf_cache(example_models(tree), out / "hf-home")
    env = _environment(home, device, quick=quick)
    files = [*TEST_FILES, *_generation_tests(tree)]
    results = pytest_run(
        tree.resolve(), [*files, "-k", QUICK if quick else SELECT], env, out.resolve() / "ministream.xml"
    )
    ours = {t: o for t, o in results.items() if ARCH in t or "ministream" in t}
    bad = {t: o for t, o in results.items() if o != "passed"}
    print(
        f"\nvLLM {version}'s tests on {tree}: {len(results)} selected, "
        + ", ".join(f"{n} {k}" for k, n in counts(results).items())
    )
    for t, o in bad.items():
        print(f"  {o}: {t}")
    summary = {"version": version, "device": device, "results": results}
    if compare:
        summary["compare"] = before_after(version, tree, home, device, out)
    (out / f"vllm-{version}.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not ours or bad:
        print(
            f"error: {'no MiniStream case ran' if not ours else 'some cases did not pass'} "
            f"(a skipped MiniStream case counts as not passing)"
        )
        return 1
    return 0


def _generation_tests(tree: Path) -> list[str]:
    found = sorted(p.relative_to(tree).as_posix() for p in (tree / "tests").rglob("test_ministream.py"))
    if not found:
        raise MiniStreamError(
            f"{tree} has no tests/**/test_ministream.py: the patch set's upstream part is not "
            f"applied; re-run `make patch` on a source tree"
        )
    return found


def before_after(version: str, tree: Path, home: Path, device: str, out: Path) -> dict:
    """The other cases of vLLM's test files, on the pristine tree with the stock release and on the
    patched tree with the patched build: the patch must change nothing but the MiniStream cases."""
    stock = out / f"stock-{version}-{device}"
    if not stock.is_dir():  # the stock release, verified, unpacked; first on PYTHONPATH it shadows ours
        tmp = Path(tempfile.mkdtemp(prefix=".stock-", dir=out))
        try:
            shutil.unpack_archive(release_wheel(version, device), tmp, "zip")
            tmp.rename(stock)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    pristine = out / f"pristine-{version}"
    repo = git.Repo(tree)
    base = repo.head.commit.parents[0].hexsha
    if pristine.exists():
        shutil.rmtree(pristine)
        repo.git.worktree("prune")
    repo.git.worktree("add", "--detach", str(pristine.resolve()), base)
    try:
        before = pytest_run(
            pristine.resolve(),
            COMPARE,
            _environment(home, device, {"PYTHONPATH": str(stock.resolve())}),
            out.resolve() / "before.xml",
        )
    finally:
        repo.git.worktree("remove", "--force", str(pristine.resolve()))
    after = pytest_run(tree.resolve(), COMPARE, _environment(home, device), out.resolve() / "after.xml")
    tally = {"before": counts(before), "after": counts(after)}
    changed = {
        t: [before.get(t), after.get(t)] for t in sorted(set(before) | set(after)) if before.get(t) != after.get(t)
    }
    print(f"before the patch: {tally['before']}\nafter the patch:  {tally['after']}")
    for t, (b, a) in changed.items():
        print(f"  {t}: {b} -> {a}")
    return {"files": COMPARE, "counts": tally, "changed": changed}
