"""matrix: every supported vLLM release x what its patch set must do, checked statically.

    ministream matrix                          all versions of patches/versions.json
    ministream matrix --versions 0.6.3,0.20.0  those (any release of a supported line)

For each version: the release's pristine files (single files of its release wheel, cached), then
  pristine      the files the patch touches are the release's (sha256 in the manifest)
  applies       apply_patch.sh applies the patch set cleanly
  compiles      every file the patch adds or changes compiles
  architecture  registry.py maps MiniStreamForCausalLM to ministream.py, which defines it
  config        model_type "ministream" -> MiniStreamConfig in that release's config registry form
  interface     MiniStreamForCausalLM has LlamaForCausalLM's methods and signatures (constructor,
                forward, embedding method), and ministream.py names no Llama class it lacks
  upstream      on a source tree of the release's files (the few of its sdist that upstream/ reads or
                changes, streamed once and cached): they are the release's, apply_patch.sh applies the
                whole set with upstream/, and the generation test compiles and its relative imports
                name modules and names the release has; n/a, with the reason, for a release whose set
                records why it has no upstream/ (0.15.1: no sdist on PyPI)
  names, attributes, weights   model_checks.py: names resolve in the release, config attributes, weight loading
  internals     internals.py: every vLLM internal our tools reach by name (fork/internals.py) resolves in the
                release: bench-step's model runner methods, verify's and the engine settings' arguments and
                variables, doctor's platforms, the CPU part's edits, every `vllm` import of the package
The table is printed and written to build/matrix.json and build/matrix.md (or --out).
"""

import ast
import py_compile
import re
import tempfile
import time
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError
from ..atomic import write_json, write_text
from ..fork import patchset, registry
from ..fork.patch import LLAMA, MINISTREAM
from ..fork.patchset import ApplyError, added_files, check_pristine, patch_set_dir, pinned, supported_versions
from ..fork.port import touched
from ..fork.pysource import import_target, top_level
from ..fork.release import release_files, sdist_names
from ..fork.upstream import upstream_files
from ..paths import BUILD, PATCH_SETS
from ..spec import ARCH, CONFIG_CLASS, MODEL_TYPE
from .internals_check import internals
from .model_checks import CHECKS as STATIC_CHECKS, Failed, NotApplicable

CHECKS = [
    *("pristine", "applies", "compiles", "architecture", "config", "interface"),
    *STATIC_CHECKS,
    *("internals", "upstream"),
]


# --- the checks, each on the pristine tree and the patched tree ------------------------------


def _pristine(tree: Path, patched: Path, version: str, folder: Path) -> str:
    try:
        check_pristine(tree, version, folder, f"the vllm {version} release wheel")
    except MiniStreamError as e:
        raise Failed(str(e)) from None
    return f"patch set {folder.name}"


def _applies(tree: Path, patched: Path, version: str, folder: Path) -> str:
    try:
        patchset.apply(patched, folder)
    except ApplyError as e:
        raise Failed(e.at_fault[0]) from None
    return ""


def _compiles(tree: Path, patched: Path, version: str, folder: Path) -> str:
    files = [MINISTREAM, *registry.files(version), *added_files(folder)]
    with tempfile.TemporaryDirectory() as tmp:
        for rel in files:
            try:
                py_compile.compile(str(patched / rel), cfile=f"{tmp}/x.pyc", doraise=True)
            except (py_compile.PyCompileError, FileNotFoundError) as e:
                raise Failed(f"{rel}: {e}") from None
    return f"{len(files)} files"


def _parse(patched: Path, rel: str) -> ast.Module:
    return ast.parse((patched / rel).read_text())


def _registries(patched: Path) -> registry.Registries:
    return registry.read_package(patched / "vllm")


def _architecture(tree: Path, patched: Path, version: str, folder: Path) -> str:
    if _registries(patched).architectures.get(ARCH) != (MODEL_TYPE, ARCH):
        raise Failed(f"{registry.REGISTRY_PY}: _TEXT_GENERATION_MODELS has no {ARCH!r}: ({MODEL_TYPE!r}, {ARCH!r})")
    if not any(isinstance(n, ast.ClassDef) and n.name == ARCH for n in _parse(patched, MINISTREAM).body):
        raise Failed(f"{MINISTREAM} defines no class {ARCH}")
    return ""


def _config(tree: Path, patched: Path, version: str, folder: Path) -> str:
    found = _registries(patched)
    config_form, exports = found.forms
    if found.config_types.get(MODEL_TYPE) != CONFIG_CLASS:
        raise Failed(
            f"{registry.CONFIG_PY}: _CONFIG_REGISTRY ({config_form}) does not map {MODEL_TYPE!r} to {CONFIG_CLASS}"
        )
    if found.config_exports.get(CONFIG_CLASS) != registry.CONFIG_MODULE:
        raise Failed(
            f"{registry.CONFIGS_INIT_PY} ({exports}) does not export {CONFIG_CLASS} from {registry.CONFIG_MODULE}"
        )
    return f"{config_form} registry, {exports}"


def _methods(module: ast.Module, cls: str) -> tuple[list[str], dict[str, str]]:
    """(base classes, method name -> signature) of class `cls`, with Llama class names read as
    MiniStream ones, so that llama.py's and ministream.py's compare equal."""
    node = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        raise Failed(f"no class {cls}")

    def norm(text: str) -> str:
        for name in ("MLP", "Attention", "DecoderLayer", "Model", "ForCausalLM"):
            text = text.replace(f"Llama{name}", f"MiniStream{name}")
        return text

    methods = {
        f.name: norm(ast.unparse(f.args)) for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    return [norm(ast.unparse(b)) for b in node.bases], methods


def _interface(tree: Path, patched: Path, version: str, folder: Path) -> str:
    llama, model = _parse(patched, LLAMA), _parse(patched, MINISTREAM)
    found = {}
    for theirs_name, ours_name in (("LlamaForCausalLM", ARCH), ("LlamaModel", "MiniStreamModel")):
        theirs_bases, theirs = _methods(llama, theirs_name)
        ours_bases, ours = _methods(model, ours_name)
        if ours_bases != theirs_bases:
            raise Failed(f"{ours_name} bases {ours_bases} != {theirs_name}'s {theirs_bases}")
        if set(ours) != set(theirs):
            raise Failed(
                f"{ours_name} methods differ from {theirs_name}'s: only ours {sorted(set(ours) - set(theirs))}, "
                f"only theirs {sorted(set(theirs) - set(ours))}"
            )
        differ = [m for m in ours if ours[m] != theirs[m]]
        if differ:
            raise Failed(
                f"{ours_name} signatures differ: {', '.join(f'{m}({ours[m]}) vs ({theirs[m]})' for m in differ)}"
            )
        found[ours_name] = ours
    for needed in ("__init__", "forward"):
        if needed not in found[ARCH]:
            raise Failed(f"{ARCH} has no {needed}")
    # the embedding method: on the model class for the engine (0.7+), on the inner model before
    embed = [
        f"{cls}.{m}"
        for cls in (ARCH, "MiniStreamModel")
        for m in ("embed_input_ids", "get_input_embeddings")
        if m in found[cls]
    ]
    if not embed:
        raise Failed(
            f"neither {ARCH} nor MiniStreamModel has an embedding method (embed_input_ids / get_input_embeddings)"
        )
    defined = {n.name for n in ast.walk(model) if isinstance(n, ast.ClassDef)}
    defined |= {
        a.asname or a.name for n in ast.walk(model) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names
    }
    stray = sorted({n.id for n in ast.walk(model) if isinstance(n, ast.Name) and n.id.startswith("Llama")} - defined)
    if stray:
        raise Failed(f"{MINISTREAM} names {', '.join(stray)}, which it neither defines nor imports")
    return f"{len(found[ARCH])} methods, forward({found[ARCH]['forward']}), embedding: {embed[0]}"


def _upstream(tree: Path, patched: Path, version: str, folder: Path) -> str:
    reason = patchset.manifest(folder).get("upstream")
    if reason:
        raise NotApplicable(reason)
    if not (folder / patchset.UPSTREAM).is_dir():
        raise Failed(f'{folder} has no upstream/ and its manifest.json records no reason ("upstream"): run `make port`')
    try:
        files = {rel: text for rel, text in upstream_files(version, folder.parent).items() if text is not None}
    except MiniStreamError as e:  # a cached file that is not the release's; a download that failed
        raise Failed(str(e)) from None
    added = set(added_files(folder, upstream=True)) - set(added_files(folder))
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp)
        for rel, text in [
            *((p.relative_to(tree).as_posix(), p.read_text()) for p in tree.rglob("*.py")),
            *files.items(),
        ]:
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            (source / rel).write_text(text)
        (source / "tests").mkdir(exist_ok=True)  # a source tree: apply_patch.sh applies upstream/ too
        try:
            check_pristine(source, version, folder, f"the vllm {version} sdist")
            patchset.apply(source, folder)
        except ApplyError as e:
            raise Failed(e.at_fault[0]) from None
        except MiniStreamError as e:
            raise Failed(str(e)) from None
        for rel in sorted(added):
            _imports_resolve(source, rel, sdist_names(version))
    changed = sorted(set(files) & set(_diff_paths(folder)))
    return ", ".join(changed + sorted(added))


def _diff_paths(folder: Path) -> list[str]:
    """The tree paths upstream/*.diff change."""
    return [
        m
        for d in sorted((folder / patchset.UPSTREAM).glob("*.diff"))
        for m in re.findall(r"^diff --git a/(\S+) b/", d.read_text(), re.M)
    ]


def _imports_resolve(source: Path, rel: str, names: set[str]) -> None:
    """`rel` compiles, and each of its relative imports names a module of the release that defines
    the names imported (read where the module is in `source`; else it must be in the sdist)."""
    try:
        module = ast.parse((source / rel).read_text(), filename=rel)
        compile(module, rel, "exec")
    except SyntaxError as e:
        raise Failed(f"{rel}: {e}") from None
    package = Path(rel).parent.as_posix()
    for node in ast.walk(module):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        target = import_target(package, node.level, node.module or "")
        target = next(
            (t for t in (f"{target}.py", f"{target}/__init__.py") if (source / t).is_file() or t in names),
            f"{target}.py",
        )
        if not (source / target).is_file():
            if target not in names:
                raise Failed(f"{rel}: line {node.lineno} imports from {target}, which the vllm sdist lacks")
            continue
        defined = top_level(ast.parse((source / target).read_text()))[0]
        lacking = [a.name for a in node.names if a.name not in defined]
        if lacking:
            raise Failed(
                f"{rel}: line {node.lineno} imports {', '.join(lacking)} from {target}, which does not "
                f"define {'it' if len(lacking) == 1 else 'them'}"
            )


CHECK_FUNCS = {
    "pristine": _pristine,
    "applies": _applies,
    "compiles": _compiles,
    "architecture": _architecture,
    "config": _config,
    "interface": _interface,
    "upstream": _upstream,
    "internals": internals,
    **STATIC_CHECKS,
}


def check_version(version: str, patch_sets: Path = PATCH_SETS) -> dict:
    """{check: {"ok": bool, "detail": str}} for one version; a failed check skips the rest."""
    start = time.monotonic()
    try:
        folder = patch_set_dir(version, patch_sets)
        files = release_files(version, touched(version), pinned(folder, version))
    except MiniStreamError as e:
        return {
            "patch_set": None,
            "checks": {c: {"ok": False, "detail": str(e) if c == "pristine" else "skipped"} for c in CHECKS},
            "seconds": round(time.monotonic() - start, 1),
        }
    with tempfile.TemporaryDirectory() as tmp:
        tree, patched = Path(tmp, "pristine"), Path(tmp, "patched")
        for root in (tree, patched):
            for rel, text in files.items():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_text(text)
        results = _run_checks(tree, patched, version, folder)
    return {"patch_set": folder.name, "checks": results, "seconds": round(time.monotonic() - start, 1)}


def _run_checks(tree: Path, patched: Path, version: str, folder: Path) -> dict:
    results, failed = {}, False
    for check in CHECKS:
        if failed:
            results[check] = {"ok": False, "detail": "skipped"}
            continue
        try:
            results[check] = {"ok": True, "detail": CHECK_FUNCS[check](tree, patched, version, folder)}
        except NotApplicable as e:
            results[check] = {"ok": True, "applies": False, "detail": f"n/a: {e}"}
        except Failed as e:
            results[check] = {"ok": False, "detail": str(e)}
            failed = True
    return results


def run_matrix(versions: list[str], patch_sets: Path = PATCH_SETS, out: Path | None = BUILD) -> dict:
    """Check each version; write out/matrix.json and out/matrix.md (out=None: write nothing)."""
    results = {}
    for v in versions:
        results[v] = check_version(v, patch_sets)
        print(_row(v, results[v]), flush=True)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "matrix.json", results)
        write_text(out / "matrix.md", matrix_table(results))
    return results


def _mark(result: dict, check: str, ok: str, failed: str) -> str:
    r = result["checks"][check]
    return "n/a" if r.get("applies") is False else ok if r["ok"] else failed


def _row(version: str, result: dict) -> str:
    marks = " ".join(_mark(result, c, "ok", "FAIL").ljust(len(c)) for c in CHECKS)
    return f"{version:<12} {str(result['patch_set']):<12} {marks}  {result['seconds']}s"


def matrix_table(results: dict) -> str:
    """The results as a Markdown table, failures explained below it."""
    lines = ["| vLLM | patch set | " + " | ".join(CHECKS) + " | config form |", "|---" * (len(CHECKS) + 3) + "|"]
    for v, r in results.items():
        marks = " | ".join(_mark(r, c, "✓", "✗") for c in CHECKS)
        form = r["checks"]["config"]["detail"] if r["checks"]["config"]["ok"] else ""
        lines.append(f"| {v} | {r['patch_set']} | {marks} | {form} |")
    failures = [
        f"- {v} {c}: {r['checks'][c]['detail']}"
        for v, r in results.items()
        for c in CHECKS
        if (not r["checks"][c]["ok"] and r["checks"][c]["detail"] != "skipped")
        or r["checks"][c].get("applies") is False
    ]
    return "\n".join(lines + ([""] + failures if failures else [])) + "\n"


def all_passed(results: dict) -> bool:
    """Every check of every version passed; a matrix of no version, or a version of no check, does not pass."""
    return bool(results) and all(r["checks"] and all(c["ok"] for c in r["checks"].values()) for r in results.values())


def check_versions(versions: str | None, out: Path) -> int:
    """`ministream matrix [--versions a,b]`: the exit status."""
    chosen = versions.split(",") if versions else sorted(supported_versions(), key=Version)
    print(f"{'vLLM':<12} {'patch set':<12} {' '.join(CHECKS)}")
    results = run_matrix(chosen, out=out)
    print(f"wrote {out / 'matrix.json'} and {out / 'matrix.md'}")
    if not all_passed(results):
        print(f"error: some checks failed; see {out / 'matrix.md'}", flush=True)
        return 1
    return 0
