"""doctor on a correctly patched vllm/ package of each registry era gives no false finding, and finds each
part of the registration taken away; the registry reader reads every entry of each era's registries.

A tree is the release's files (single members of its wheel, cached under build/cache/members/) with its
patch set applied, plus the .dist-info pip leaves beside an installed wheel, so doctor reads the release's
version from beside the folder as it does for an install (not the environment's vLLM). doctor's checks of
a vLLM folder (installed_vllm_findings) run on it with a converted folder's config: the rest of doctor
reads only the converted folder, whose checks test_doctor.py covers."""

import ast
import functools
from pathlib import Path

import pytest

from ministream.fork import registry
from ministream.fork.patchset import apply_to_files, manifest, patch_set_dir
from ministream.fork.port import pristine_files
from ministream.fork.wheel import patched_version
from ministream.run.doctor import installed_vllm_findings
from ministream.spec import ARCH, MODEL_TYPE

# (config registry form, configs/__init__.py form): dict+imports (0.6, 0.8), lazy+imports (0.10),
# lazy+class-to-module (0.14), + AutoConfig.register of the registry's class at load (0.19), + `**{...}` (0.32)
ERAS = ["0.6.3", "0.8.5.post1", "0.10.2", "0.14.1", "0.19.1", "0.32.0"]
CONFIG_MODULE_FILE = "vllm/transformers_utils/configs/ministream.py"
CONFIG = {"architectures": [ARCH], "model_type": MODEL_TYPE}  # what these checks read of config.json


@functools.cache
def release(version: str) -> tuple[dict[str, str], dict[str, str]]:
    """(the release's files the patch touches, those files patched plus the files the patch adds)."""
    pristine = pristine_files(version)
    return pristine, apply_to_files(pristine, patch_set_dir(version))


def patched_tree(root: Path, version: str) -> Path:
    """The patched vllm/ package of `version` under `root`, installed as our wheel would be."""
    for rel, text in release(version)[1].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    info = root / f"vllm-{patched_version(version)}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {patched_version(version)}\n")
    return root / "vllm"


def findings(vllm: Path) -> list[str]:
    return [str(f) for f in installed_vllm_findings(CONFIG, vllm)]


def not_ok(found: list[str]) -> list[str]:
    return [f for f in found if not f.startswith("ok ")]


@pytest.mark.parametrize("version", ERAS)
def test_a_correctly_patched_tree_has_no_finding(version, tmp_path):
    found = findings(patched_tree(tmp_path, version))
    assert not not_ok(found), found
    patch = manifest(patch_set_dir(version))["patch_version"]
    assert any(f"installed vLLM {patched_version(version)} carries MiniStream patch {patch}" in f for f in found), found


def restore(vllm: Path, rel: str, version: str) -> None:
    (vllm.parent / rel).write_text(release(version)[0][rel])


# each part of the registration taken away, as a partly applied patch or a hand-edited tree leaves it
DAMAGE = {
    "registry.py as released": (
        lambda vllm, v: restore(vllm, registry.REGISTRY_PY, v),
        "error architecture: the installed vLLM does not register MiniStreamForCausalLM",
    ),
    "config.py as released": (
        lambda vllm, v: restore(vllm, registry.CONFIG_PY, v),
        "error model_type: 'ministream' is known to neither the installed vLLM nor transformers",
    ),
    "configs/__init__.py as released": (
        lambda vllm, v: restore(vllm, registry.CONFIGS_INIT_PY, v),
        "error model_type: the installed vLLM registers 'ministream', but "
        f"{registry.CONFIGS_INIT_PY} does not have its config class MiniStreamConfig",
    ),
    "configs/ministream.py removed": (
        lambda vllm, v: (vllm.parent / CONFIG_MODULE_FILE).unlink(),
        "error model_type: the installed vLLM registers 'ministream', but its config "
        f"class MiniStreamConfig is to come from {CONFIG_MODULE_FILE}, which is not "
        "there",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("version", ERAS)
def test_each_part_of_the_registration_taken_away_is_found(version, damage, tmp_path):
    vllm = patched_tree(tmp_path, version)
    spoil, words = DAMAGE[damage]
    spoil(vllm, version)
    found = not_ok(findings(vllm))
    assert len(found) == 1 and found[0].startswith(words) and "make install" in found[0], found


class _Names(dict):
    """Evaluation namespace in which an unknown name stands for itself (a class, by its name)."""

    def __missing__(self, name):
        return name


def evaluated(text: str, prefix: str) -> _Names:
    """The module-level assignments to names starting with `prefix`, evaluated in order as Python
    would, LazyConfigDict as a dict: what vLLM's registry holds, without vLLM."""
    names = _Names(LazyConfigDict=dict)
    for node in ast.parse(text).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id.startswith(prefix) and node.value is not None:
            names[target.id] = eval(compile(ast.Expression(node.value), prefix, "eval"), {}, names)
    return names


# 0.11.2: a class named bare in LazyConfigDict (deepseek_v32=DeepseekV3Config)
@pytest.mark.parametrize("version", [*ERAS, "0.11.2"])
def test_the_reader_reads_every_entry_of_each_era(version):
    files = release(version)[0]
    found = registry.read(files)
    assert found.config_types == evaluated(files[registry.CONFIG_PY], "_CONFIG_REGISTRY")["_CONFIG_REGISTRY"]
    assert (
        found.architectures
        == evaluated(files[registry.REGISTRY_PY], "_TEXT_GENERATION_MODELS")["_TEXT_GENERATION_MODELS"]
    )
    # and vLLM can load each config class from where the reader says (0.30's DeepseekV41Config is in no __all__)
    assert set(found.config_modules) == set(found.config_types)
