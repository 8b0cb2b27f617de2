"""Static checks of a patched tree against its release's own files, for the lines no test can run.

Registered in matrix.py, each on the pristine and the patched tree:
  names       every name the patched files use resolves in that release: imports (vllm modules
              read from the release wheel, the patch set's own files from the tree), attributes of
              imported vllm modules, and the free names of every scope (symtable); for a file the
              patch only changes, the imports it adds
  attributes  every attribute ministream.py reads on the HF config, MiniStreamConfig has under that
              name in this release: set by the class itself, or read by the release's own llama.py
              (whose LlamaConfig, that of the release's transformers, our class inherits)
  weights     the weight-loading table takes every tensor a converted folder holds (spec.py's
              tables, tied and untied head) to a parameter the model builds, fused shards in the
              format's row order (q, k, v; gate, up); the head is its own loaded parameter when
              tie_word_embeddings is false and the embedding when true
Third-party imports (torch, transformers) are not resolved: the release's files do not hold them.
"""

import ast
import builtins
import difflib
import symtable
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

from ..fork import registry, release
from ..fork.patch import LLAMA, MINISTREAM
from ..fork.patchset import added_files
from ..fork.pysource import class_attributes, import_target, top_level
from ..spec import (
    ARCH,
    CONFIG_CLASS,
    EMBEDDING,
    GLOBAL_TABLE,
    HEAD,
    LAYER_TABLE,
    QKV,
    W12,
    TrainConfig,
    hf_config,
    hf_names,
)

CONFIG_CLASS_PY = registry.CONFIG_MODULE.replace(".", "/") + ".py"
# the converted folder's names of the embedding and the head (spec.py states every name once)
HF_EMBEDDING, HF_HEAD = (next(row[1][0] for row in GLOBAL_TABLE if row[0] == name) for name in (EMBEDDING, HEAD))

# Expressions that are the HF config in vLLM's model files: `config`, `self.config`, `...hf_config`.
CONFIG_NAMES = {"config", "hf_config"}

# config.json keys that some transformers' LlamaConfig consumes and keeps under another name (5.x: rope_theta
# into rope_parameters); every other key of a converted config.json is an attribute of any PretrainedConfig.
RENAMED_BY_TRANSFORMERS = {"rope_theta", "rope_scaling"}

# Fused parameters: each training tensor split into HF tensors in row order (spec.py), and the
# shard ids vLLM's fused layer takes for those rows, in the same order.
FUSED: dict[str, tuple[str, list[str] | list[int]]] = {
    QKV: (".qkv_proj", ["q", "k", "v"]),  # QKVParallelLinear
    W12: (".gate_up_proj", [0, 1]),
}  # MergedColumnParallelLinear; SiluAndMul gates with shard 0

# vLLM layers that own checkpoint tensors, and which (MiniStream has no biases).
LEAF_PARAMS = {
    name: {"weight"}
    for name in (
        "VocabParallelEmbedding",
        "ParallelLMHead",
        "RMSNorm",
        "QKVParallelLinear",
        "MergedColumnParallelLinear",
        "RowParallelLinear",
    )
}

# Conditions of the model's constructors with a known value on one rank (no pipeline parallelism).
ONE_RANK = {"get_pp_group().is_first_rank": True, "get_pp_group().is_last_rank": True}


class Failed(Exception):
    """One check failed; the message says how."""


class NotApplicable(Exception):
    """The check does not apply to this release; the message says why (recorded in its patch set)."""


def _fail(message: str) -> NoReturn:
    raise Failed(message)


def _parse(path: Path, rel: str) -> ast.Module:
    return ast.parse(path.read_text(), filename=rel)


# --- names ------------------------------------------------------------------------------------


class Release:
    """The release's vllm files as the patched tree sees them: the tree's own (the files the patch
    touches and adds), else single members of the release wheel."""

    def __init__(self, version: str, patched: Path):
        self.version, self.patched = version, patched
        self.texts: dict[str, str] = {}

    @cached_property
    def names(self) -> set[str]:
        return release.wheel_names(self.version)

    def module(self, path: str) -> str | None:
        """The file of module `path` (vllm/a/b): b.py, b/__init__.py, or a compiled b.*.so; None if absent."""
        for candidate in (f"{path}.py", f"{path}/__init__.py"):
            if (self.patched / candidate).is_file() or candidate in self.names:
                return candidate
        prefix = f"{path}."
        return next(
            (n for n in self.names if n.startswith(prefix) and n.endswith(".so") and "/" not in n[len(prefix) :]), None
        )

    def text(self, rel: str) -> str:
        if rel not in self.texts:
            local = self.patched / rel
            self.texts[rel] = local.read_text() if local.is_file() else release.release_files(self.version, [rel])[rel]
        return self.texts[rel]

    def defines(self, rel: str, name: str, seen: frozenset = frozenset()) -> bool:
        """Module `rel` has top-level `name` (or a submodule of that name, or names it for its __getattr__)."""
        if rel.endswith(".so") or (rel.endswith("/__init__.py") and self.module(f"{rel[:-12]}/{name}")):
            return True
        module = ast.parse(self.text(rel))
        names, stars = top_level(module)
        if name in names:
            return True
        if "__getattr__" in names and any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(module)):
            return True
        for star in stars:  # from x import *: x's names are this module's
            path = _import_path(rel, star.level, star.module)
            target = self.module(path) if path is not None else None
            if target and target not in seen and self.defines(target, name, seen | {rel}):
                return True
        return False


def _import_path(rel: str, level: int, module: str | None) -> str | None:
    """The tree path (no suffix) an import in file `rel` names; None for a third-party module."""
    if level:
        return import_target(Path(rel).parent.as_posix(), level, module or "")
    return module.replace(".", "/") if module and module.split(".")[0] == "vllm" else None


def _where(module: ast.Module) -> dict[int, str]:
    """id(node) -> the qualified name of the function or class around it."""
    where = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = (
                f"{scope}.{child.name}".lstrip(".")
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                else scope
            )
            where[id(child)] = inner or "module level"
            visit(child, inner)

    visit(module, "")
    return where


MODULE_DUNDERS = {"__file__", "__path__", "__spec__", "__loader__", "__package__", "__builtins__", "__annotations__"}


def _free_names(text: str, rel: str) -> set[str]:
    """Names that some scope of the file reads as globals and neither the module nor builtins define."""
    top = symtable.symtable(text, rel, "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    read, tables = set(), [top]
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        read |= {s.get_name() for s in table.get_symbols() if s.is_referenced() and (table is top or s.is_global())}
    return {n for n in read - defined - MODULE_DUNDERS if not hasattr(builtins, n)}


def _check_file(rel: str, module: ast.Module, found: Release, imports: list, where: dict, version: str) -> int:
    """Fail on the first name of `rel` that does not resolve; the number of vllm names resolved."""

    def at(node: ast.stmt | ast.expr) -> str:
        return f"{rel} line {node.lineno} ({where.get(id(node), 'module level')})"

    fix = f"use what vLLM {version}'s own files provide (see its llama.py), or port the patch set again"
    bound, count = {}, 0  # local name -> the module file it is bound to
    for node in imports:
        aliases = node.names
        if isinstance(node, ast.Import):
            for a in aliases:
                path = _import_path(rel, 0, a.name)
                if path is None:
                    continue
                if not found.module(path):
                    _fail(f"{at(node)}: import {a.name}: vLLM {version} has no module {a.name}; {fix}")
                head = a.asname or a.name.split(".")[0]
                bound[head] = found.module(path if a.asname else path.split("/")[0])
                count += 1
            continue
        path = _import_path(rel, node.level, node.module)
        if path is None:
            continue
        target = found.module(path)
        if target is None:
            _fail(
                f"{at(node)}: from {'.' * node.level}{node.module or ''} import ...: vLLM {version} has no "
                f"module {path.replace('/', '.')}; {fix}"
            )
        for a in aliases:
            if a.name == "*":
                continue
            if not found.defines(target, a.name):
                _fail(f"{at(node)}: imports {a.name} from {target}, which vLLM {version} does not define; {fix}")
            if sub := found.module(f"{path}/{a.name}"):
                bound[a.asname or a.name] = sub
            count += 1
    # attributes of the vllm modules bound above: envs.VLLM_X, vllm.envs.VLLM_X
    for node in ast.walk(module):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            owner = _module_of(node.value, bound, found)
            if owner and not found.defines(owner, node.attr):
                _fail(f"{at(node)}: {ast.unparse(node)}: vLLM {version}'s {owner} has no {node.attr}; {fix}")
    return count


def _module_of(node: ast.AST, bound: dict, found: Release) -> str | None:
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _module_of(node.value, bound, found)
        if owner and owner.endswith("/__init__.py"):
            return found.module(f"{owner[:-12]}/{node.attr}")
    return None


def names(tree: Path, patched: Path, version: str, folder: Path) -> str:
    found = Release(version, patched)
    changed = [rel for rel in registry.files(version) if (tree / rel).read_text() != (patched / rel).read_text()]
    count = 0
    for rel in [MINISTREAM, *added_files(folder), *changed]:
        text = (patched / rel).read_text()
        module = ast.parse(text, filename=rel)
        where = _where(module)
        undefined = _free_names(text, rel)
        if undefined:
            node = next(n for n in ast.walk(module) if isinstance(n, ast.Name) and n.id in undefined)
            _fail(
                f"{rel} line {node.lineno} ({where.get(id(node), 'module level')}): name {node.id!r} is "
                f"not defined in vLLM {version}'s patched file: import or define it"
            )
        imports = [n for n in ast.walk(module) if isinstance(n, (ast.Import, ast.ImportFrom))]
        if rel in changed:  # the release's own imports resolve: check the ones the patch adds
            theirs = {
                ast.unparse(n)
                for n in ast.walk(ast.parse((tree / rel).read_text()))
                if isinstance(n, (ast.Import, ast.ImportFrom))
            }
            imports = [n for n in imports if ast.unparse(n) not in theirs]
        count += _check_file(rel, module, found, imports, where, version)
    return f"{count} vllm imports resolve"


# --- config attributes -------------------------------------------------------------------------


def _is_config(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in CONFIG_NAMES) or (
        isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES
    )


def config_reads(module: ast.Module) -> dict[str, int]:
    """Attribute name -> first line where the file reads it on the HF config (config.x, getattr/hasattr)."""
    reads: dict[str, int] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _is_config(node.value):
            name = node.attr
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and _is_config(node.args[0])
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
        else:
            continue
        reads[name] = min(reads.get(name, node.lineno), node.lineno)
    return reads


def _class_sets(module: ast.Module, cls: str) -> tuple[set[str], list[str]]:
    """(attributes class `cls` sets: class body names and self.x anywhere, its bases as written)."""
    node = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        _fail(f"{CONFIG_CLASS_PY} defines no class {cls}")
    return class_attributes(node), [ast.unparse(b) for b in node.bases]


def attributes(tree: Path, patched: Path, version: str, folder: Path) -> str:
    config_module = _parse(patched / CONFIG_CLASS_PY, CONFIG_CLASS_PY)
    sets, bases = _class_sets(config_module, CONFIG_CLASS)
    imported = {
        a.asname or a.name: n.module for n in config_module.body if isinstance(n, ast.ImportFrom) for a in n.names
    }
    llama_reads = config_reads(_parse(patched / LLAMA, LLAMA))
    # LlamaConfig is transformers' class of the release's era: the names the release's llama.py reads
    inherited = (
        set(llama_reads) if any(imported.get(b) == "transformers" and b == "LlamaConfig" for b in bases) else set()
    )
    written = set(hf_config(TrainConfig(2, 2, 1, 1, 2, 2, 1e-5, 1e4, 0, 1), "float32")) - RENAMED_BY_TRANSFORMERS
    reads = config_reads(_parse(patched / MINISTREAM, MINISTREAM))
    for name, line in sorted(reads.items(), key=lambda r: r[1]):
        if name not in sets | inherited | written:
            close = difflib.get_close_matches(name, sorted(llama_reads), n=3, cutoff=0.5)
            _fail(
                f"{MINISTREAM} line {line} reads config.{name}, which {CONFIG_CLASS} ({CONFIG_CLASS_PY}) does not "
                f"set, a converted config.json does not hold, and vLLM {version}'s llama.py never reads (its "
                f"LlamaConfig may not have it"
                f"{'; llama.py reads ' + ', '.join(close) if close else ''}): read it under the release's name, "
                f"or set it in {CONFIG_CLASS}"
            )
    return f"{len(reads)} config attributes read, all {CONFIG_CLASS}'s"


# --- weights ------------------------------------------------------------------------------------


def stacked_mapping(module: ast.Module, where: str) -> dict[str, tuple[str, object]]:
    """The loader's fused-shard table, {".q_proj": (".qkv_proj", "q"), ...}, in either of vLLM's forms:
    a stacked_params_mapping list of (param, shard, id), or WeightsMapper(orig_to_new_stacked={shard: (param, id)})."""
    for node in ast.walk(module):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "stacked_params_mapping" for t in node.targets
        ):
            return {shard: (param, sid) for param, shard, sid in _literal(node.value, where)}
        if isinstance(node, ast.keyword) and node.arg == "orig_to_new_stacked":
            return {shard: tuple(v) for shard, v in _literal(node.value, where).items()}
    _fail(f"{where} has no weight-loading table (stacked_params_mapping, or a WeightsMapper's orig_to_new_stacked)")


def _literal(node: ast.expr, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        _fail(
            f"{where} line {node.lineno}: the weight-loading table is not a literal, which this check reads: "
            f"{ast.unparse(node)[:80]}"
        )


def expected_mapping() -> dict[str, tuple[str, object]]:
    """The fused-shard table the format implies: each split tensor's HF names, in row order, to the fused
    parameter's shard ids in the same order."""
    mapping = {}
    for template, (param, ids) in FUSED.items():
        for name, sid in zip(hf_names(template, 0), ids, strict=True):
            mapping["." + name.rsplit(".", 2)[-2]] = (param, sid)
    return mapping


def folder_tensors(tied: bool) -> list[str]:
    """The tensor names of a converted folder (layer 0 standing for every layer)."""
    return [h.format(i=0) for raw, hf, _, _ in LAYER_TABLE + GLOBAL_TABLE for h in hf if not (tied and raw == HEAD)]


class Model:
    """What MiniStreamForCausalLM's constructors build, read from the source for one tie_word_embeddings."""

    def __init__(self, module: ast.Module, tied: bool):
        self.classes = {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}
        self.tied = tied

    def truth(self, test: ast.AST, name: str = "") -> bool | None:
        """A condition of the constructors (on one rank) or of load_weights (loading tensor `name`), for
        this tie_word_embeddings; None if unknown."""
        if (
            isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Constant)
            and isinstance(test.left.value, str)
            and isinstance(test.ops[0], ast.In)
            and len(test.ops) == 1
            and ast.unparse(test.comparators[0]) == "name"
        ):
            return test.left.value in name
        if isinstance(test, ast.Attribute) and test.attr == "tie_word_embeddings" and _is_config(test.value):
            return self.tied
        if isinstance(test, ast.Constant):
            return bool(test.value)
        if ast.unparse(test) in ONE_RANK:
            return ONE_RANK[ast.unparse(test)]
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            value = self.truth(test.operand, name)
            return None if value is None else not value
        if isinstance(test, ast.BoolOp):
            values = [self.truth(v, name) for v in test.values]
            decisive = isinstance(test.op, ast.Or)  # True decides an `or`, False an `and`
            return decisive if decisive in values else (not decisive if None not in values else None)
        return None

    def run(self, body: list, out: dict) -> None:
        """self.x = ... assignments of a method body, following the branches its conditions take."""
        for node in body:
            if isinstance(node, ast.If):
                value = self.truth(node.test)
                if value is not False:
                    self.run(node.body, out)
                if value is not True:
                    self.run(node.orelse, out)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for i, t in enumerate(target.elts if isinstance(target, ast.Tuple) else [target]):
                        path = ast.unparse(t)
                        if isinstance(t, ast.Attribute) and path.startswith("self."):  # self.x, self.x.weight
                            out[path[5:]] = node.value if not isinstance(target, ast.Tuple) else ("item", node.value, i)
            elif isinstance(node, (ast.With, ast.Try)):
                self.run(node.body, out)

    def attrs(self, cls: str) -> tuple[dict, dict]:
        """(attribute -> value, method name -> node) of class `cls`; __init__ last, so its assignments win."""
        node = self.classes[cls]
        methods = {m.name: m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        out: dict[str, Any] = {}
        for name in sorted(methods, key=lambda m: m == "__init__"):
            self.run(methods[name].body, out)
        return out, methods

    def kind(self, value, cls: str, method: ast.FunctionDef | None = None) -> tuple:
        """What a constructor's value is: ("class", C), ("leaf", vLLM layer), ("list", kind), ("alias", path)."""
        if isinstance(value, tuple):  # one item of `self.a, self.b, self.layers = make_layers(...)`
            return self.kind(value[1], cls, method)
        if isinstance(value, ast.Call):
            func = value.func
            if isinstance(func, ast.Attribute) and func.attr == "tie_weights":
                return self.kind(value.args[0], cls, method)
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
                helper = self.attrs(cls)[1].get(func.attr)
                returned = [n.value for n in ast.walk(helper) if isinstance(n, ast.Return)] if helper else []
                return self.kind(returned[0], cls, helper) if returned else ("leaf", func.attr)
            name = ast.unparse(func)
            if name in ("make_layers", "nn.ModuleList"):
                if name == "make_layers":  # make_layers(n, lambda prefix: Layer(...), ...)
                    maker = value.args[1]
                    assert isinstance(maker, ast.Lambda), ast.unparse(value)
                    item = maker.body
                else:  # nn.ModuleList(Layer(...) for i in range(n)), or a list comprehension
                    layers = value.args[0]
                    assert isinstance(layers, (ast.GeneratorExp, ast.ListComp)), ast.unparse(value)
                    item = layers.elt
                return ("list", self.kind(item, cls, method))
            if name in self.classes:
                return ("class", name)
            if method is not None:  # a parameter whose default is one of our classes (layer_type=...)
                args = method.args.args + method.args.kwonlyargs
                defaults = (
                    [None] * (len(method.args.args) - len(method.args.defaults))
                    + method.args.defaults
                    + method.args.kw_defaults
                )
                default = dict(zip((a.arg for a in args), defaults)).get(name)
                if isinstance(default, ast.Name) and default.id in self.classes:
                    return ("class", default.id)
            return ("leaf", name)
        path = ast.unparse(value)
        if path.startswith("self."):
            return ("alias", path[5:])
        return ("leaf", path)

    def resolve(self, path: str, cls: str = ARCH) -> tuple[str, tuple] | str:
        """(parameter owner's attribute path, its leaf kind) for a parameter name; else why it has none."""
        kind: tuple[Any, ...] = ("class", cls)
        walked: list[str] = []
        parts = path.split(".")
        init = None
        while parts:
            part = parts.pop(0)
            if kind[0] == "list":
                if not part.isdigit():
                    return f"{'.'.join(walked)} is a layer list, indexed by number, not {part!r}"
                kind = kind[1]
            elif kind[0] == "class":
                attrs, methods = self.attrs(kind[1])
                rest = ".".join([part, *parts])
                if rest in attrs and "." in rest:  # self.lm_head.weight = self.model.embed_tokens.weight
                    target = self.resolve(self.kind(attrs[rest], kind[1])[1], kind[1])
                    return (
                        target
                        if isinstance(target, str)
                        else (f"{rest} = self.{ast.unparse(attrs[rest])[5:]}", target[1])
                    )
                if part not in attrs:
                    return f"{kind[1]} sets no self.{part}"
                owner, init = kind[1], methods.get("__init__")
                kind = self.kind(attrs[part], owner, init)
                if kind[0] == "alias":  # self.lm_head = self.model.embed_tokens: the same parameters
                    target = self.resolve(".".join([kind[1], *parts]), owner)
                    return (
                        target
                        if isinstance(target, str)
                        else (f"{'.'.join([*walked, part])} = self.{kind[1]}", target[1])
                    )
            elif kind[0] == "leaf":
                if part not in LEAF_PARAMS.get(kind[1], set()) or parts:
                    return f"{'.'.join(walked)} is a {kind[1]}, which holds no {'.'.join([part, *parts])}"
                return ".".join(walked), kind
            walked.append(part)
        return f"{path} is a module, not a parameter"


def _skipped(model: Model, name: str) -> str | None:
    """Why MiniStreamForCausalLM.load_weights skips tensor `name` (skip_prefixes of its AutoWeightsLoader,
    or an `if ...: continue` of its loop); None if it loads it."""
    load = model.attrs(ARCH)[1].get("load_weights")
    for node in ast.walk(load) if load else ():
        if isinstance(node, ast.keyword) and node.arg == "skip_prefixes":
            value = node.value
            while isinstance(value, ast.IfExp):
                truth = model.truth(value.test)
                if truth is None:
                    _fail(f"{MINISTREAM}: cannot tell which skip_prefixes load_weights uses ({ast.unparse(value)})")
                value = value.body if truth else value.orelse
            prefixes = [] if isinstance(value, ast.Constant) and value.value is None else _literal(value, MINISTREAM)
            if any(name.startswith(p) for p in prefixes):
                return f"skip_prefixes {prefixes}"
        if isinstance(node, ast.If) and isinstance(node.body[0], ast.Continue) and model.truth(node.test, name):
            return f"line {node.lineno}: if {ast.unparse(node.test)}: continue"
    return None


def weights(tree: Path, patched: Path, version: str, folder: Path) -> str:
    module = _parse(patched / MINISTREAM, MINISTREAM)
    want = expected_mapping()
    for rel, found in ((MINISTREAM, module), (LLAMA, _parse(patched / LLAMA, LLAMA))):
        got = stacked_mapping(found, f"vLLM {version}'s {rel}")
        wrong = {shard: got.get(shard) for shard in want if got.get(shard) != want[shard]}
        if wrong:
            _fail(
                f"{rel}: the weight-loading table maps {', '.join(f'{s} to {wrong[s]}' for s in wrong)} in vLLM "
                f"{version}; the converted folder's rows need {', '.join(f'{s} -> {want[s]}' for s in wrong)} "
                f"(q, k, v and gate, up in the format's row order){'' if rel == MINISTREAM else ': update FUSED'}"
            )
    stacked = stacked_mapping(module, MINISTREAM)
    count = 0
    for tied in (True, False):
        model = Model(module, tied)
        head = model.resolve(HEAD)
        embedding = model.resolve(HF_EMBEDDING)
        setting = f"with tie_word_embeddings {tied}"
        if isinstance(head, str):
            _fail(
                f"{MINISTREAM}: {ARCH} has no {HF_HEAD} {setting} in vLLM {version}: {head}; "
                f"build lm_head as the release's llama.py does"
            )
        if tied and head[0] == "lm_head":
            _fail(
                f"{MINISTREAM}: {ARCH}'s lm_head is its own {head[1][1]} {setting} in vLLM {version}, and a tied "
                f"folder holds no {HF_HEAD}: tie it to the embedding ({HF_EMBEDDING})"
            )
        if not tied and head[0] != "lm_head":
            _fail(
                f"{MINISTREAM}: {ARCH}'s untied lm_head is left unset {setting} in vLLM {version} ({head[0]}): "
                f"the folder's {HF_HEAD} has no parameter of its own; create a ParallelLMHead"
            )
        for name in folder_tensors(tied):
            if skipped := _skipped(model, name):
                _fail(
                    f"{MINISTREAM}: {ARCH}.load_weights skips {name} {setting} in vLLM {version} "
                    f"({skipped}), which the converted folder holds: skip lm_head. only when tied"
                )
            shard = next((s for s in stacked if s + "." in name), None)
            param = name.replace(shard, stacked[shard][0]) if shard else name
            resolved = model.resolve(param)
            if isinstance(resolved, str):
                _fail(
                    f"{MINISTREAM}: the converted folder's {name} loads into {param}, which {ARCH} does not "
                    f"build {setting} in vLLM {version}: {resolved}"
                )
            count += 1
        if not isinstance(embedding, str) and embedding[0] != "model.embed_tokens":
            _fail(f"{MINISTREAM}: model.embed_tokens is not its own parameter {setting} in vLLM {version}")
    return f"{count} tensors (tied + untied) load; shards {', '.join(f'{s}:{i!r}' for s, (_, i) in want.items())}"


CHECKS = {"names": names, "attributes": attributes, "weights": weights}
