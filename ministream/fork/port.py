"""port: carry the MiniStream patch set from one vLLM release to another.

    ministream port 0.32.0 0.33.0      patches/v0.33.0/ from patches/v0.32.0/ and the two releases

Two halves, because our patch is two kinds of change:
- model.diff (llama.py -> ministream.py) is three-way merged with `git merge-file`:
  base llama.py@FROM, ours ministream.py@FROM, theirs llama.py@TO. Our own lines that name
  the release (header, MINISTREAM_PATCH_VERSION) are retargeted to TO first; after the merge,
  references that TO's llama.py adds to a class we renamed (LlamaModel -> MiniStreamModel)
  are renamed too, and listed.
- the registrations are not merged but re-made in TO's form: the architecture goes into
  _TEXT_GENERATION_MODELS, the model_type into _CONFIG_REGISTRY (a dict of classes, or a
  LazyConfigDict of names), the class into configs/__init__.py (imports + __all__, or
  _CLASS_TO_MODULE + __all__). Each entry goes next to its closest alphabetical neighbours.

Writes patches/vTO/ (model.diff, registry.diff, files/, manifest.json) and the versions.json
entry. Conflicts are written into model.diff with their markers, listed with their hunks,
and the command exits 1: resolve them in patches/vTO/model.diff, then run `make matrix`.
"""

import ast
import difflib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import tokenize
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError
from .patch import LLAMA, MINISTREAM, PATCHES, manifest, model_diff, patch_dir, supported_versions
from .release import release_wheel

REGISTRY = "vllm/model_executor/models/registry.py"
CONFIG = "vllm/transformers_utils/config.py"
CONFIGS = "vllm/transformers_utils/configs/__init__.py"
TOUCHED = [LLAMA, REGISTRY, CONFIG, CONFIGS]

ARCH = "MiniStreamForCausalLM"
MODEL_TYPE = "ministream"
CONFIG_CLASS = "MiniStreamConfig"
CONFIG_MODULE = "vllm.transformers_utils.configs.ministream"


# --- release files --------------------------------------------------------------------------

def release_files(version: str, files=TOUCHED) -> dict[str, str]:
    """The pristine text of `files` in the vLLM `version` release wheel (downloaded once, cached)."""
    wheel = release_wheel(version, "cuda")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = [f for f in files if f not in names]
        if missing:
            raise MiniStreamError(f"{wheel.name} has no {', '.join(missing)}: MiniStream patch sets "
                                  f"need vLLM's in-tree LLaMA and its registries (vLLM 0.6 or later)")
        return {f: z.read(f).decode() for f in files}


def apply_model_diff(llama: str, diff: Path) -> str:
    """ministream.py = `llama` + model.diff, by `git apply` in a scratch tree."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / LLAMA).parent.mkdir(parents=True)
        (Path(tmp) / LLAMA).write_text(llama)
        run = subprocess.run(["git", "apply", str(Path(diff).resolve())], cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "GIT_CEILING_DIRECTORIES": tmp})
        if run.returncode != 0:
            raise MiniStreamError(f"{diff} does not apply to that release's {LLAMA}: {run.stderr.strip()}")
        return (Path(tmp) / MINISTREAM).read_text()


# --- the model: three-way merge -------------------------------------------------------------

@dataclass
class Conflict:
    line: int  # 1-based line of "<<<<<<<" in the merged ministream.py
    hunk: str  # the conflict block, markers included


@dataclass
class ModelPort:
    text: str
    conflicts: list[Conflict] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)  # "line N: LlamaModel -> MiniStreamModel"
    dropped: list[Conflict] = field(default_factory=list)  # regions we delete that llama.py@b changed
    resolved: list[Conflict] = field(default_factory=list)  # our rename on lines llama.py@b changed
    recorded: list[Conflict] = field(default_factory=list)  # resolved as patches/resolutions.json says


def retarget(model: str, a: str, b: str) -> str:
    """Our lines that name release `a` name `b` instead (the revision of the patch is kept)."""
    model = re.sub(rf'^MINISTREAM_PATCH_VERSION = "{re.escape(a)}-(\d+)"$',
                   rf'MINISTREAM_PATCH_VERSION = "{b}-\1"', model, flags=re.M)
    model = model.replace(f"patches/v{a}/", f"patches/v{b}/")
    return re.sub(rf"\bvLLM {re.escape(a)}(?![\w.])", f"vLLM {b}", model)


def _classes(text: str) -> list[str]:
    return re.findall(r"^class (\w+)\b", text, re.M)


def renames(base: str, ours: str) -> dict[str, str]:
    """Classes our diff renames: LlamaX in base -> MiniStreamX in ours."""
    ours_classes = set(_classes(ours))
    return {c: "MiniStream" + c[len("Llama"):] for c in _classes(base)
            if c.startswith("Llama") and c not in ours_classes and "MiniStream" + c[len("Llama"):] in ours_classes}


def merge_model(base: str, ours: str, theirs: str, a: str, b: str, resolutions: list[dict] = ()) -> ModelPort:
    """ministream.py@b from llama.py@a (base), ministream.py@a (ours) and llama.py@b (theirs).

    resolutions: conflicts resolved by hand before ({"ours", "theirs", "resolution"}, see
    patches/resolutions.json): a conflict between exactly those texts is resolved the same way."""
    rename = renames(base, ours)
    # our module docstring replaces llama.py's whole: merged apart from the code, put back after
    ours = retarget(ours, a, b)
    header = _docstring(ours)
    ours = _with_docstring(ours, _docstring(base))
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, text in (("ours", ours), ("base", base), ("theirs", theirs)):
            (Path(tmp) / name).write_text(text)
            paths.append(name)
        run = subprocess.run(["git", "merge-file", "-p", "--diff3", "-L", f"ministream.py@{a}", "-L", f"llama.py@{a}",
                              "-L", f"llama.py@{b}", *paths], cwd=tmp, capture_output=True, text=True)
    if run.returncode < 0 or run.returncode > 127:
        raise MiniStreamError(f"git merge-file failed: {run.stderr.strip()}")
    port = ModelPort(run.stdout)
    lines = port.text.splitlines(keepends=True)
    kept, start = [], None
    for i, line in enumerate(lines):
        if line.startswith("<<<<<<< "):
            start, bar, middle = i, None, None
        elif line.startswith("||||||| ") and start is not None:
            bar = i
        elif line.startswith("=======") and start is not None:
            middle = i
        elif line.startswith(">>>>>>> ") and start is not None:
            mine, old, new = (lines[start + 1:bar], lines[bar + 1:middle], lines[middle + 1:i])
            block = "".join(lines[start:bar] + lines[middle:i + 1])
            if not mine:
                # we deleted this region (the variants we drop), llama.py@b changed it: still deleted
                port.dropped.append(Conflict(len(kept) + 1, block))
            elif (recorded := _recorded(resolutions, "".join(mine), "".join(new))) is not None:
                # resolved by hand once, recorded in patches/resolutions.json: the same again
                port.recorded.append(Conflict(len(kept) + 1, block))
                kept.append(recorded)
            elif (resolution := _mechanical(old, mine, new, rename)) is not None:
                # our changes here are mechanical (rename, comments, dropped imports): made again
                # on llama.py@b's lines
                port.resolved.append(Conflict(len(kept) + 1, block))
                kept.extend(resolution)
            else:
                port.conflicts.append(Conflict(len(kept) + 1, block))
                kept.extend(lines[start:bar] + lines[middle:i + 1])
            start = None
        elif start is None:
            kept.append(line)
    port.text = _with_docstring("".join(kept), header)
    # llama.py@b may use a renamed class where llama.py@a did not: follow our rename there too
    # (names in code only; comments and strings are left alone)
    defined = set(_classes(port.text))
    rename = {old: new for old, new in rename.items() if old not in defined}
    port.text, port.renamed = _rename_names(port.text, rename)
    return port


def _recorded(resolutions, mine: str, new: str) -> str | None:
    for r in resolutions:
        if r["ours"] == mine and r["theirs"] == new:
            return r["resolution"]
    return None


def load_resolutions(patches: Path = PATCHES) -> list[dict]:
    f = patches / "resolutions.json"
    return json.loads(f.read_text()) if f.is_file() else []


def _docstring(text: str) -> str:
    """The module docstring's lines, verbatim."""
    node = ast.parse(text).body[0]
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
        raise MiniStreamError("llama.py has no module docstring: a new layout; extend ministream/port.py")
    return "".join(text.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])


def _with_docstring(text: str, docstring: str) -> str:
    """`text` with its module docstring (the first line opening with triple quotes) replaced."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith('"""'))
    end = start if lines[start].rstrip().endswith('"""') and len(lines[start].strip()) > 3 else \
        next(i for i in range(start + 1, len(lines)) if lines[i].rstrip().endswith('"""'))
    return "".join(lines[:start]) + docstring + "".join(lines[end + 1:])


def _mechanical(old: list[str], mine: list[str], new: list[str], rename: dict[str, str]):
    """llama.py@b's region `new` with our changes made to it, when all we changed in `old` (to
    get `mine`) is mechanical: the class rename, lines added above or below the region (an
    import, a comment), comments added above a line llama.py@b still has, lines deleted (the
    imports of what we drop). None when we changed anything else there: code added inside the
    region, lines edited."""
    renamed = _rename_code("".join(old), rename).splitlines(keepends=True)
    if "".join("".join(renamed).split()) == "".join("".join(mine).split()):
        return _rename_code("".join(new), rename).splitlines(keepends=True)  # renamed and re-wrapped
    ops = _ops_from_the_end(renamed, mine) or difflib.SequenceMatcher(None, renamed, mine, autojunk=False).get_opcodes()
    head, tail, deleted, before = [], [], [], {}
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        if tag == "delete":
            deleted += renamed[i1:i2]
            continue
        added = mine[j1:j2]
        if tag != "insert":
            return None
        if i1 == 0:
            head += added
        elif i1 == len(renamed):
            tail += added
        elif all(line.lstrip().startswith("#") for line in added if line.strip()) and renamed[i1].strip():
            before.setdefault(renamed[i1], []).extend(added)  # our comment above a line: above it again
        else:
            return None
    body = [line for line in _rename_code("".join(new), rename).splitlines(keepends=True)
            if line not in deleted or not line.strip()]
    for anchor, added in before.items():
        if body.count(anchor) != 1:
            return None
        i = body.index(anchor)
        body[i:i] = added
    return head + body + tail


def _ops_from_the_end(renamed: list[str], mine: list[str]) -> list[tuple] | None:
    """Opcodes for `mine` = lines added + `renamed` with comment lines added inside, matched from
    the end (difflib would pair a blank line of `renamed` with the first blank line of what we
    added above it); None when `mine` is not of that shape."""
    ops, j = [], len(mine)
    for i in range(len(renamed) - 1, -1, -1):
        k = j
        while k > 0 and mine[k - 1] != renamed[i] and mine[k - 1].lstrip().startswith("#"):
            k -= 1
        if k == 0 or mine[k - 1] != renamed[i]:
            return None
        if k < j:
            ops.append(("insert", i + 1, i + 1, k, j))
        ops.append(("equal", i, i + 1, k - 1, k))
        j = k - 1
    if j > 0:
        ops.append(("insert", 0, 0, 0, j))
    return ops[::-1]


def _rename_code(text: str, rename: dict[str, str]) -> str:
    """`rename` applied to a fragment of code, comment lines left alone."""
    out = []
    for line in text.splitlines(keepends=True):
        if not line.lstrip().startswith("#"):
            for old, new in rename.items():
                line = re.sub(rf"\b{old}\b", new, line)
        out.append(line)
    return "".join(out)


def _rename_names(text: str, rename: dict[str, str]) -> tuple[str, list[str]]:
    """Rename the identifiers `rename` maps, in code only; returns the text and what changed where."""
    if not rename:
        return text, []
    lines = text.splitlines(keepends=True)
    done = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return text, []  # conflict markers: renamed once the conflicts are resolved and ported again
    for tok in reversed(tokens):  # from the end, so that earlier columns stay right
        if tok.type == tokenize.NAME and tok.string in rename:
            row, col = tok.start
            new = rename[tok.string]
            lines[row - 1] = lines[row - 1][:col] + new + lines[row - 1][col + len(tok.string):]
            done.append(f"line {row}: {tok.string} -> {new}")
    return "".join(lines), done[::-1]


# --- the registrations: re-made in the new release's form -----------------------------------

def _neighbour(keys: list[str], key: str) -> int:
    """Index of the entry `key` goes after: among the keys sorting before it, those sharing the
    longest prefix with it, the last in file order; -1 (first) when none sorts before it."""
    def common(k):
        n = 0
        while n < min(len(k), len(key)) and k[n] == key[n]:
            n += 1
        return n
    before = [i for i, k in enumerate(keys) if k < key]
    if not before:
        return -1
    best = max(common(keys[i]) for i in before)
    return max(i for i in before if common(keys[i]) == best)


def _assignment(tree: ast.Module, name: str) -> ast.AST | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.value
    return None


def _insert_entry(text: str, spans: list[tuple[str, int, int]], key: str, line: str, where: str) -> str:
    """Insert `line` (no indentation, no newline) after the neighbour of `key` among `spans`
    ((key, first line, last line), 1-based), indented as that entry; refuses a duplicate."""
    if not spans:
        raise MiniStreamError(f"{where} is empty or not one entry per line; add {line!r} by hand")
    keys = [k for k, _, _ in spans]
    if key in keys:
        raise MiniStreamError(f"{where} already has an entry {key!r}: is this tree already patched?")
    lines = text.splitlines(keepends=True)
    i = _neighbour(keys, key)
    _, first, last = spans[max(i, 0)]
    indent = re.match(r"\s*", lines[first - 1]).group(0)
    at = last if i >= 0 else first - 1
    lines.insert(at, f"{indent}{line}\n")
    return "".join(lines)


def _dict_spans(node: ast.Dict) -> list[tuple[str, int, int]]:
    return [(k.value, k.lineno, v.end_lineno) for k, v in zip(node.keys, node.values)
            if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def _list_spans(node: ast.List) -> list[tuple[str, int, int]]:
    return [(e.value, e.lineno, e.end_lineno) for e in node.elts
            if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _one_per_line(spans: list[tuple[str, int, int]]) -> bool:
    return len({first for _, first, _ in spans}) == len(spans)


def add_architecture(text: str) -> str:
    """registry.py: "MiniStreamForCausalLM": ("ministream", "MiniStreamForCausalLM") in
    _TEXT_GENERATION_MODELS."""
    node = _assignment(ast.parse(text), "_TEXT_GENERATION_MODELS")
    if not isinstance(node, ast.Dict):
        raise MiniStreamError(f"{REGISTRY} has no _TEXT_GENERATION_MODELS dict: a new registry form; "
                              f"extend ministream/port.py (add_architecture)")
    return _insert_entry(text, _dict_spans(node), ARCH, f'"{ARCH}": ("{MODEL_TYPE}", "{ARCH}"),',
                         f"{REGISTRY} _TEXT_GENERATION_MODELS")


def config_forms(config: str, configs: str) -> tuple[str, str]:
    """(form of _CONFIG_REGISTRY, form of configs/__init__.py) in a release:
    ("dict", ...) {"model_type": ConfigClass}, ("lazy", ...) LazyConfigDict(model_type="ConfigClass");
    (..., "imports") from-imports + __all__, (..., "class-to-module") _CLASS_TO_MODULE + __all__."""
    node = _assignment(ast.parse(config), "_CONFIG_REGISTRY")
    if isinstance(node, ast.Dict):
        registry = "dict"
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LazyConfigDict":
        registry = "lazy"
    else:
        raise MiniStreamError(f"{CONFIG}: _CONFIG_REGISTRY is neither a dict nor a LazyConfigDict: "
                              f"a new registry form; extend ministream/port.py (config_forms)")
    tree = ast.parse(configs)
    if _assignment(tree, "__all__") is None:
        raise MiniStreamError(f"{CONFIGS} has no __all__: a new form; extend ministream/port.py (config_forms)")
    exports = "class-to-module" if isinstance(_assignment(tree, "_CLASS_TO_MODULE"), ast.Dict) else "imports"
    return registry, exports


def add_config(config: str, configs: str) -> tuple[str, str]:
    """config.py and configs/__init__.py with MiniStreamConfig registered for model_type "ministream"."""
    registry, exports = config_forms(config, configs)
    node = _assignment(ast.parse(config), "_CONFIG_REGISTRY")
    where = f"{CONFIG} _CONFIG_REGISTRY"
    if registry == "dict":
        config = _insert_entry(config, _dict_spans(node), MODEL_TYPE, f'"{MODEL_TYPE}": {CONFIG_CLASS},', where)
        # the classes are imported by name from the package: one more import line after that import
        tree = ast.parse(config)
        imp = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "vllm.transformers_utils.configs"]
        if not imp:
            raise MiniStreamError(f"{CONFIG} does not import from vllm.transformers_utils.configs: a new form; "
                                  f"extend ministream/port.py (add_config)")
        lines = config.splitlines(keepends=True)
        lines.insert(imp[0].end_lineno, f"from vllm.transformers_utils.configs import {CONFIG_CLASS}\n")
        config = "".join(lines)
    else:
        spans = [(k.arg, k.lineno, k.end_lineno) for k in node.keywords if k.arg]
        config = _insert_entry(config, spans, MODEL_TYPE, f'{MODEL_TYPE}="{CONFIG_CLASS}",', where)

    tree = ast.parse(configs)
    if exports == "class-to-module":
        spans = _dict_spans(_assignment(tree, "_CLASS_TO_MODULE"))
        configs = _insert_entry(configs, spans, CONFIG_CLASS, f'"{CONFIG_CLASS}": "{CONFIG_MODULE}",',
                                f"{CONFIGS} _CLASS_TO_MODULE")
    else:
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("vllm.transformers_utils.configs.")]
        spans = [(n.module, n.lineno, n.end_lineno) for n in imports]
        configs = _insert_entry(configs, spans, CONFIG_MODULE, f"from {CONFIG_MODULE} import {CONFIG_CLASS}",
                                f"{CONFIGS} imports")
    spans = _list_spans(_assignment(ast.parse(configs), "__all__"))
    if not _one_per_line(spans):
        raise MiniStreamError(f"{CONFIGS} __all__ is not one name per line; add {CONFIG_CLASS!r} by hand")
    configs = _insert_entry(configs, spans, CONFIG_CLASS, f'"{CONFIG_CLASS}",', f"{CONFIGS} __all__")
    return config, configs


def file_diff(path: str, old: str, new: str) -> str:
    """A git-style diff of one file, paths relative to the tree root."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "a").write_text(old)
        Path(tmp, "b").write_text(new)
        run = subprocess.run(["git", "diff", "--no-index", "--no-color", "--no-ext-diff",
                              "--diff-algorithm=myers", "-U3", "a", "b"], cwd=tmp, capture_output=True, text=True)
    if run.returncode != 1 or "\n@@" not in run.stdout:
        raise MiniStreamError(f"git diff of {path} failed: {run.stderr.strip() or 'no difference'}")
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n{run.stdout[run.stdout.index(chr(10) + '@@') + 1:]}"


# --- the whole port -------------------------------------------------------------------------

@dataclass
class PortResult:
    patchdir: Path
    model: ModelPort
    forms: tuple[str, str]


def sha256s(files: dict[str, str]) -> dict[str, str]:
    return {rel: hashlib.sha256(text.encode()).hexdigest() for rel, text in sorted(files.items())}


def port(a: str, b: str, patches: Path = PATCHES) -> PortResult:
    """Write patches/v<b>/ from the patch set of `a`; register b in versions.json."""
    src = patch_dir(a, patches)
    old = release_files(a, [LLAMA])
    new = release_files(b)
    ours = apply_model_diff(old[LLAMA], src / "model.diff")
    model = merge_model(old[LLAMA], ours, new[LLAMA], a, b, load_resolutions(patches))

    registry = add_architecture(new[REGISTRY])
    config, configs = add_config(new[CONFIG], new[CONFIGS])

    out = patches / f"v{b}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "model.diff").write_text(model_diff(new[LLAMA], model.text))
    (out / "registry.diff").write_text(
        file_diff(REGISTRY, new[REGISTRY], registry) + file_diff(CONFIG, new[CONFIG], config)
        + file_diff(CONFIGS, new[CONFIGS], configs))
    if (src / "files").is_dir():
        shutil.copytree(src / "files", out / "files", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    revision = manifest(src)["patch_version"].rsplit("-", 1)[1]
    (out / "manifest.json").write_text(json.dumps({
        "patch_set": out.name,
        "patch_version": f"{b}-{revision}",
        "ported_from": a,
        "pristine_sha256": {b: sha256s(new)},
    }, indent=2) + "\n")
    versions = supported_versions(patches)
    versions[b] = out.name
    (patches / "versions.json").write_text(json.dumps(dict(sorted(versions.items(), key=lambda kv: _key(kv[0]))),
                                                      indent=2) + "\n")
    return PortResult(out, model, config_forms(new[CONFIG], new[CONFIGS]))


def _key(version: str) -> Version:
    return Version(version)


def regenerate(patches: Path = PATCHES) -> list[tuple[str, str, PortResult]]:
    """Port every patch set that records where it was ported from, again, nearest first: after a
    change to a hand-made patch set (v0.32.0), every set derived from it follows."""
    sources = {v: manifest(patches / d).get("ported_from") for v, d in supported_versions(patches).items()}
    done = [v for v, src in sources.items() if src is None]
    results = []
    while len(done) < len(sources):
        ready = [v for v, src in sources.items() if v not in done and src in done]
        if not ready:
            raise MiniStreamError(f"patch sets {sorted(set(sources) - set(done))} are ported from sets that "
                                  f"are not in {patches / 'versions.json'}")
        for v in sorted(ready, key=Version):
            result = port(sources[v], v, patches)
            results.append((sources[v], v, result))
            if result.model.conflicts:
                return results  # the sets ported from this one would inherit its conflict markers
            done.append(v)
    return results


# --- command line ---------------------------------------------------------------------------

def register(sub) -> None:
    p = sub.add_parser("port", help="carry the patch set of vLLM FROM onto release TO (three-way merge)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("source", metavar="FROM", nargs="?", help="a supported vLLM release, e.g. 0.32.0")
    p.add_argument("target", metavar="TO", nargs="?", help="the release to write patches/vTO/ for, e.g. 0.33.0")
    p.add_argument("--all", action="store_true", help="port every patch set again from the one it was "
                                                       "ported from (manifest.json ported_from)")
    p.set_defaults(func=_cmd)


def _report(a: str, b: str, result: PortResult) -> int:
    registry, exports = result.forms
    m = result.model
    print(f"{a} -> {b}: wrote {result.patchdir} (config registry: {registry}, configs package: {exports})")
    for line in m.renamed:
        print(f"  renamed in ministream.py@{b}: {line}")
    for kind, items in (("kept our deletion (review)", m.dropped), ("redid our mechanical change (review)", m.resolved),
                        ("resolved as patches/resolutions.json records", m.recorded)):
        for c in items:
            print(f"  {kind}, line {c.line} of ministream.py@{b}:\n" + "".join(f"    {x}" for x in c.hunk.splitlines(True)))
    if m.conflicts:
        print(f"{len(m.conflicts)} conflict(s) in ministream.py@{b}, left in {result.patchdir / 'model.diff'}:")
        for c in m.conflicts:
            print(f"--- conflict at line {c.line} of ministream.py@{b}:\n{c.hunk}", end="")
        print(f"resolve each: add {{\"ours\", \"theirs\", \"resolution\"}} (the two sides, and what replaces the "
              f"block) to patches/resolutions.json and port again; then `make matrix VERSIONS={b}`")
        return 1
    return 0


def _cmd(args) -> int:
    if args.all:
        results = regenerate()
        status = max([_report(a, b, r) for a, b, r in results], default=0)
        print(f"ported {len(results)} patch set(s); check them with `make matrix`")
        return status
    if not (args.source and args.target):
        raise MiniStreamError("name FROM and TO (make port FROM=0.32.0 TO=0.33.0), or --all")
    status = _report(args.source, args.target, port(args.source, args.target))
    if status == 0:
        print(f"no conflicts; check it with `make matrix VERSIONS={args.target}`")
    return status
