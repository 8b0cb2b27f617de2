"""`ministream port`: a patch set carried to another vLLM release by three-way merge.

The merge rules on small texts first, then on the real releases (cached release wheels):
the committed patch sets must be exactly what the port tool makes of their sources.
"""

import json
import shutil
from pathlib import Path

import pytest

from ministream import MiniStreamError
from ministream.fork.patch import PATCHES, manifest, patch_dir, supported_versions
from ministream.fork.port import (
    CONFIG, CONFIGS, REGISTRY, _report, add_architecture, add_config, config_forms, file_diff, merge_model,
    port, release_files,
)

# the committed patch sets that CI re-derives (each needs its own and its source's release wheel)
BOUNDARY = ["0.6.3", "0.6.6.post1", "0.8.5.post1", "0.10.2", "0.11.2", "0.20.2", "0.29.0", "0.33.0"]


# --- the merge, on small texts ----------------------------------------------------------------

BASE = '''"""Inference-only LLaMA model."""

import torch


class LlamaModel:
    def forward(self, x):
        return x


class LlamaForCausalLM:
    def __init__(self):
        self.model = LlamaModel()

    def load_weights(self, weights):
        return weights


class LlamaBidirectionalModel(LlamaForCausalLM):
    pass
'''
OURS = '''"""MiniStream, from vLLM 1.0 llama.py (patches/v1.0/model.diff)."""

import torch

MINISTREAM_PATCH_VERSION = "1.0-3"


# identical to LlamaModel except: the name
class MiniStreamModel:
    def forward(self, x):
        return x


# identical to LlamaForCausalLM except: the name
class MiniStreamForCausalLM:
    def __init__(self):
        self.model = MiniStreamModel()

    def load_weights(self, weights):
        return weights
'''


def test_a_release_that_changes_only_untouched_lines_merges_cleanly():
    theirs = BASE.replace("import torch\n", "import torch\nimport os\n")
    port = merge_model(BASE, OURS, theirs, "1.0", "1.1")
    assert not port.conflicts
    assert "import torch\nimport os\n" in port.text
    assert "class MiniStreamModel:" in port.text


def test_our_lines_that_name_the_release_name_the_new_one():
    port = merge_model(BASE, OURS, BASE, "1.0", "1.1")
    assert 'MINISTREAM_PATCH_VERSION = "1.1-3"' in port.text
    assert '"""MiniStream, from vLLM 1.1 llama.py (patches/v1.1/model.diff)."""' in port.text


def test_a_change_on_a_line_we_only_renamed_takes_theirs_renamed():
    theirs = BASE.replace("class LlamaModel:", "class LlamaModel(Base):")
    port = merge_model(BASE, OURS, theirs, "1.0", "1.1")
    assert not port.conflicts and len(port.resolved) == 1
    assert "# identical to LlamaModel except: the name\nclass MiniStreamModel(Base):\n" in port.text


def test_new_references_to_a_renamed_class_are_renamed_in_code_not_in_comments():
    theirs = BASE.replace("        return x\n", "        # LlamaModel again\n        return LlamaModel.f(x)\n")
    port = merge_model(BASE, OURS, theirs, "1.0", "1.1")
    assert "        # LlamaModel again\n        return MiniStreamModel.f(x)\n" in port.text
    assert port.renamed == ["line 12: LlamaModel -> MiniStreamModel"]
    assert "# identical to LlamaModel except: the name" in port.text


def test_a_region_we_deleted_stays_deleted_when_they_change_it():
    theirs = BASE.replace("class LlamaBidirectionalModel(LlamaForCausalLM):\n    pass\n",
                          "class LlamaBidirectionalModel(LlamaForCausalLM):\n    x = 1\n")
    port = merge_model(BASE, OURS, theirs, "1.0", "1.1")
    assert not port.conflicts and len(port.dropped) == 1
    assert "Bidirectional" not in port.text


def test_a_real_conflict_is_listed_with_both_sides():
    ours = OURS.replace("        return x\n", "        return x * 2\n", 1)
    theirs = BASE.replace("        return x\n", "        return x + 1\n", 1)
    port = merge_model(BASE, ours, theirs, "1.0", "1.1")
    assert len(port.conflicts) == 1
    hunk = port.conflicts[0].hunk
    assert hunk.startswith("<<<<<<< ministream.py@1.0\n        return x * 2\n=======\n        return x + 1\n")
    assert hunk.endswith(">>>>>>> llama.py@1.1\n")
    assert port.text.splitlines()[port.conflicts[0].line - 1] == "<<<<<<< ministream.py@1.0"


def test_a_recorded_resolution_resolves_the_same_conflict():
    ours = OURS.replace("        return x\n", "        return x * 2\n", 1)
    theirs = BASE.replace("        return x\n", "        return x + 1\n", 1)
    resolution = {"ours": "        return x * 2\n", "theirs": "        return x + 1\n",
                  "resolution": "        return (x + 1) * 2\n"}
    port = merge_model(BASE, ours, theirs, "1.0", "1.1", [resolution])
    assert not port.conflicts and len(port.recorded) == 1
    assert "        return (x + 1) * 2\n" in port.text


# --- the registrations, in each release's form --------------------------------------------------

def test_registrations_remade_for_0_32_0_equal_the_hand_made_registry_diff():
    files = release_files("0.32.0")
    registry = add_architecture(files[REGISTRY])
    config, configs = add_config(files[CONFIG], files[CONFIGS])
    made = (file_diff(REGISTRY, files[REGISTRY], registry) + file_diff(CONFIG, files[CONFIG], config)
            + file_diff(CONFIGS, files[CONFIGS], configs))
    assert made == (PATCHES / "v0.32.0" / "registry.diff").read_text()


@pytest.mark.parametrize("version, forms", [("0.6.3", ("dict", "imports")), ("0.11.2", ("lazy", "imports")),
                                            ("0.13.0", ("lazy", "class-to-module"))])
def test_config_registry_form_is_detected(version, forms):
    files = release_files(version)
    assert config_forms(files[CONFIG], files[CONFIGS]) == forms


def test_dict_form_registers_the_class_and_imports_it():
    files = release_files("0.6.3")
    config, configs = add_config(files[CONFIG], files[CONFIGS])
    assert '    "ministream": MiniStreamConfig,\n' in config
    assert "from vllm.transformers_utils.configs import MiniStreamConfig\n" in config
    assert "from vllm.transformers_utils.configs.ministream import MiniStreamConfig\n" in configs
    assert '    "MiniStreamConfig",\n' in configs


def test_registering_twice_is_refused():
    files = release_files("0.32.0")
    with pytest.raises(MiniStreamError, match="already has an entry 'MiniStreamForCausalLM'"):
        add_architecture(add_architecture(files[REGISTRY]))


# --- the committed patch sets are the port tool's output ----------------------------------------

@pytest.fixture
def patches(tmp_path) -> Path:
    shutil.copytree(PATCHES, tmp_path / "patches")
    return tmp_path / "patches"


def committed(version: str) -> dict[str, bytes]:
    d = patch_dir(version)
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_port_0_32_0_to_0_33_0_reproduces_the_committed_patch_set(patches):
    shutil.rmtree(patches / "v0.33.0")
    result = port("0.32.0", "0.33.0", patches)
    assert not result.model.conflicts
    made = {p.relative_to(result.patchdir).as_posix(): p.read_bytes()
            for p in sorted(result.patchdir.rglob("*")) if p.is_file()}
    assert made == committed("0.33.0")
    assert json.loads((patches / "versions.json").read_text()) == supported_versions()


@pytest.mark.parametrize("version", BOUNDARY)
def test_committed_patch_set_is_what_port_makes_of_its_source(patches, version):
    source = manifest(patch_dir(version))["ported_from"]
    result = port(source, version, patches)
    made = {p.relative_to(result.patchdir).as_posix(): p.read_bytes()
            for p in sorted(result.patchdir.rglob("*")) if p.is_file()}
    assert made == committed(version), f"run `make port` and commit patches/ (v{version} is stale)"


def test_every_patch_set_but_the_hand_made_one_records_its_source():
    sources = {v: manifest(patch_dir(v)).get("ported_from") for v in supported_versions()}
    assert [v for v, s in sources.items() if s is None] == ["0.32.0"]
    assert all(s in sources for s in sources.values() if s)


def test_a_conflict_is_left_in_model_diff_and_the_command_fails(patches, capsys):
    (patches / "resolutions.json").unlink()  # the one recorded resolution: 0.30.0 -> 0.29.0
    result = port("0.30.0", "0.29.0", patches)
    assert len(result.model.conflicts) == 1
    assert "+<<<<<<< ministream.py@0.30.0\n" in (result.patchdir / "model.diff").read_text()
    assert _report("0.30.0", "0.29.0", result) == 1
    out = capsys.readouterr().out
    assert "1 conflict(s) in ministream.py@0.29.0" in out and "dump = [hidden_states.clone()]" in out
