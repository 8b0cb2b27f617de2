"""The slow tier's slices (tests/slices.py), what CI runs after make test: every full test in one slice or named
as one CI cannot run, each slice within its budget, the same slices for the same commit."""

import json
import subprocess

import pytest
from slices import ESTIMATES, Estimates, check, collect_full, commit_index, cost, longest_prefix, pack, record

TESTS = [
    *(f"tests/test_a.py::test_engine[{k}]" for k in "abcd"),
    "tests/test_b.py::test_build_then_run",
    "tests/test_b.py::test_run_again",
    *(f"tests/test_c.py::test_case[{i}]" for i in range(30)),
    "tests/test_d.py::test_needs_ray",
]
TABLE = Estimates(
    budget=600,
    default=100,
    tests={"tests/test_a.py": 250, "tests/test_b.py::test_build_then_run": 50, "tests/test_c.py": 20},
    setup={"tests/test_b.py": 400, "tests/test_a.py": 50},
    by_case=[],
    not_in_ci={"tests/test_d.py::test_needs_ray": "Ray"},
)


def assert_a_partition(slices: list[list[str]], nodes: list[str], est: Estimates) -> None:
    ran = [n for s in slices for n in s]
    assert len(ran) == len(set(ran))  # disjoint
    assert set(ran) == {n for n in nodes if est.excluded(n) is None}  # every test CI can run, in some slice
    assert all(s and cost(s, est) <= est.budget for s in slices), [cost(s, est) for s in slices]
    check(slices, nodes, est)  # and pick's own check, which every CI run applies to its commit's full tier


def test_picks_check_refuses_slices_that_drop_a_test_or_repeat_one():
    slices = pack(TESTS, TABLE)
    with pytest.raises(ValueError, match="not a partition"):
        check([s[1:] if i == 0 else s for i, s in enumerate(slices)], TESTS, TABLE)
    with pytest.raises(ValueError, match="not a partition"):
        check([*slices, slices[0][:1]], TESTS, TABLE)


def test_every_test_is_in_exactly_one_slice_within_the_budget_and_the_slices_follow_collection_order():
    slices = pack(TESTS, TABLE)
    assert_a_partition(slices, TESTS, TABLE)
    assert all(s == sorted(s, key=TESTS.index) for s in slices)
    assert not any("test_d.py" in n for s in slices for n in s)


def test_a_module_over_the_budget_is_cut_and_each_piece_pays_its_setup():
    """test_a.py: 50 s of setup and 4 x 250 s, so pieces of two; test_b.py stays whole (400 + 50 + 100)."""
    slices = pack(TESTS, TABLE)
    pieces = [[n for n in s if "test_a.py" in n] for s in slices]
    assert sorted(len(p) for p in pieces if p) == [2, 2]
    assert sum(any("test_b.py" in n for n in s) for s in slices) == 1


def test_the_same_tests_and_estimates_give_the_same_slices():
    assert pack(TESTS, TABLE) == pack(list(TESTS), Estimates(**vars(TABLE)))


def test_a_test_over_the_budget_is_refused_naming_it_unless_ci_is_said_not_to_run_it():
    slow = Estimates(**{**vars(TABLE), "tests": {**TABLE.tests, "tests/test_c.py::test_case[7]": 700}})
    with pytest.raises(ValueError, match=r"test_case\[7\]: 700 s .* list it under not_in_ci"):
        pack(TESTS, slow)
    listed = Estimates(**{**vars(slow), "not_in_ci": {**slow.not_in_ci, "tests/test_c.py::test_case[7]": "long"}})
    assert_a_partition(pack(TESTS, listed), TESTS, listed)


def test_an_estimate_applies_to_its_node_its_function_or_its_file_the_longest_first():
    table = {"tests/test_a.py": 1, "tests/test_a.py::test_engine": 2, "tests/test_a.py::test_engine[b]": 3}
    assert longest_prefix("tests/test_a.py::test_engine[b]", table) == "tests/test_a.py::test_engine[b]"
    assert longest_prefix("tests/test_a.py::test_engine[c]", table) == "tests/test_a.py::test_engine"
    assert longest_prefix("tests/test_a.py::test_engine_two", table) == "tests/test_a.py"  # at "::" or "[" only
    assert longest_prefix("tests/test_ab.py::test_x", table) == ""


def test_consecutive_commits_take_the_slices_in_turn_and_a_shallow_clone_its_hash(tmp_path):
    repo, git = tmp_path / "repo", ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    seen = []
    for i in range(4):
        subprocess.run([*git, "-C", str(repo), "commit", "-q", "--allow-empty", "-m", str(i)], check=True)
        seen.append(commit_index(3, repo)[0])
        assert commit_index(3, repo) == commit_index(3, repo)  # the same commit, the same slice
    assert seen == [1, 2, 0, 1]  # commit number modulo 3: any 3 landings in a row run every slice
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    sha = subprocess.run(["git", "-C", str(shallow), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert commit_index(3, shallow) == (int(sha, 16) % 3, f"commit {sha[:12]} (a shallow clone): its hash modulo 3")


def test_a_slices_measured_times_replace_the_estimates(tmp_path):
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_a" name="test_engine[a]" time="123.4"/>'
        '<testcase classname="tests.test_a" name="test_engine[b]" time="0.1"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    path = tmp_path / "estimates.json"
    path.write_text(ESTIMATES.read_text())
    record(tmp_path / "junit.xml", path)
    tests = json.loads(path.read_text())["tests"]
    assert tests["tests/test_a.py::test_engine[a]"] == 123 and "tests/test_a.py::test_engine[b]" not in tests
    assert Estimates.read(path).budget == Estimates.read().budget


@pytest.mark.full  # a collection of the whole suite (20 s to 2 min here); make test-slice's pick does it in CI
def test_the_full_tier_as_collected_falls_into_slices_of_the_committed_estimates():
    """This checkout's own full tier (pytest --collect-only -m full) and full_durations.json: every test in one
    slice or named as one CI cannot run, each slice within the budget (a test over it stops the packing)."""
    nodes = collect_full()
    est = Estimates.read()
    assert len(nodes) > 100
    assert_a_partition(pack(nodes, est), nodes, est)
    assert all(any(n.startswith(k) for n in nodes) for k in est.not_in_ci), "a not_in_ci entry names no full test"
