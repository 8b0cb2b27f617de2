"""`ministream matrix`: each supported vLLM release's patch set, checked statically.

Every supported release, as `make matrix` checks them.
"""

import json

import git
import pytest

from ministream.fork.matrix import CHECKS, check_version, run_matrix
from ministream.fork.patch import patch_tree
from ministream.fork.patchset import patch_set_dir, supported_versions
from ministream.fork.port import pristine_files

# every supported release, and 0.20.0: not listed, same files as 0.20.2 (mapped by hash); cheap, since
# only the 4 files each needs are read from its release wheel (cached under build/cache/members)
VERSIONS = [*supported_versions(), "0.20.0"]


@pytest.mark.parametrize("version", VERSIONS)
def test_patch_set_passes_every_check(version):
    result = check_version(version)
    failed = {c: r["detail"] for c, r in result["checks"].items() if not r["ok"]}
    assert not failed, f"vLLM {version}: {failed}"


def test_a_release_of_a_listed_line_with_identical_files_uses_that_lines_patch_set():
    assert patch_set_dir("0.20.0").name == "v0.20.2"
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
    # a repository of 0.20.0's files the patch touches, tagged as the release: no whole wheel needed
    upstream = tmp_path / "upstream"
    for rel, text in pristine_files("0.20.0").items():
        (upstream / rel).parent.mkdir(parents=True, exist_ok=True)
        (upstream / rel).write_text(text)
    repo = git.Repo.init(upstream)
    repo.git.add("-A")
    repo.git.commit("-q", "-m", "vLLM 0.20.0", author="t <t@t>", env={"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    repo.create_tag("v0.20.0")
    tree = patch_tree("0.20.0", git_url=str(upstream), build=tmp_path / "build")
    assert (tree / "vllm/model_executor/models/ministream.py").is_file()


def test_matrix_writes_a_table_and_json(tmp_path):
    results = run_matrix(["0.32.0", "0.5.5"], out=tmp_path)
    assert json.loads((tmp_path / "matrix.json").read_text()) == results
    md = (tmp_path / "matrix.md").read_text()
    assert md.startswith("| vLLM | patch set | pristine | applies | compiles | architecture | config | interface |")
    assert "| 0.32.0 | v0.32.0 | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | lazy registry, class-to-module |" in md
    assert "- 0.5.5 pristine: no MiniStream patch set" in md
