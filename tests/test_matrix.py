"""`ministream matrix`: each supported vLLM release's patch set, checked statically.

Every supported release, as `make matrix` checks them.
"""

import functools
import json
import shutil

import git
import pytest

from ministream.checks.matrix import CHECKS, all_passed, check_version, run_matrix
from ministream.fork.patch import patch_tree
from ministream.fork.patchset import patch_set_dir, supported_versions
from ministream.fork.port import pristine_files
from ministream.paths import PATCH_SETS

# every supported release, and 0.20.0: not listed, same files as 0.20.2 (mapped by hash); cheap, since
# only the 4 files each needs are read from its release wheel, and the 3 its upstream part needs from
# its sdist (both cached under build/cache/members)
VERSIONS = [*supported_versions(), "0.20.0"]
# make test checks the releases at the boundaries a change most often breaks (the oldest, the one without an
# sdist, one mapped by hash, the hand-made set, the newest); make test-full checks them all, the first plugin
# era (0.6.3) and the oldest CPU line (0.8.5.post1, run for real there too) among them
QUICK = {"0.4.3", "0.15.1", "0.20.0", "0.32.0", "0.34.0"}
checked = functools.cache(check_version)  # each version's matrix row, for the tests that read it


@pytest.mark.parametrize("version", [v if v in QUICK else pytest.param(v, marks=pytest.mark.full) for v in VERSIONS])
def test_patch_set_passes_every_check(version):
    result = checked(version)
    assert list(result["checks"]) == list(CHECKS)  # every check ran: none passes by its absence
    failed = {c: r["detail"] for c, r in result["checks"].items() if not r["ok"]}
    assert not failed, f"vLLM {version}: {failed}"


def test_a_matrix_of_no_version_or_no_check_does_not_pass():
    assert not all_passed({}) and not all_passed({"0.32.0": {"checks": {}}})
    assert all_passed({"0.32.0": {"checks": {c: {"ok": True} for c in CHECKS}}})


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
    result = check_version("0.3.3")
    assert "no MiniStream patch set for vLLM 0.3.3" in result["checks"]["pristine"]["detail"]


def test_make_patch_works_for_a_release_mapped_by_hash(tmp_path):
    # a repository of 0.20.0's files the patch touches, tagged as the release: no whole wheel needed
    upstream = tmp_path / "upstream"
    for rel, text in pristine_files("0.20.0").items():
        (upstream / rel).parent.mkdir(parents=True, exist_ok=True)
        (upstream / rel).write_text(text)
    repo = git.Repo.init(upstream)
    repo.git.add("-A")
    repo.git.commit(
        "-q", "-m", "vLLM 0.20.0", author="t <t@t>", env={"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    )
    repo.create_tag("v0.20.0")
    tree = patch_tree("0.20.0", git_url=str(upstream), build=tmp_path / "build")
    assert (tree / "vllm/model_executor/models/ministream.py").is_file()


def test_matrix_writes_a_table_and_json(tmp_path):
    results = run_matrix(["0.32.0", "0.3.3"], out=tmp_path)
    assert json.loads((tmp_path / "matrix.json").read_text()) == results
    md = (tmp_path / "matrix.md").read_text()
    assert md.startswith(
        "| vLLM | patch set | pristine | applies | compiles | architecture | config | interface "
        "| names | attributes | weights | internals | upstream |"
    )
    assert "| 0.32.0 | v0.32.0 | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | lazy registry, class-to-module |" in md
    assert "- 0.3.3 pristine: no MiniStream patch set" in md


# --- upstream: the set's tests/ and docs/ part on the release's own sdist files ----------------------

# releases whose set records why it has no upstream part (0.15.1: no sdist; 0.4.3, 0.5.5: no docs/, tests/models/)
NO_UPSTREAM = {
    v: json.loads((patch_set_dir(v) / "manifest.json").read_text()).get("upstream") for v in supported_versions()
}
NO_UPSTREAM = {v: why for v, why in NO_UPSTREAM.items() if why}


def test_only_the_releases_without_the_files_have_no_upstream_part():
    assert sorted(NO_UPSTREAM) == ["0.15.1", "0.4.3", "0.5.5"]


@pytest.mark.parametrize(
    "version",
    [
        v if v in QUICK else pytest.param(v, marks=pytest.mark.full)
        for v in supported_versions()
        if v not in NO_UPSTREAM
    ],
)
def test_the_upstream_part_applies_to_the_releases_sdist_files(version):
    upstream = checked(version)["checks"]["upstream"]
    assert upstream["ok"] and upstream.get("applies", True), f"vLLM {version}: {upstream['detail']}"
    assert "/test_ministream.py" in upstream["detail"] and "supported_models" in upstream["detail"]


def test_a_release_without_an_sdist_shows_why_it_has_no_upstream_part(tmp_path):
    results = run_matrix(["0.15.1"], out=tmp_path)
    assert results["0.15.1"]["checks"]["upstream"] == {
        "ok": True,
        "applies": False,
        "detail": "n/a: no sdist on PyPI for 0.15.1",
    }
    md = (tmp_path / "matrix.md").read_text()
    assert "| 0.15.1 | v0.15.1 | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | ✓ | n/a |" in md
    assert "- 0.15.1 upstream: n/a: no sdist on PyPI for 0.15.1" in md


@pytest.fixture
def patch_sets(tmp_path):
    shutil.copytree(PATCH_SETS, tmp_path / "patches")
    return tmp_path / "patches"


def test_an_upstream_diff_whose_context_does_not_match_is_caught(patch_sets):
    diff = patch_sets / "v0.31.0/upstream/upstream.diff"
    text = diff.read_text()
    context = next(line for line in text.splitlines(keepends=True)[5:] if line.startswith(" ") and line.strip())
    diff.write_text(text.replace(context, " # not in vLLM's tests/models/registry.py\n", 1))
    result = check_version("0.31.0", patch_sets)
    assert [c for c, r in result["checks"].items() if not r["ok"]] == ["upstream"]
    assert "tests/models/registry.py" in result["checks"]["upstream"]["detail"]
    assert "hunk #1 does not apply" in result["checks"]["upstream"]["detail"]


def test_a_generation_test_importing_what_the_release_lacks_is_caught(patch_sets):
    test = patch_sets / "v0.7.3/upstream/files/tests/models/decoder_only/language/test_ministream.py"
    text = test.read_text()
    test.write_text(text.replace("check_outputs_equal\n", "check_outputs_equal, check_embeddings_close\n", 1))
    detail = check_version("0.7.3", patch_sets)["checks"]["upstream"]["detail"]
    assert "imports check_embeddings_close from tests/models/utils.py, which does not define it" in detail


def test_a_generation_test_that_does_not_compile_is_caught(patch_sets):
    test = patch_sets / "v0.9.2/upstream/files/tests/models/language/generation/test_ministream.py"
    test.write_text(test.read_text() + "\ndef broken(:\n")
    detail = check_version("0.9.2", patch_sets)["checks"]["upstream"]["detail"]
    assert detail.startswith("tests/models/language/generation/test_ministream.py:")


def test_a_derived_set_without_upstream_part_or_reason_fails(patch_sets):
    shutil.rmtree(patch_sets / "v0.30.0/upstream")
    detail = check_version("0.30.0", patch_sets)["checks"]["upstream"]["detail"]
    assert "has no upstream/ and its manifest.json records no reason" in detail
