"""The slow tier in slices: CI (.ci/run) runs `make test` and then one slice of `make test-full`'s pytest tests.

`python tests/slices.py pick [--slice K/N] [--out FILE]`: collects the full tier (`pytest -m full`), packs its
tests into slices that each fit the budget by full_durations.json's estimates, picks one, writes its node ids
to FILE (pytest reads them as `@FILE`) and says which slice it is. Without --slice the commit picks it: the
commit's number on its branch (`git rev-list --count HEAD`) modulo N, so N landings in a row run every slice;
a shallow clone, which has no count, takes the commit's hash modulo N instead.
`python tests/slices.py record JUNIT.xml`: a slice's measured times (pytest --junitxml) into the estimates.

Packing: a test module is one unit (its module and session fixtures, a server or a build, paid once), or one
unit per parameter case where its module fixture is made per case (by_case), its cost its setup plus its
tests'; a unit over the budget is cut, in collection order, into pieces that fit, each paying
the setup again. The units, largest first, go to the least-loaded slice; N grows until every slice fits. The
same tests and estimates give the same slices on every machine: they are the commit's.
"""

import argparse
import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ESTIMATES = Path(__file__).with_name("full_durations.json")


@dataclass(frozen=True)
class Estimates:
    budget: float  # seconds a slice may take by the estimates
    default: float  # a test with no estimate of its own
    tests: dict[str, float]  # node id, or a prefix of one (its file, its function): seconds; the longest wins
    setup: dict[str, float]  # file: what its tests share, paid once in each slice that runs any of them
    by_case: list[str]  # files whose module fixture is made per parameter case: a unit per case, setup each
    not_in_ci: dict[str, str]  # node id prefix: why CI's machine cannot run it (make test-full runs it)

    @classmethod
    def read(cls, path: Path = ESTIMATES) -> "Estimates":
        data = json.loads(path.read_text())
        budget, default = data["budget_s"], data["default_s"]
        return cls(budget, default, data["tests"], data["setup"], data["by_case"], data["not_in_ci"])

    def of(self, node: str) -> float:
        key = longest_prefix(node, self.tests)
        return self.tests[key] if key else self.default

    def excluded(self, node: str) -> str | None:
        key = longest_prefix(node, self.not_in_ci)
        return self.not_in_ci[key] if key else None


def longest_prefix(node: str, table: dict) -> str:
    """The longest key of table that is node or a prefix of it at a boundary ("::" or "["), else ""."""
    keys = [k for k in table if node.startswith(k) and (node == k or node[len(k) :].startswith(("::", "[")))]
    return max(keys, key=len, default="")


def file_of(node: str) -> str:
    return node.split("::", 1)[0]


def unit_of(node: str, est: Estimates) -> str:
    """The module, or for a by_case module the module and the parameter case ("[...]") its fixture is made for."""
    file = file_of(node)
    return f"{file}[{node.partition('[')[2]}" if file in est.by_case else file


def units(nodes: list[str], est: Estimates) -> list[tuple[float, list[str]]]:
    """(cost, node ids) per module, or per piece of a module over the budget."""
    by_unit: dict[str, list[str]] = {}
    for node in nodes:
        by_unit.setdefault(unit_of(node, est), []).append(node)
    out = []
    for unit, tests in by_unit.items():
        setup = est.setup.get(file_of(unit), 0.0)
        piece: list[str] = []
        for node in tests:
            if setup + est.of(node) > est.budget:
                raise ValueError(
                    f"{node}: {setup + est.of(node):.0f} s by tests/full_durations.json, over a slice's "
                    f"{est.budget:.0f} s: list it under not_in_ci with the reason, or raise budget_s"
                )
            if piece and setup + sum(map(est.of, piece)) + est.of(node) > est.budget:
                out.append((setup + sum(map(est.of, piece)), piece))
                piece = []
            piece.append(node)
        out.append((setup + sum(map(est.of, piece)), piece))
    return out


def pack(nodes: list[str], est: Estimates) -> list[list[str]]:
    """The slices of the tests CI can run (those not in not_in_ci), each within the budget, each in the order
    given (pytest's collection order)."""
    order = {node: i for i, node in enumerate(nodes)}
    todo = sorted(units([n for n in nodes if est.excluded(n) is None], est), key=lambda u: (-u[0], order[u[1][0]]))
    # as many slices as the sum needs, and more until each fits: at most one a unit, where each fits alone
    for n in range(max(1, math.ceil(sum(c for c, _ in todo) / est.budget)), len(todo) + 1):
        loads, slices = [0.0] * n, [[] for _ in range(n)]  # type: ignore[var-annotated]
        for size, piece in todo:
            k = min(range(n), key=lambda i: (loads[i], i))
            loads[k] += size
            slices[k] += piece
        if max(loads) <= est.budget:
            return [sorted(s, key=order.__getitem__) for s in slices]
    raise AssertionError("unreachable: one unit a slice fits, each unit within the budget (units())")


def check(slices: list[list[str]], nodes: list[str], est: Estimates) -> None:
    """Every test CI can run in exactly one slice, and every slice within the budget: pick holds each CI run to
    it, on that commit's full tier."""
    ran = [n for s in slices for n in s]
    if len(ran) != len(set(ran)) or set(ran) != {n for n in nodes if est.excluded(n) is None}:
        raise ValueError("the slices are not a partition of the full tier's tests: tests/slices.py's packing")
    over = [f"{cost(s, est):.0f} s" for s in slices if not s or cost(s, est) > est.budget]
    if over:
        raise ValueError(f"slices over the budget of {est.budget:.0f} s, or empty: {over}")


def cost(nodes: list[str], est: Estimates) -> float:
    """A slice's estimate: its tests and each of its units' setup once."""
    return sum(map(est.of, nodes)) + sum(est.setup.get(file_of(u), 0.0) for u in {unit_of(n, est) for n in nodes})


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


def commit_index(n: int, repo: Path = ROOT) -> tuple[int, str]:
    """The slice the checked-out commit runs of n, and how it was chosen."""
    sha = git(repo, "rev-parse", "HEAD")
    if git(repo, "rev-parse", "--is-shallow-repository") == "true":
        return int(sha, 16) % n, f"commit {sha[:12]} (a shallow clone): its hash modulo {n}"
    count = int(git(repo, "rev-list", "--count", "HEAD"))
    return count % n, f"commit {sha[:12]}, number {count} on its branch, modulo {n}"


def collect_full() -> list[str]:
    """make test-full's pytest tests, as pytest collects them here: node ids in collection order."""
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "full", "--collect-only", "-q", "-n0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        sys.exit(f"error: collecting the full tier failed (rc {r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
    return [line for line in r.stdout.splitlines() if "::" in line]


def pick(args: argparse.Namespace) -> None:
    est = Estimates.read()
    nodes = collect_full()
    slices = pack(nodes, est)
    check(slices, nodes, est)
    if args.slice:
        m = re.fullmatch(r"(\d+)/(\d+)", args.slice)
        if not m or int(m[2]) != len(slices) or int(m[1]) >= len(slices):
            sys.exit(f"error: SLICE={args.slice}: give K/{len(slices)} with K from 0 to {len(slices) - 1}")
        k, why = int(m[1]), "SLICE as given"
    else:
        k, why = commit_index(len(slices))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(f"{node}\n" for node in slices[k]))
    left = sorted({est.not_in_ci[longest_prefix(n, est.not_in_ci)] for n in nodes if est.excluded(n)})
    print(
        f"slice {k}/{len(slices)} of the full tier ({why}): {len(slices[k])} of {len(nodes)} tests, "
        f"~{cost(slices[k], est) / 60:.0f} min by tests/full_durations.json -> {out}"
    )
    for node in slices[k]:
        print(f"  {node}")
    for reason in left:
        print(f"  in no slice (make test-full runs them): {reason}")


def record(junit: Path, path: Path = ESTIMATES) -> None:
    """Each test's measured time in a junit xml (pytest --junitxml) as its estimate, written back into path."""
    data = json.loads(path.read_text())
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("skipped") is None:  # a skipped test's time is not the test's
            node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            data["tests"][node] = round(float(case.get("time", 0)))
    data["tests"] = dict(sorted(data["tests"].items()))
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("pick", help="write one slice's node ids")
    p.add_argument("--slice", default="", help="K/N: that slice, else the commit's")
    p.add_argument("--out", default="build/test-slice/tests.txt")
    p.set_defaults(run=pick)
    r = sub.add_parser("record", help="a slice's junit xml's times into full_durations.json")
    r.add_argument("junit")
    r.set_defaults(run=lambda a: record(Path(a.junit)))
    args = parser.parse_args()
    args.run(args)
