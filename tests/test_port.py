"""`ministream port`: a patch set carried to another vLLM release by three-way merge.

The merge rules on small texts first, then on the real releases (single files of the release
wheels and sdists, cached): the committed derived patch sets must be exactly what the port tool makes,
upstream/ (tests/ and docs/ in each release's form) included.
"""

import ast
import filecmp
import json
import shutil
from pathlib import Path

import pytest

from ministream import MiniStreamError
from ministream.fork import registry
from ministream.fork.patch import MINISTREAM
from ministream.fork.patchset import apply_to_files, manifest, patch_set_dir, pinned, supported_versions
from ministream.fork.port import (
    Backport,
    PortResult,
    backport,
    merge_model,
    port,
    port_all,
    pristine_files,
    registrations,
    report,
)
from ministream.fork.pysource import import_target
from ministream.fork.registry import CONFIG_PY, CONFIGS_INIT_PY, REGISTRY_PY, add_architecture, add_config
from ministream.fork.release import NoSdist, sdist_files, sdist_names
from ministream.fork.upstream import _relative_imports, add_example, hand_made_upstream, upstream_part
from ministream.paths import PATCH_SETS

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
    theirs = BASE.replace(
        "class LlamaBidirectionalModel(LlamaForCausalLM):\n    pass\n",
        "class LlamaBidirectionalModel(LlamaForCausalLM):\n    x = 1\n",
    )
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
    resolution = {
        "ours": "        return x * 2\n",
        "theirs": "        return x + 1\n",
        "resolution": "        return (x + 1) * 2\n",
    }
    port = merge_model(BASE, ours, theirs, "1.0", "1.1", [resolution])
    assert not port.conflicts and len(port.recorded) == 1
    assert "        return (x + 1) * 2\n" in port.text


# --- the registrations, in each release's form --------------------------------------------------


def test_registrations_remade_for_0_32_0_equal_the_hand_made_registry_diff():
    assert registrations(pristine_files("0.32.0")) == (PATCH_SETS / "v0.32.0" / "registry.diff").read_text()


@pytest.mark.parametrize(
    "version, forms",
    [
        ("0.4.3", ("autoconfig", "imports")),
        ("0.5.5", ("dict", "imports")),
        ("0.6.3", ("dict", "imports")),
        ("0.11.2", ("lazy", "imports")),
        ("0.13.0", ("lazy", "class-to-module")),
    ],
)
def test_config_registry_form_is_detected(version, forms):
    assert registry.read(pristine_files(version)).forms == forms


def test_dict_form_registers_the_class_and_imports_it():
    files = pristine_files("0.6.3")
    config, configs = add_config(files[CONFIG_PY], files[CONFIGS_INIT_PY])
    assert '    "ministream": MiniStreamConfig,\n' in config
    assert "from vllm.transformers_utils.configs import MiniStreamConfig\n" in config
    assert "from vllm.transformers_utils.configs.ministream import MiniStreamConfig\n" in configs
    assert '    "MiniStreamConfig",\n' in configs


def test_registering_twice_is_refused():
    files = pristine_files("0.32.0")
    with pytest.raises(MiniStreamError, match="already has an entry 'MiniStreamForCausalLM'"):
        add_architecture(add_architecture(files[REGISTRY_PY]))


# --- the committed patch sets are the port tool's output ----------------------------------------


@pytest.fixture
def patch_sets(tmp_path) -> Path:
    shutil.copytree(PATCH_SETS, tmp_path / "patches")
    return tmp_path / "patches"


def same_tree(a: Path, b: Path) -> list[str]:
    """Paths that differ between two folders (missing on one side, or other bytes)."""
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    differ = (
        cmp.left_only + cmp.right_only + [f for f in cmp.common_files if (a / f).read_bytes() != (b / f).read_bytes()]
    )
    return [str(a / f) for f in differ] + [x for d in cmp.common_dirs for x in same_tree(a / d, b / d)]


def test_port_all_rederives_every_derived_patch_set_unchanged(patch_sets):
    results = port_all(patch_sets)
    assert len(results) == len(supported_versions()) - 1
    assert not [b for _, b, r in results if r.model.conflicts]
    assert same_tree(PATCH_SETS, patch_sets) == [], "run `make port` and commit patches/ (derived sets are stale)"


def test_port_0_32_0_to_0_33_0_writes_only_what_differs_per_release(patch_sets):
    shutil.rmtree(patch_sets / "v0.33.0")
    result = port("0.32.0", "0.33.0", patch_sets)
    assert not result.model.conflicts
    assert sorted(p.name for p in result.patch_set_dir.iterdir()) == [
        "manifest.json",
        "model.diff",
        "registry.diff",
        "upstream",
    ]
    assert manifest(result.patch_set_dir)["generated_by"].startswith("ministream port --all")
    assert (result.patch_set_dir / "upstream/files/tests/models/language/generation/test_ministream.py").is_file()
    assert {"tests/models/registry.py", "docs/models/supported_models.md"} <= set(
        pinned(result.patch_set_dir, "0.33.0")
    )
    assert (result.patch_set_dir / "model.diff").read_text().startswith("# Generated by `ministream port`")
    assert json.loads((patch_sets / "versions.json").read_text()) == supported_versions()


def test_every_patch_set_but_the_hand_made_one_records_its_source():
    sources = {v: manifest(patch_set_dir(v)).get("ported_from") for v in supported_versions()}
    assert [v for v, s in sources.items() if s is None] == ["0.32.0"]
    assert all(s in sources for s in sources.values() if s)
    assert all("generated_by" in manifest(patch_set_dir(v)) for v, s in sources.items() if s)


def test_a_conflict_is_listed_and_the_command_fails(capsys):
    ours = OURS.replace("        return x\n", "        return x * 2\n", 1)
    theirs = BASE.replace("        return x\n", "        return x + 1\n", 1)
    result = PortResult(Path("patches/v1.1"), merge_model(BASE, ours, theirs, "1.0", "1.1"), ("lazy", "imports"))
    assert report("1.0", "1.1", result) == 1
    out = capsys.readouterr().out
    assert "1 conflict(s) in ministream.py@1.1" in out and "return x * 2" in out and "resolutions.json" in out


# --- reading the registries of every era ----------------------------------------------------------


def test_registries_of_a_dict_era_release():
    found = registry.read(pristine_files("0.6.3"))
    assert found.architectures["LlamaForCausalLM"] == ("llama", "LlamaForCausalLM")
    assert found.config_types["chatglm"] == "ChatGLMConfig"
    assert found.config_types["mllama"] == "MllamaConfig"  # through **_CONFIG_REGISTRY_OVERRIDE_HF
    assert found.config_exports["ChatGLMConfig"] == "vllm.transformers_utils.configs.chatglm"


def test_registries_of_a_lazy_class_to_module_release():
    found = registry.read(pristine_files("0.32.0"))
    assert found.forms == ("lazy", "class-to-module")
    assert found.architectures["LlamaForCausalLM"] == ("llama", "LlamaForCausalLM")
    assert "ministream" not in found.config_types and "MiniStreamForCausalLM" not in found.architectures


@pytest.mark.parametrize("version", ["0.4.3", "0.5.5", "0.6.3", "0.11.2", "0.32.0"])
def test_a_patched_package_registers_ministream(version, tmp_path):
    patched = apply_to_files(pristine_files(version), patch_set_dir(version))
    for rel, text in patched.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    found = registry.read_package(tmp_path / "vllm")
    assert found.architectures["MiniStreamForCausalLM"] == ("ministream", "MiniStreamForCausalLM")
    assert found.config_types["ministream"] == "MiniStreamConfig"
    assert found.config_exports["MiniStreamConfig"] == "vllm.transformers_utils.configs.ministream"


def test_a_registration_whose_class_is_not_imported_does_not_count():
    files = pristine_files("0.6.3")
    config, _ = add_config(files[CONFIG_PY], files[CONFIGS_INIT_PY])
    files[CONFIG_PY] = config.replace("from vllm.transformers_utils.configs import MiniStreamConfig\n", "")
    assert "ministream" not in registry.read(files).config_types


# --- the Sampler era (0.4, 0.5): models/__init__.py, AutoConfig asked first, llama.py of its own -----


def test_before_0_6_3_the_architectures_are_in_models_init():
    assert registry.files("0.5.5")[0] == registry.MODELS_INIT_PY and registry.files("0.6.3") == registry.FILES
    found = registry.read(pristine_files("0.5.5"))
    assert found.architectures["LlamaForCausalLM"] == ("llama", "LlamaForCausalLM")
    assert (
        '+    "MiniStreamForCausalLM": ("ministream", "MiniStreamForCausalLM"),\n'
        in (patch_set_dir("0.4.3") / "registry.diff").read_text()
    )


def test_0_4_registers_the_config_with_autoconfig_too_and_a_dict_entry_alone_does_not_count():
    files = pristine_files("0.4.3")
    config, _ = add_config(files[CONFIG_PY], files[CONFIGS_INIT_PY])
    assert '    "ministream": MiniStreamConfig,\n' in config
    assert '\nAutoConfig.register("ministream", MiniStreamConfig)\n' in config
    files[CONFIG_PY] = config.replace('AutoConfig.register("ministream", MiniStreamConfig)\n', "")
    assert "ministream" not in registry.read(files).config_types  # get_config would fail in AutoConfig


def test_the_sampler_era_model_keeps_its_releases_interface():
    for version in ("0.4.3", "0.5.5"):
        model = ast.parse(apply_to_files(pristine_files(version), patch_set_dir(version))[MINISTREAM])
        cls = next(n for n in model.body if isinstance(n, ast.ClassDef) and n.name == "MiniStreamForCausalLM")
        methods = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
        assert methods["forward"][:5] == ["self", "input_ids", "positions", "kv_caches", "attn_metadata"]
        assert {"compute_logits", "sample", "load_weights"} <= set(methods)


def test_what_an_older_llama_py_lacks_is_put_back():
    model = apply_to_files(pristine_files("0.4.3"), patch_set_dir("0.4.3"))[MINISTREAM]
    assert 'self.head_dim = getattr(config, "head_dim",\n' in model  # 0.4.3's llama.py: hidden_size // heads
    assert "            config=config,\n            hidden_size=self.hidden_size,\n" in model
    bp = Backport("x", "needed()", (("old()\n", "needed()\n"),))
    assert backport("a()\nold()\n", "1.0", [bp]) == ("a()\nneeded()\n", ["x"])
    assert backport("needed()\n", "1.0", [bp]) == ("needed()\n", [])
    with pytest.raises(MiniStreamError, match="lacks x, .*extend port.BACKPORTS"):
        backport("other()\n", "1.0", [bp])


@pytest.mark.parametrize("version", ["0.4.3", "0.5.5"])
def test_an_sdist_without_docs_and_model_tests_records_why_it_has_no_upstream_part(version):
    folder = patch_set_dir(version)
    assert (
        manifest(folder)["upstream"] == f"the vllm {version} sdist ships no docs/ and no tests/models/ "
        f"(no supported-models page, no model tests)"
    )
    assert not (folder / "upstream").exists()


# --- release files: single members of the release wheel, cached and checked -----------------------


def test_a_cached_member_that_is_not_the_releases_is_refused(tmp_path):
    from ministream.fork.patchset import pinned
    from ministream.fork.release import release_files

    llama = "vllm/model_executor/models/llama.py"
    (tmp_path / "members/0.32.0" / llama).parent.mkdir(parents=True)
    (tmp_path / "members/0.32.0" / llama).write_text("# not vLLM's\n")
    with pytest.raises(MiniStreamError, match=r"llama\.py of the vllm 0\.32\.0 release wheel .* delete"):
        release_files("0.32.0", [llama], pinned(patch_set_dir("0.32.0"), "0.32.0"), cache=tmp_path)


def test_members_are_read_by_range_requests_checked_and_cached(tmp_path):
    from ministream.fork.patchset import pinned
    from ministream.fork.release import release_files

    pins = {p: sha for p, sha in pinned(patch_set_dir("0.6.3"), "0.6.3").items() if p.startswith("vllm/")}
    files = release_files("0.6.3", list(pins), pins, cache=tmp_path)  # no whole wheel in tmp_path
    assert sorted(files) == sorted(pins)
    assert not (tmp_path / "wheels").exists()
    assert {
        p.relative_to(tmp_path / "members/0.6.3").as_posix() for p in (tmp_path / "members/0.6.3").rglob("*.py")
    } == set(pins)


# --- the upstream part: tests/ and docs/ of each release's sdist, in that release's form -------------


def _without_index_lines(diff: str) -> str:
    return "".join(line for line in diff.splitlines(keepends=True) if not line.startswith("index "))


def test_the_upstream_part_remade_for_0_32_0_equals_the_hand_made_one():
    made = hand_made_upstream(PATCH_SETS / "v0.32.0")
    part = upstream_part("0.32.0", made)
    assert part.diff == _without_index_lines((PATCH_SETS / "v0.32.0/upstream/upstream.diff").read_text())
    assert part.added == {made.test_path: made.test}


def test_a_derived_upstream_part_is_made_from_the_hand_made_set_through_a_set_without_one():
    # 0.14.1 is ported from 0.15.1, which has no upstream/ (no sdist): its part still comes from v0.32.0
    assert hand_made_upstream(patch_set_dir("0.14.1")).source == "v0.32.0"
    assert (patch_set_dir("0.14.1") / "upstream/files/tests/models/language/generation/test_ministream.py").is_file()


@pytest.mark.parametrize(
    "version, test_dir, docs",
    [
        ("0.6.3", "tests/models/decoder_only/language", "docs/source/models/supported_models.rst"),
        ("0.6.6.post1", "tests/models/decoder_only/language", "docs/source/models/supported_models.md"),
        ("0.7.3", "tests/models/decoder_only/language", "docs/source/models/supported_models.md"),
        ("0.9.2", "tests/models/language/generation", "docs/models/supported_models.md"),
        ("0.33.0", "tests/models/language/generation", "docs/models/supported_models.md"),
    ],
)
def test_the_upstream_part_goes_where_the_release_keeps_tests_and_docs(version, test_dir, docs):
    folder = patch_set_dir(version)
    assert [p.relative_to(folder / "upstream/files").as_posix() for p in (folder / "upstream/files").rglob("*.py")] == [
        f"{test_dir}/test_ministream.py"
    ]
    assert f"diff --git a/{docs} b/{docs}\n" in (folder / "upstream/upstream.diff").read_text()
    assert docs in pinned(folder, version)


def test_a_release_without_an_examples_registry_lists_the_model_ids_in_the_test():
    folder = patch_set_dir("0.6.3")
    test = (folder / "upstream/files/tests/models/decoder_only/language/test_ministream.py").read_text()
    assert 'MODELS = ["ministream/ministream-tiny-gqa", "ministream/ministream-tiny"]\n' in test
    assert "HF_EXAMPLE_MODELS" not in test and "MODEL_INFO" not in test
    assert "tests/models/registry.py" not in (folder / "upstream/upstream.diff").read_text()
    assert "tests/models/registry.py" not in pinned(folder, "0.6.3")


@pytest.mark.parametrize("version, has_checks", [("0.6.6.post1", False), ("0.7.3", True), ("0.8.5.post1", True)])
def test_the_entry_and_test_keep_only_what_the_releases_examples_class_has(version, has_checks):
    folder = patch_set_dir(version)
    diff = (folder / "upstream/upstream.diff").read_text()
    test = next((folder / "upstream/files").rglob("test_ministream.py")).read_text()
    assert '+        extras={"tied-mha": "ministream/ministream-tiny"},\n+    ),\n' in diff  # no max_model_len
    assert "MAX_MODEL_LEN = 512" in test and "max_model_len=MAX_MODEL_LEN" in test
    assert ("MODEL_INFO.check_available_online" in test) is has_checks
    assert "from ...registry import HF_EXAMPLE_MODELS\nfrom ...utils import" in test


@pytest.mark.parametrize(
    "version, row",
    [
        (
            "0.6.3",
            "+  * - :code:`MiniStreamForCausalLM`\n+    - MiniStream\n"
            "+    - :code:`ministream/ministream-tiny-gqa`, :code:`ministream/ministream-tiny`, etc.\n"
            "+    - ✅︎\n+    - ✅︎\n   * - :code:`MistralForCausalLM`\n",
        ),
        (
            "0.7.3",
            "+- * `MiniStreamForCausalLM`\n+  * MiniStream\n"
            "+  * `ministream/ministream-tiny-gqa`, `ministream/ministream-tiny`, etc.\n+  * ✅︎\n+  * ✅︎\n",
        ),
        (
            "0.9.2",
            "+| `MiniStreamForCausalLM` | MiniStream | `ministream/ministream-tiny-gqa`, "
            "`ministream/ministream-tiny`, etc. | ✅︎ | ✅︎ | ✅︎ |\n",
        ),
    ],
)
def test_the_docs_row_is_in_the_pages_table_form(version, row):
    assert row in (patch_set_dir(version) / "upstream/upstream.diff").read_text()


def test_a_release_without_an_sdist_records_why_it_has_no_upstream_part():
    folder = patch_set_dir("0.15.1")
    assert manifest(folder)["upstream"] == "no sdist on PyPI for 0.15.1"
    assert not (folder / "upstream").exists()
    files = pinned(folder, "0.15.1")
    assert files and all(p.startswith("vllm/") for p in files)


def test_relative_imports_are_rewritten_for_the_tests_folder():
    text = "from ...registry import HF_EXAMPLE_MODELS\nfrom ....conftest import HfRunner\n"
    assert _relative_imports(text, "tests/models/language/generation", "tests/models/decoder_only/language") == text
    assert (
        _relative_imports(text, "tests/models/language/generation", "tests/models")
        == "from .registry import HF_EXAMPLE_MODELS\nfrom ..conftest import HfRunner\n"
    )
    assert import_target("tests/models/decoder_only/language", 3, "utils") == "tests/models/utils"


def test_an_example_entry_already_registered_is_refused():
    made = hand_made_upstream(PATCH_SETS / "v0.32.0")
    registry_py = sdist_files("0.32.0", ["tests/models/registry.py"])["tests/models/registry.py"]
    with pytest.raises(MiniStreamError, match="already has an entry 'MiniStreamForCausalLM'"):
        add_example(add_example(registry_py, made.entry), made.entry)


# --- release files: single members of the release sdist, streamed, checked and cached ----------------


def test_sdist_members_are_streamed_checked_and_cached_without_keeping_the_sdist(tmp_path):
    files = sdist_files("0.6.3", ["tests/models/utils.py", "tests/models/registry.py"], cache=tmp_path)
    assert files["tests/models/registry.py"] is None  # 0.6.3 has none: missing, not an error
    assert "def check_logprobs_close" in files["tests/models/utils.py"]
    assert not (tmp_path / "sdists").exists()
    assert "tests/models/decoder_only/language/__init__.py" in sdist_names("0.6.3", cache=tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()) == [
        "members/0.6.3/sdist/.names",
        "members/0.6.3/sdist/tests/models/utils.py",
    ]


def test_an_sdist_that_is_not_the_releases_is_refused_and_nothing_is_kept(tmp_path):
    import io
    import tarfile

    (tmp_path / "sdists").mkdir()
    with tarfile.open(tmp_path / "sdists/vllm-0.6.3.tar.gz", "w:gz") as tar:
        data = b"# not vLLM's\n"
        member = tarfile.TarInfo("vllm-0.6.3/tests/models/utils.py")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    with pytest.raises(MiniStreamError, match=r"is not the official vllm 0\.6\.3 sdist.*nothing of it was kept"):
        sdist_files("0.6.3", ["tests/models/utils.py"], cache=tmp_path)
    assert not (tmp_path / "members").exists()


def test_a_cached_sdist_member_that_is_not_the_releases_is_refused(tmp_path):
    folder = tmp_path / "members/0.32.0/sdist"
    (folder / "tests/models").mkdir(parents=True)
    (folder / ".names").write_text("tests/models/registry.py\n")
    (folder / "tests/models/registry.py").write_text("# not vLLM's\n")
    with pytest.raises(MiniStreamError, match=r"registry\.py of the vllm 0\.32\.0 sdist .* delete"):
        sdist_files("0.32.0", ["tests/models/registry.py"], pinned(patch_set_dir("0.32.0"), "0.32.0"), cache=tmp_path)


def test_a_release_without_an_sdist_says_so(tmp_path):
    with pytest.raises(NoSdist, match=r"^no sdist on PyPI for 0\.15\.1$"):
        sdist_files("0.15.1", ["tests/models/registry.py"], cache=tmp_path)


# --- FROM and TO as a user writes them -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, target, named",
    [("abc", "0.99.0", "FROM 'abc'"), ("0.32.0", "latest", "TO 'latest'"), ("v0.32.0", "0.33.0", "FROM 'v0.32.0'")],
    ids=["from_a_word", "to_a_word", "from_with_a_v"],
)
def test_a_version_that_is_not_a_release_version_is_refused_in_one_line(cli, source, target, named):
    r = cli("port", source, target, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"error: {named} is not a vLLM release version"), lines[0]
    assert f"TO={source}" not in lines[0] and "make port FROM=0.32.0 TO=0.33.0" in lines[0]  # advice that works


def test_a_from_release_without_a_patch_set_is_refused_naming_those_that_have_one(cli):
    r = cli("port", "0.3.3", "0.99.0", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error: FROM 0.3.3 has no patch set to port from" in r.stderr and "0.32.0" in r.stderr, r.stderr
    assert "TO=0.3.3" not in r.stderr
