"""The matrix's `internals` check: every vLLM internal ministream's tools reach by name resolves in the release.

What is checked is stated in fork/internals.py (NEEDS, RUNNER_PARTS, IMPORTS_SINCE) and fork/cpu.py (the
files the CPU part edits); this module only reads the release's files, the way model_checks.py does: single
members of its release wheel (cached), parsed with fork/pysource.py, never imported. For each need whose era
the release is in:
  Name     the module exists, defines the name, and the class has the attribute (its bases followed)
  Env      vllm/envs.py's environment_variables has the variable
  Runner   every model runner the V1 engine's workers build has one of the part's names
  imports  every `from vllm... import x` of the package's modules resolves
  CPU part every version("vllm") of vLLM's command line is one the CPU part rewrites (cpu.CLI_LINE), and
           where lines.json asks for the platform fix, it applies to the release's platforms/__init__.py
The detail says what resolved per tool, which tools' eras begin later, and whether the release's x86 CPU
platform refuses to start without Triton (0.34: triton-cpu).
"""

import ast
import re
from collections import Counter
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError
from ..fork import cpu
from ..fork.internals import IMPORTS_SINCE, NEEDS, RUNNER_ATTRIBUTE, WORKERS, Env, Name, Need, Runner, cpu_needs_triton
from ..fork.pysource import assigned_classes, class_attributes, find_class, imported
from .model_checks import Failed, Release, _import_path

PACKAGE = Path(__file__).resolve().parent.parent
ENVS = "vllm/envs.py"
PLATFORM_CPU = "vllm/platforms/cpu.py"
CPU_PART = "CPU part (fork/cpu.py)"


class _Source:
    """The release's files as modules: Release's files, each parsed once."""

    def __init__(self, found: Release):
        self.found = found
        self.parsed: dict[str, ast.Module] = {}

    def module(self, dotted: str) -> str | None:
        return self.found.module(dotted.replace(".", "/"))

    def parse(self, rel: str) -> ast.Module:
        if rel not in self.parsed:
            self.parsed[rel] = ast.parse(self.found.text(rel), filename=rel)
        return self.parsed[rel]

    def class_of(self, rel: str, name: str, seen: frozenset = frozenset()) -> tuple[str, ast.ClassDef] | None:
        """(file, class) of the class `name` as module `rel` names it: defined there, or imported into it."""
        if rel.endswith(".so") or (rel, name) in seen:
            return None
        module = self.parse(rel)
        if (node := find_class(module, name)) is not None:
            return rel, node
        if (bound := imported(module).get(name)) is None:
            return None
        level, source, original = bound
        path = _import_path(rel, level, source)
        target = self.found.module(path) if path else None
        return self.class_of(target, original, seen | {(rel, name)}) if target else None

    def has(self, rel: str, cls: str, attr: str, seen: frozenset = frozenset()) -> bool:
        """Class `cls` of module `rel` has `attr`: its own, or a base class's of the release."""
        found = self.class_of(rel, cls)
        if found is None or found in seen:
            return False
        where, node = found
        if attr in class_attributes(node):
            return True
        for base in node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base  # Generic[...]-style bases
            if isinstance(base, ast.Name) and self.has(where, base.id, attr, seen | {found}):
                return True
        return False


def _resolve(source: _Source, what: Name) -> str | None:
    """None when `what` resolves; else what is missing."""
    rel = source.module(what.module)
    if rel is None:
        return f"no module {what.module}"
    if what.name and not source.found.defines(rel, what.name):
        return f"{rel} does not define {what.name}"
    if what.attr and not source.has(rel, what.name, what.attr):
        return f"{what.module}.{what.name} has no {what.attr} (nor its bases)"
    return None


def _environment(source: _Source) -> set[str]:
    tree = source.parse(ENVS)
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Dict):
            continue
        target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
        if isinstance(target, ast.Name) and target.id == "environment_variables":
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    raise Failed(f"{ENVS} has no environment_variables table: a new form; extend ministream/checks/internals_check.py")


def runners(source: _Source) -> list[tuple[str, str, str]]:
    """(worker, file, class) of every model runner the release's V1 workers build (self.model_runner = X(...))."""
    built = []
    for worker in WORKERS:
        rel = source.module(worker.module)
        found = source.class_of(rel, worker.name) if rel else None
        if found is None:
            continue
        where, node = found
        for callee in dict.fromkeys(assigned_classes(node, RUNNER_ATTRIBUTE)):
            runner = source.class_of(where, callee)
            if runner is None:
                raise Failed(f"{where}: {worker.name}.{RUNNER_ATTRIBUTE} is built by {callee}, which the release lacks")
            built.append((worker.name, runner[0], runner[1].name))
    if not built:
        raise Failed(f"no worker of {', '.join(w.module for w in WORKERS)} builds a {RUNNER_ATTRIBUTE}")
    return built


def _runner_missing(source: _Source, built: list, need: Runner) -> str | None:
    for worker, rel, cls in built:
        names = [n.split(".")[0] if n.startswith("model.") else n for n in need.any_of]
        if not any(source.has(rel, cls, n) for n in names):
            return (
                f"the model runner {cls} ({rel}) that {worker} builds has none of {', '.join(need.any_of)} "
                f"(part {need.part!r})"
            )
    return None


def import_needs(package: Path = PACKAGE) -> list[Need]:
    """A Name need for every `vllm` import in the tools' modules (run/, bench/, fork/; the model file aside:
    `names` checks it)."""
    needs = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if not rel.startswith(("run/", "bench/", "fork/")) or rel.startswith(("fork/patches/", "fork/models/")):
            continue
        found = []
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                found += [Name(node.module or "", a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [Name(a.name) for a in node.names if a.name.split(".")[0] == "vllm"]
        if found and rel not in IMPORTS_SINCE:
            raise Failed(
                f"ministream/{rel} imports vllm ({found[0].module}) and states no era: add it to IMPORTS_SINCE "
                f"in ministream/fork/internals.py"
            )
        needs += [Need(rel, IMPORTS_SINCE[rel], what) for what in found]
    return needs


def _cpu_part(source: _Source, version: str) -> int:
    """The CPU part's edits find what they edit in the release's files; how many files it checked."""
    checked = 0
    for rel in cpu.CLI_FILES:
        if not source.found.module(rel.removesuffix(".py")):
            continue
        text = source.found.text(rel)
        asks = sum(
            1
            for n in ast.walk(source.parse(rel))
            if isinstance(n, ast.Call)
            and "version" in ast.unparse(n.func).lower()  # importlib.metadata.version, under any name
            and [ast.unparse(a) for a in n.args] in (["'vllm'"], ['"vllm"'])
        )
        if asks > len(cpu.CLI_LINE.findall(text.encode())):
            raise Failed(
                f"{CPU_PART}: {rel} asks version('vllm') {asks} time(s) in vLLM {version}, in a form cpu.CLI_LINE "
                f"({cpu.CLI_LINE.pattern.decode()}) does not match: the CPU wheel's `vllm` command would die; extend "
                f"CLI_LINE"
            )
        checked += 1
    if cpu.needs_platform_fix(version):
        try:
            cpu.platform_fix(source.found.text(cpu.PLATFORM_FILE).encode(), f"{cpu.PLATFORM_FILE} of vLLM {version}")
        except MiniStreamError as e:
            raise Failed(f"{CPU_PART}: {e}") from None
        checked += 1
    return checked


def internals(tree: Path, patched: Path, version: str, folder: Path, needs: tuple[Need, ...] | None = None) -> str:
    """The check; `needs`: NEEDS and the package's imports unless given."""
    source = _Source(Release(version, patched))
    resolved: Counter = Counter()
    later: dict[str, str] = {}
    env = built = None
    for need in (*NEEDS, *import_needs()) if needs is None else needs:
        if Version(version) < Version(need.since):
            later.setdefault(need.tool, need.since)
            continue
        what = need.what
        if isinstance(what, Env):
            env = _environment(source) if env is None else env
            missing = None if what.name in env else f"{ENVS} has no {what.name}"
        elif isinstance(what, Runner):
            built = runners(source) if built is None else built
            missing = _runner_missing(source, built, what)
        else:
            missing = _resolve(source, what)
        if missing:
            raise Failed(
                f"{need.tool}: {missing} in vLLM {version}; mend the tool for this release (its names are in "
                f"ministream/fork/internals.py)"
            )
        resolved[need.tool] += 1
    resolved[CPU_PART] = _cpu_part(source, version)
    said = [", ".join(f"{tool} {n}" for tool, n in resolved.items() if n) + " resolve"]
    if later:
        said.append("later eras: " + ", ".join(f"{tool} from {since}" for tool, since in later.items()))
    if source.found.module(PLATFORM_CPU.removesuffix(".py")) and cpu_needs_triton(source.found.text(PLATFORM_CPU)):
        said.append("the x86 CPU platform requires Triton (triton-cpu)")
    return re.sub(r"\s+", " ", "; ".join(said))
