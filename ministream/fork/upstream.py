"""upstream: the rest of the upstream pull request, in each release's form (the part of a patch set outside vllm/).

The hand-made patch set (v0.32.0) adds an example-model entry to tests/models/registry.py, a row to the
supported-models page and a generation test. Every derived set gets the same three, re-made from the
files of its release's sdist (tests/ and docs/ are not in the wheel), in the layout that release uses.
`port` writes them into patches/vX/upstream/; `matrix` checks them against the release.
"""

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import MiniStreamError
from ..paths import PATCH_SETS
from .patchset import UPSTREAM, manifest, patch_set_dir, pinned, unified_diff
from .pysource import import_target
from .release import sdist_files, sdist_names

EXAMPLES_PY = "tests/models/registry.py"  # the example model of each architecture (0.6.6 and later)
EXAMPLES_DICT = "_TEXT_GENERATION_EXAMPLE_MODELS"
EXAMPLES_CLASS = "_HfExamplesInfo"
# the supported-models page, newest layout first: mkdocs (0.9+), MyST (0.6.6-0.8), reStructuredText (0.6.3)
DOCS_PAGES = (
    "docs/models/supported_models.md",
    "docs/source/models/supported_models.md",
    "docs/source/models/supported_models.rst",
)
# the folder of the decoder-only generation tests, newest layout first
TEST_DIRS = ("tests/models/language/generation", "tests/models/decoder_only/language")
TESTS_UTILS_PY = "tests/models/utils.py"  # check_logprobs_close, check_outputs_equal: the test imports them
UPSTREAM_READ = (EXAMPLES_PY, TESTS_UTILS_PY, *DOCS_PAGES)  # what is read of each release's sdist
TEMPLATE_ROW = "LlamaForCausalLM"  # our docs row takes its form and support marks from LLaMA's


@dataclass
class HandMade:
    """The hand-made set's upstream part, taken apart: what every release gets, in its own form."""

    source: str  # the hand-made set's folder name (v0.32.0)
    entry: str  # the example entry's lines (comment included), as added to tests/models/registry.py
    row: list[str]  # the cells of the supported-models row (Markdown)
    test_path: str  # the generation test's path in the tree
    test: str  # its text


@dataclass
class UpstreamPart:
    diff: str = ""  # upstream/upstream.diff
    added: dict[str, str] = field(default_factory=dict)  # upstream/files/: tree path -> text
    pristine: dict[str, str] = field(default_factory=dict)  # the release's files the diff changes
    reason: str = ""  # why the release has none (recorded in the manifest as "upstream")
    source: str = ""  # the hand-made set it is made from


def hand_made_upstream(src: Path, patch_sets: Path = PATCH_SETS) -> HandMade:
    """The upstream part of the hand-made set that `src` derives from: every release's is made from
    it (not from the set ported from, which may have none: 0.15.1 has no sdist)."""
    folder = src
    while "ported_from" in manifest(folder):
        folder = patch_set_dir(manifest(folder)["ported_from"], patch_sets)
    added = {}
    diff = (folder / UPSTREAM / "upstream.diff").read_text()
    for chunk in re.split(r"^diff --git a/\S+ b/", diff, flags=re.M)[1:]:
        path, body = chunk.split("\n", 1)
        added[path] = [
            line[1:] for line in body.splitlines(keepends=True) if line.startswith("+") and not line.startswith("+++")
        ]
    tests = sorted((folder / UPSTREAM / "files").rglob("test_*.py"))
    rows = [line for path, lines in added.items() if path.startswith("docs/") for line in lines]
    if EXAMPLES_PY not in added or len(rows) != 1 or not rows[0].startswith("| `") or len(tests) != 1:
        raise MiniStreamError(
            f"{folder / UPSTREAM} is not in the shape port reads (an entry added to {EXAMPLES_PY}, "
            f"one Markdown row to the supported-models page, one test_*.py): extend upstream.py"
        )
    return HandMade(
        folder.name,
        "".join(added[EXAMPLES_PY]),
        [c.strip() for c in rows[0].strip().split("|")[1:-1]],
        tests[0].relative_to(folder / UPSTREAM / "files").as_posix(),
        tests[0].read_text(),
    )


def upstream_files(version: str, patch_sets: Path = PATCH_SETS) -> dict[str, str | None]:
    """The release's files the upstream part reads or changes (None: not in its sdist), checked
    against the manifest's sha256 where it has them; NoSdist when PyPI has no sdist."""
    try:
        folder = patch_set_dir(version, patch_sets)
    except MiniStreamError:
        folder = None
    pins = pinned(folder, version) if folder and (folder / "manifest.json").is_file() else {}
    return sdist_files(version, UPSTREAM_READ, pins)


class NoUpstream(MiniStreamError):
    """The release's sdist ships neither docs/ nor tests/models/ (0.4, 0.5): nothing to add to."""


def upstream_part(version: str, made: HandMade, patch_sets: Path = PATCH_SETS) -> UpstreamPart:
    """upstream/ for release `version`, from its sdist's files."""
    files, names = upstream_files(version, patch_sets), sdist_names(version)
    if not any(n.startswith(("docs/", "tests/models/")) for n in names):
        raise NoUpstream(
            f"the vllm {version} sdist ships no docs/ and no tests/models/ (no supported-models page, no model tests)"
        )
    pristine: dict[str, str] = {}  # the release's files that change, and what they become
    changed: dict[str, str] = {}
    examples = None
    if (registry_py := files[EXAMPLES_PY]) is not None:  # (fields, methods) of its _HfExamplesInfo
        examples = example_fields(registry_py), example_methods(registry_py)
        pristine[EXAMPLES_PY] = registry_py
        changed[EXAMPLES_PY] = add_example(registry_py, example_entry(made.entry, examples[0]))
    docs = next(((p, page) for p in DOCS_PAGES if (page := files[p]) is not None), None)
    if docs is None:
        raise MiniStreamError(
            f"the vllm {version} sdist has none of {', '.join(DOCS_PAGES)}: a new docs layout; "
            f"add its supported-models page to upstream.DOCS_PAGES"
        )
    pristine[docs[0]] = docs[1]
    changed[docs[0]] = add_docs_row(docs[1], made.row)
    test_dir = next((d for d in TEST_DIRS if f"{d}/__init__.py" in names), None)
    if test_dir is None:
        raise MiniStreamError(
            f"the vllm {version} sdist has none of {', '.join(TEST_DIRS)}: a new tests layout; "
            f"add its generation-test folder to upstream.TEST_DIRS"
        )
    test = generation_test(made, test_dir, examples)
    return UpstreamPart(
        "".join(unified_diff(p, p, pristine[p], text) for p, text in changed.items()),
        {f"{test_dir}/{Path(made.test_path).name}": test},
        pristine,
        source=made.source,
    )


def _examples_dict(registry_py: str) -> ast.Dict:
    for node in ast.parse(registry_py).body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if isinstance(target, ast.Name) and target.id == EXAMPLES_DICT and isinstance(node.value, ast.Dict):
            return node.value
    raise MiniStreamError(f"{EXAMPLES_PY} has no {EXAMPLES_DICT} = {{...}}: a new layout; extend upstream.add_example")


def _examples_class(registry_py: str) -> ast.ClassDef:
    for node in ast.parse(registry_py).body:
        if isinstance(node, ast.ClassDef) and node.name == EXAMPLES_CLASS:
            return node
    raise MiniStreamError(f"{EXAMPLES_PY} defines no {EXAMPLES_CLASS}: a new layout; extend upstream.example_fields")


def example_fields(registry_py: str) -> set[str]:
    """The fields of this release's _HfExamplesInfo dataclass."""
    return {
        n.target.id
        for n in _examples_class(registry_py).body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def example_methods(registry_py: str) -> set[str]:
    return {n.name for n in _examples_class(registry_py).body if isinstance(n, ast.FunctionDef)}


def _entry_dict(entry: str) -> ast.Dict:
    """The hand-made entry (`"Arch": _HfExamplesInfo(...),`) as a one-entry dict display."""
    node = ast.parse("{\n" + entry + "}").body[0]
    assert isinstance(node, ast.Expr) and isinstance(node.value, ast.Dict), entry
    return node.value


def _entry_call(entry: str) -> ast.Call:
    call = _entry_dict(entry).values[0]
    assert isinstance(call, ast.Call), entry
    return call


def example_entry(entry: str, fields: set[str]) -> str:
    """The hand-made entry with only the keyword arguments this release's _HfExamplesInfo has
    (0.6-0.8 have no max_model_len): one argument a line, as the hand-made entry writes them."""
    kept = "".join(
        line for line in entry.splitlines(keepends=True) if not (m := re.match(r"\s+(\w+)=", line)) or m[1] in fields
    )
    unknown = {k.arg for k in _entry_call(kept).keywords if k.arg is not None} - fields
    if unknown:
        raise MiniStreamError(
            f"the example entry sets {', '.join(sorted(unknown))}, which this release's "
            f"{EXAMPLES_CLASS} lacks, on a line shared with another argument: one argument a line"
        )
    return kept


def example_ids(entry: str) -> list[str]:
    """The model ids of the entry: the default, then the extras."""
    call = _entry_call(entry)
    extras: dict[str, str] = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "extras"), {})
    return [ast.literal_eval(call.args[0]), *extras.values()]


def example_value(entry: str, name: str):
    return next((ast.literal_eval(k.value) for k in _entry_call(entry).keywords if k.arg == name), None)


def add_example(registry_py: str, entry: str) -> str:
    """tests/models/registry.py with `entry` in the text-generation examples where the hand-made one
    is: before the first entry that sorts after it (code-point order), right below the entry above
    that one (so above its comments)."""
    key = _entry_dict(entry).keys[0]
    assert isinstance(key, ast.Constant) and isinstance(key.value, str), entry
    arch = key.value
    d = _examples_dict(registry_py)
    keyed = [(k.value, v) for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if any(k == arch for k, _ in keyed):
        raise MiniStreamError(f"{EXAMPLES_PY} already has an entry {arch!r} in {EXAMPLES_DICT}")
    after = next((i for i, (k, _) in enumerate(keyed) if k > arch), len(keyed))
    lines = registry_py.splitlines(keepends=True)
    if after:
        at = keyed[after - 1][1].end_lineno
    else:
        first = d.keys[0]
        assert first is not None, f"{EXAMPLES_DICT} starts with a ** entry"
        at = first.lineno - 1
    return "".join(lines[:at]) + entry + "".join(lines[at:])


# docs row forms: Markdown table (| `X` | ...), reStructuredText list-table (  * - :code:`X`), MyST list-table (- * `X`)
_ROW = re.compile(r"^(\| |\s*\* - |- \* )(?::code:)?`(\w+)`")


def add_docs_row(page: str, cells: list[str]) -> str:
    """The supported-models page with our row in the text-generation table (the first that lists
    LlamaForCausalLM), before the first row that sorts after it, in the table's form: LLaMA's row with
    our first three cells (architecture, models, example ids), its support marks kept (ours is LLaMA's code)."""
    lines = page.splitlines(keepends=True)
    found = next(((i, m) for i, line in enumerate(lines) if (m := _ROW.match(line)) and m[2] == TEMPLATE_ROW), None)
    if found is None:
        raise MiniStreamError(
            f"the supported-models page has no row for {TEMPLATE_ROW}: a new layout; extend upstream.add_docs_row"
        )
    llama, prefix = found[0], found[1][1]
    table = _table(lines, llama, prefix)
    starts = [i for i in table if lines[i].startswith(prefix)]
    rows = {i: lines[i : next((j for j in starts if j > i), table[-1] + 1)] for i in starts}
    arch = re.sub(r"`", "", cells[0])
    if any((m := _ROW.match(lines[i])) and m[2] == arch for i in starts):
        raise MiniStreamError(f"the supported-models page already has a row for {arch}")
    template = rows[llama]
    code = (lambda s: re.sub(r"`([^`]+)`", r":code:`\1`", s)) if ":code:`" in template[0] else (lambda s: s)
    if prefix == "| ":
        marks = [f" {m.strip()} " if m.strip() else " " for m in template[0].rstrip("\n").split("|")[4:-1]]
        row = ["| " + " | ".join(code(c) for c in cells[:3]) + " |" + "|".join(marks) + "|\n"]
    else:
        m = re.match(r"^\s*[-*] ?", template[1]) if len(template) > 1 else None
        cell = m[0] if m else None
        if cell is None or not all(re.match(r"^\s*[-*]( |$)", line) for line in template[1:]):
            raise MiniStreamError(
                f"the {TEMPLATE_ROW} row of the supported-models page spans lines per cell: "
                f"extend upstream.add_docs_row"
            )
        row = [
            prefix + code(cells[0]) + "\n",
            cell + code(cells[1]) + "\n",
            cell + code(cells[2]) + "\n",
            *template[3:],
        ]
    after = [i for i in starts if (m := _ROW.match(lines[i])) and m[2] > arch]
    at = after[0] if after else table[-1] + 1
    return "".join(lines[:at] + row + lines[at:])


def _table(lines: list[str], row: int, prefix: str) -> list[int]:
    """Line indices of the table holding line `row`: contiguous Markdown table lines, or the
    contiguous item lines of a list-table."""
    inside = (
        (lambda line: line.startswith("|"))
        if prefix == "| "
        else (lambda line: bool(line.strip()) and bool(re.match(r"^\s*[-*]( |$)", line)))
    )
    start = end = row
    while start > 0 and inside(lines[start - 1]):
        start -= 1
    while end + 1 < len(lines) and inside(lines[end + 1]):
        end += 1
    return list(range(start, end + 1))


def generation_test(made: HandMade, test_dir: str, examples: tuple[set[str], set[str]] | None) -> str:
    """The hand-made generation test for a release, its relative imports made from `test_dir`.
    `examples`: (fields, methods) of the release's _HfExamplesInfo, None where it has no
    tests/models/registry.py. Where that lacks what the test uses, the test does without: no registry
    (0.6.3): the model ids listed in the test; no availability checks (0.6.6): not called; no
    max_model_len field (0.6-0.8): the hand-made entry's value as a constant of the test (vLLM's
    test runner would otherwise ask for 1024 tokens of a 512-token model)."""
    text = _relative_imports(made.test, Path(made.test_path).parent.as_posix(), test_dir)
    fields, methods = examples or (set(), set())
    if examples is None:
        ids = ", ".join(f'"{i}"' for i in example_ids(made.entry))
        text = _replace(text, re.search(r"^from \.+registry import HF_EXAMPLE_MODELS\n", text, re.M), "")
        text = _replace(
            text,
            'MODEL_INFO = HF_EXAMPLE_MODELS.get_hf_info("MiniStreamForCausalLM")\n'
            "MODELS = [MODEL_INFO.default, *MODEL_INFO.extras.values()]\n",
            "# this release has no tests/models/registry.py of example models: the ids are listed here\n"
            f"MODELS = [{ids}]\n",
        )
        text = text.replace(" on the example models of tests/models/registry.py", " on the MiniStream example models")
    for check in ("check_available_online", "check_transformers_version"):
        if check not in methods:
            text = _replace(text, f'    MODEL_INFO.{check}(on_fail="skip")\n', "")
    value = example_value(made.entry, "max_model_len")
    if "max_model_len" not in fields and value is not None:
        text = _replace(text, "max_model_len=MODEL_INFO.max_model_len", "max_model_len=MAX_MODEL_LEN")
        models = re.search(r"^MODELS = .*\n", text, re.M)
        text = _replace(
            text, models, (models[0] if models else "") + f"MAX_MODEL_LEN = {value}  # the example models' context\n"
        )
    return text


def _replace(text: str, old, new: str) -> str:
    """`text` with `old` (a string or a match) replaced once; refused when the hand-made test lacks it."""
    old = old[0] if isinstance(old, re.Match) else old
    if not old or old not in text:
        raise MiniStreamError(
            f"the hand-made generation test no longer has {old!r}, which port adapts for older "
            f"releases: extend upstream.generation_test"
        )
    return text.replace(old, new, 1)


def _relative_imports(text: str, src: str, dst: str) -> str:
    """`text`'s relative imports, written in package `src`, rewritten for package `dst`."""

    def rewrite(m: re.Match) -> str:
        target = import_target(src, len(m[1]), m[2]).split("/")
        here = dst.split("/")
        common = next((i for i, (a, b) in enumerate(zip(here, target[:-1])) if a != b), min(len(here), len(target) - 1))
        return f"from {'.' * (len(here) - common + 1)}{'.'.join(target[common:])} import"

    return re.sub(r"^from (\.+)([\w.]*) import", rewrite, text, flags=re.M)
