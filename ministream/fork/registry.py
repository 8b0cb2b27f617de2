"""vLLM's model and config registries, read and extended in the form of each release (0.6 on).

Three files register a model, each in one of the forms vLLM has used:
  registry.py           _TEXT_GENERATION_MODELS = {"Arch": ("module", "Class"), ...}
  config.py             _CONFIG_REGISTRY = {"model_type": ConfigClass, ...} with the classes imported
                        from vllm.transformers_utils.configs ("dict"), or
                        LazyConfigDict(model_type="ConfigClass", ...) ("lazy", 0.10 on)
  configs/__init__.py   from-imports + __all__ ("imports"), or _CLASS_TO_MODULE + __all__
                        ("class-to-module", 0.13 on)
The files are read by parsing (ast), never by importing: a release's vLLM need not be installed.
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from .. import MiniStreamError
from ..spec import ARCH, CONFIG_CLASS, MODEL_TYPE

REGISTRY_PY = "vllm/model_executor/models/registry.py"
CONFIG_PY = "vllm/transformers_utils/config.py"
CONFIGS_INIT_PY = "vllm/transformers_utils/configs/__init__.py"
FILES = (REGISTRY_PY, CONFIG_PY, CONFIGS_INIT_PY)

CONFIGS_PACKAGE = "vllm.transformers_utils.configs"
CONFIG_MODULE = f"{CONFIGS_PACKAGE}.{MODEL_TYPE}"  # where our config class goes


@dataclass
class Registries:
    architectures: dict[str, tuple[str, str]]  # architecture -> (module under models/, class)
    config_types: dict[str, str]  # model_type -> config class name
    config_exports: dict[str, str]  # config class exported by configs/__init__.py -> its module
    forms: tuple[str, str]  # ("dict" | "lazy", "imports" | "class-to-module")


def read_package(vllm_dir: Path) -> Registries:
    """The registries of an installed (or extracted) `vllm` package folder."""
    files = {}
    for rel in FILES:
        path = Path(vllm_dir) / rel.removeprefix("vllm/")
        if not path.is_file():
            raise MiniStreamError(f"{vllm_dir} has no {rel.removeprefix('vllm/')}: is it a vLLM (0.6 or later) package?")
        files[rel] = path.read_text()
    return read(files)


def read(files: dict[str, str]) -> Registries:
    """The registries in `files` (tree-relative path -> text; FILES must be there)."""
    registry, config, configs = (ast.parse(files[rel]) for rel in FILES)
    forms = config_forms(files[CONFIG_PY], files[CONFIGS_INIT_PY])
    return Registries(_architectures(registry), _config_types(config, forms[0]),
                      _config_exports(configs, forms[1]), forms)


def config_forms(config: str, configs: str) -> tuple[str, str]:
    """(form of _CONFIG_REGISTRY, form of configs/__init__.py): see the module docstring."""
    node = _assignment(ast.parse(config), "_CONFIG_REGISTRY")
    if isinstance(node, ast.Dict):
        registry = "dict"
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LazyConfigDict":
        registry = "lazy"
    else:
        raise MiniStreamError(f"{CONFIG_PY}: _CONFIG_REGISTRY is neither a dict nor a LazyConfigDict: "
                              f"a new registry form; extend ministream/fork/registry.py (config_forms)")
    tree = ast.parse(configs)
    if _assignment(tree, "__all__") is None:
        raise MiniStreamError(f"{CONFIGS_INIT_PY} has no __all__: a new form; "
                              f"extend ministream/fork/registry.py (config_forms)")
    exports = "class-to-module" if isinstance(_assignment(tree, "_CLASS_TO_MODULE"), ast.Dict) else "imports"
    return registry, exports


def _architectures(registry: ast.Module) -> dict[str, tuple[str, str]]:
    node = _assignment(registry, "_TEXT_GENERATION_MODELS")
    if not isinstance(node, ast.Dict):
        raise MiniStreamError(f"{REGISTRY_PY} has no _TEXT_GENERATION_MODELS dict: a new registry form; "
                              f"extend ministream/fork/registry.py")
    found = {}
    for k, v in zip(node.keys, node.values):
        if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2 and all(
                isinstance(e, ast.Constant) for e in v.elts):
            found[k.value] = (v.elts[0].value, v.elts[1].value)
    return found


def _config_types(config: ast.Module, form: str) -> dict[str, str]:
    node = _assignment(config, "_CONFIG_REGISTRY")
    if form == "lazy":
        return {k.arg: k.value.value for k in node.keywords if k.arg and isinstance(k.value, ast.Constant)}
    found = {}
    for k, v in zip(node.keys, node.values):
        if k is None and isinstance(v, ast.Name):  # **_CONFIG_REGISTRY_OVERRIDE_HF (0.6)
            inner = _assignment(config, v.id)
            pairs = zip(inner.keys, inner.values) if isinstance(inner, ast.Dict) else ()
        else:
            pairs = [(k, v)]
        found |= {k.value: v.id for k, v in pairs if isinstance(k, ast.Constant) and isinstance(v, ast.Name)}
    # a class config.py neither imports nor defines is no working registration (a NameError on import)
    bound = {a.asname or a.name for n in config.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    bound |= {n.name for n in config.body if isinstance(n, ast.ClassDef)}
    return {k: v for k, v in found.items() if v in bound}


def _config_exports(configs: ast.Module, form: str) -> dict[str, str]:
    exported = ast.literal_eval(_assignment(configs, "__all__"))
    if form == "class-to-module":
        modules = ast.literal_eval(_assignment(configs, "_CLASS_TO_MODULE"))
    else:
        modules = {}
        for n in configs.body:
            if isinstance(n, ast.ImportFrom) and n.module:
                module = f"{CONFIGS_PACKAGE}.{n.module}" if n.level else n.module
                modules |= {a.asname or a.name: module for a in n.names}
    return {c: modules[c] for c in exported if c in modules}


# --- adding MiniStream: each entry next to its closest alphabetical neighbours -----------------

def add_architecture(text: str) -> str:
    """registry.py with "MiniStreamForCausalLM": ("ministream", "MiniStreamForCausalLM") in
    _TEXT_GENERATION_MODELS."""
    node = _assignment(ast.parse(text), "_TEXT_GENERATION_MODELS")
    if not isinstance(node, ast.Dict):
        raise MiniStreamError(f"{REGISTRY_PY} has no _TEXT_GENERATION_MODELS dict: a new registry form; "
                              f"extend ministream/fork/registry.py (add_architecture)")
    return _insert_entry(text, _dict_spans(node), ARCH, f'"{ARCH}": ("{MODEL_TYPE}", "{ARCH}"),',
                         f"{REGISTRY_PY} _TEXT_GENERATION_MODELS")


def add_config(config: str, configs: str) -> tuple[str, str]:
    """config.py and configs/__init__.py with MiniStreamConfig registered for model_type "ministream"."""
    registry, exports = config_forms(config, configs)
    if registry == "dict":
        config = _add_to_dict_registry(config)
    else:
        node = _assignment(ast.parse(config), "_CONFIG_REGISTRY")
        spans = [(k.arg, k.lineno, k.end_lineno) for k in node.keywords if k.arg]
        config = _insert_entry(config, spans, MODEL_TYPE, f'{MODEL_TYPE}="{CONFIG_CLASS}",',
                               f"{CONFIG_PY} _CONFIG_REGISTRY")
    return config, _add_export(configs, exports)


def _add_to_dict_registry(config: str) -> str:
    node = _assignment(ast.parse(config), "_CONFIG_REGISTRY")
    config = _insert_entry(config, _dict_spans(node), MODEL_TYPE, f'"{MODEL_TYPE}": {CONFIG_CLASS},',
                           f"{CONFIG_PY} _CONFIG_REGISTRY")
    # the classes are imported by name from the package: one more import line after that import
    imports = [n for n in ast.parse(config).body if isinstance(n, ast.ImportFrom) and n.module == CONFIGS_PACKAGE]
    if not imports:
        raise MiniStreamError(f"{CONFIG_PY} does not import from {CONFIGS_PACKAGE}: a new form; "
                              f"extend ministream/fork/registry.py (add_config)")
    lines = config.splitlines(keepends=True)
    lines.insert(imports[0].end_lineno, f"from {CONFIGS_PACKAGE} import {CONFIG_CLASS}\n")
    return "".join(lines)


def _add_export(configs: str, form: str) -> str:
    tree = ast.parse(configs)
    if form == "class-to-module":
        configs = _insert_entry(configs, _dict_spans(_assignment(tree, "_CLASS_TO_MODULE")), CONFIG_CLASS,
                                f'"{CONFIG_CLASS}": "{CONFIG_MODULE}",', f"{CONFIGS_INIT_PY} _CLASS_TO_MODULE")
    else:
        spans = [(n.module, n.lineno, n.end_lineno) for n in tree.body
                 if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(CONFIGS_PACKAGE + ".")]
        configs = _insert_entry(configs, spans, CONFIG_MODULE, f"from {CONFIG_MODULE} import {CONFIG_CLASS}",
                                f"{CONFIGS_INIT_PY} imports")
    spans = _list_spans(_assignment(ast.parse(configs), "__all__"))
    if len({first for _, first, _ in spans}) != len(spans):
        raise MiniStreamError(f"{CONFIGS_INIT_PY} __all__ is not one name per line; add {CONFIG_CLASS!r} by hand")
    return _insert_entry(configs, spans, CONFIG_CLASS, f'"{CONFIG_CLASS}",', f"{CONFIGS_INIT_PY} __all__")


def _assignment(tree: ast.Module, name: str) -> ast.AST | None:
    """The value assigned to module-level `name` (plain or annotated), None if there is none."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.value
    return None


def _dict_spans(node: ast.Dict) -> list[tuple[str, int, int]]:
    return [(k.value, k.lineno, v.end_lineno) for k, v in zip(node.keys, node.values)
            if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def _list_spans(node: ast.List) -> list[tuple[str, int, int]]:
    return [(e.value, e.lineno, e.end_lineno) for e in node.elts
            if isinstance(e, ast.Constant) and isinstance(e.value, str)]


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
    lines.insert(last if i >= 0 else first - 1, f"{indent}{line}\n")
    return "".join(lines)
