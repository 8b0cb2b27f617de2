"""`ministream matrix`: each supported vLLM release's patch set, checked statically.

CI runs the boundary releases (where llama.py or a registry changed form); `make matrix` runs all.
"""

import json

import pytest

from ministream.fork.matrix import CHECKS, check_version, run_matrix
from ministream.fork.patch import patch_dir, patch_tree

# 0.6.3: first, dict config registry; 0.6.6.post1: last before the v1 engine's forward;
# 0.8.5.post1, 0.10.2: dict -> LazyConfigDict; 0.11.2 -> 0.13.0: configs imports -> _CLASS_TO_MODULE;
# 0.20.0: not listed, same files as 0.20.2 (mapped by hash); 0.32.0: hand-made; 0.33.0: newest
BOUNDARY = ["0.6.3", "0.6.6.post1", "0.8.5.post1", "0.10.2", "0.11.2", "0.20.0", "0.32.0", "0.33.0"]


@pytest.mark.parametrize("version", BOUNDARY)
def test_patch_set_passes_every_check(version):
    result = check_version(version)
    failed = {c: r["detail"] for c, r in result["checks"].items() if not r["ok"]}
    assert not failed, f"vLLM {version}: {failed}"


def test_a_release_of_a_listed_line_with_identical_files_uses_that_lines_patch_set():
    assert patch_dir("0.20.0").name == "v0.20.2"
    assert check_version("0.20.0")["checks"]["pristine"]["detail"] == "patch set v0.20.2"


def test_a_release_of_a_listed_line_with_other_files_is_refused():
    result = check_version("0.6.4")
    detail = result["checks"]["pristine"]["detail"]
    assert not result["checks"]["pristine"]["ok"]
    assert "vLLM 0.6.4 is not in" in detail and "make port FROM=0.6.6.post1 TO=0.6.4" in detail
    assert all(result["checks"][c]["detail"] == "skipped" for c in CHECKS[1:])


def test_a_release_of_an_unsupported_line_is_refused():
    result = check_version("0.5.5")
    assert "no MiniStream patch set for vLLM 0.5.5" in result["checks"]["pristine"]["detail"]


def test_make_patch_works_for_a_release_mapped_by_hash(tmp_path):
    tree = patch_tree("0.20.0", build=tmp_path)
    assert (tree / "vllm/model_executor/models/ministream.py").is_file()


def test_matrix_writes_a_table_and_json(tmp_path):
    results = run_matrix(["0.32.0", "0.5.5"], out=tmp_path)
    assert json.loads((tmp_path / "matrix.json").read_text()) == results
    md = (tmp_path / "matrix.md").read_text()
    assert md.startswith("| vLLM | patch set | pristine | applies | compiles | architecture | config | interface |")
    assert "| 0.32.0 | v0.32.0 | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | lazy registry, class-to-module |" in md
    assert "- 0.5.5 pristine: no MiniStream patch set" in md
