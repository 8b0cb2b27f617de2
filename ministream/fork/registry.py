"""vLLM's model and config registries, read and extended in the form of each release (0.4.3 on).

Three files register a model, each in one of the forms vLLM has used:
  registry.py           _TEXT_GENERATION_MODELS = {"Arch": ("module", "Class"), ...}
  config.py             _CONFIG_REGISTRY = {"model_type": ConfigClass, ...} with the classes imported
                        ("dict", 0.6-0.9; `**_CONFIG_REGISTRY_OVERRIDE_HF` merges a second dict), or
                        LazyConfigDict(model_type="ConfigClass", ...) ("lazy", 0.10 on), whose values are
                        looked up in vllm.transformers_utils.configs, except a class named bare (0.11's
                        deepseek_v32=DeepseekV3Config) and with `**{"not-an-identifier": "Class"}` (0.25 on)
  configs/__init__.py   from-imports + __all__ ("imports"), or _CLASS_TO_MODULE + __all__
                        ("class-to-module", 0.13 on)
From 0.6.3 on, vLLM's own `AutoConfig.register(...)` calls (0.19 on) register at run time the class
_CONFIG_REGISTRY gives for a model_type: _CONFIG_REGISTRY is what they read, no form of their own (the
Sampler era's module-level ones, the "autoconfig" form, are below).
The files are read by parsing (ast), never by importing: a release's vLLM need not be installed.
"""

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from .. import MiniStreamError
from ..spec import ARCH, CONFIG_CLASS, MODEL_TYPE

REGISTRY_PY = "vllm/model_executor/models/registry.py"
CONFIG_PY = "vllm/transformers_utils/config.py"
CONFIGS_INIT_PY = "vllm/transformers_utils/configs/__init__.py"
FILES = (REGISTRY_PY, CONFIG_PY, CONFIGS_INIT_PY)

CONFIGS_PACKAGE = "vllm.transformers_utils.configs"
CONFIG_MODULE = f"{CONFIGS_PACKAGE}.{MODEL_TYPE}"  # where our config class goes
CONFIG_PY_MODULE = "vllm.transformers_utils.config"

# The Sampler era (0.4-0.6.2). models/__init__.py held the architectures, as _GENERATION_MODELS (the same
# dict). In 0.4, get_config asks transformers' AutoConfig before _CONFIG_REGISTRY, and AutoConfig refuses a
# model_type it lacks: an entry needs its own module-level AutoConfig.register("type", Class) too (the
# "autoconfig" form; 0.5-0.6.2 register every entry in a loop, 0.6.3 on read _CONFIG_REGISTRY first).
MODELS_INIT_PY = "vllm/model_executor/models/__init__.py"
MODELS_DICTS = ("_TEXT_GENERATION_MODELS", "_GENERATION_MODELS")


def files(version: str) -> tuple[str, str, str]:
    """The files that register a model in vLLM `version`: FILES, models/__init__.py for registry.py
    before 0.6.3 (which has none)."""
    return FILES if Version(version) >= Version("0.6.3") else (MODELS_INIT_PY, CONFIG_PY, CONFIGS_INIT_PY)


def _models_dict(registry: ast.Module) -> ast.Dict | None:
    node = next((n for n in (_assignment(registry, name) for name in MODELS_DICTS) if n is not None), None)
    return node if isinstance(node, ast.Dict) else None


def _asks_autoconfig_first(config: ast.Module) -> bool:
    """The "autoconfig" form: get_config calls AutoConfig.from_pretrained before it reads
    _CONFIG_REGISTRY, and no loop registers the registry's entries with AutoConfig."""
    loop = any(
        isinstance(n, ast.For) and "_CONFIG_REGISTRY" in ast.unparse(n.iter) and "AutoConfig.register" in ast.unparse(n)
        for n in config.body
    )
    get_config = next((n for n in config.body if isinstance(n, ast.FunctionDef) and n.name == "get_config"), None)
    if loop or get_config is None:
        return False
    lines = [n.lineno for n in ast.walk(get_config) if isinstance(n, ast.Name) and n.id == "_CONFIG_REGISTRY"]
    asks = [
        n.lineno
        for n in ast.walk(get_config)
        if isinstance(n, ast.Attribute) and ast.unparse(n) == "AutoConfig.from_pretrained"
    ]
    return bool(asks) and min(asks) < min(lines, default=min(asks) + 1)


def _known_to_autoconfig(config: ast.Module, form: str, types: dict[str, str], modules: dict[str, str]):
    """(types, modules) of the "autoconfig" form that AutoConfig.register registers too (the types
    transformers has need none, but are not told apart); those of another form as they are."""
    if form != "autoconfig":
        return types, modules
    registered = _autoconfig_registered(config)
    types = {k: v for k, v in types.items() if registered.get(k) == v}
    return types, {k: v for k, v in modules.items() if k in types}


def _add_autoconfig_register(config: str) -> str:
    """config.py with AutoConfig.register for our model_type below _CONFIG_REGISTRY ("autoconfig" form)."""
    tree = ast.parse(config)
    if "AutoConfig" not in {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}:
        raise MiniStreamError(
            f"{CONFIG_PY} asks AutoConfig first but does not import it at module level: a new "
            f"form; extend ministream/fork/registry.py (_add_autoconfig_register)"
        )
    lines = config.splitlines(keepends=True)
    lines.insert(
        _end(_required(tree, "_CONFIG_REGISTRY", CONFIG_PY)),
        "\n# get_config asks transformers' AutoConfig before _CONFIG_REGISTRY, and\n"
        f"# AutoConfig refuses a model_type it does not know\n"
        f'AutoConfig.register("{MODEL_TYPE}", {CONFIG_CLASS})\n',
    )
    return "".join(lines)


def _autoconfig_registered(config: ast.Module) -> dict[str, str]:
    """model_type -> class of each module-level AutoConfig.register("type", Class)."""
    calls = [n.value for n in config.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    registered = {}
    for c in calls:
        if (
            ast.unparse(c.func) == "AutoConfig.register"
            and len(c.args) == 2
            and isinstance(c.args[0], ast.Constant)
            and isinstance(model_type := c.args[0].value, str)
        ):
            registered[model_type] = ast.unparse(c.args[1])
    return registered


@dataclass
class Registries:
    architectures: dict[str, tuple[str, str]]  # architecture -> (module under models/, class)
    config_types: dict[str, str]  # model_type -> config class name
    config_exports: dict[str, str]  # config class exported by configs/__init__.py -> its module
    # model_type -> the module vLLM takes its config class from; absent where it finds none there
    # (a class configs/__init__.py does not export): loading such a model_type fails
    config_modules: dict[str, str]
    forms: tuple[str, str]  # ("dict" | "autoconfig" | "lazy", "imports" | "class-to-module")


def read_package(vllm_dir: Path) -> Registries:
    """The registries of an installed (or extracted) `vllm` package folder."""
    files = {}
    before_0_6_3 = not (Path(vllm_dir) / REGISTRY_PY.removeprefix("vllm/")).is_file()
    for rel in (MODELS_INIT_PY, *FILES[1:]) if before_0_6_3 else FILES:
        path = Path(vllm_dir) / rel.removeprefix("vllm/")
        if not path.is_file():
            raise MiniStreamError(
                f"{vllm_dir} has no {rel.removeprefix('vllm/')}: is it a vLLM (0.4 or later) package?"
            )
        files[rel] = path.read_text()
    return read(files)


def read(files: dict[str, str]) -> Registries:
    """The registries in `files` (tree-relative path -> text; FILES must be there)."""
    registry, config, configs = (
        ast.parse(files[rel]) for rel in (REGISTRY_PY if REGISTRY_PY in files else MODELS_INIT_PY, *FILES[1:])
    )
    forms = config_forms(files[CONFIG_PY], files[CONFIGS_INIT_PY])
    package = _config_package(configs, forms[1])
    types, modules = _config_types(config, forms[0], package)
    types, modules = _known_to_autoconfig(config, forms[0], types, modules)
    exported = ast.literal_eval(_required(configs, "__all__", CONFIGS_INIT_PY))
    return Registries(
        _architectures(registry), types, {c: package[c] for c in exported if c in package}, modules, forms
    )


def config_forms(config: str, configs: str) -> tuple[str, str]:
    """(form of _CONFIG_REGISTRY, form of configs/__init__.py): see the module docstring."""
    node = _assignment(ast.parse(config), "_CONFIG_REGISTRY")
    if isinstance(node, ast.Dict):
        registry = "autoconfig" if _asks_autoconfig_first(ast.parse(config)) else "dict"
    elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "LazyConfigDict":
        registry = "lazy"
    else:
        raise MiniStreamError(
            f"{CONFIG_PY}: _CONFIG_REGISTRY is neither a dict nor a LazyConfigDict: "
            f"a new registry form; extend ministream/fork/registry.py (config_forms)"
        )
    tree = ast.parse(configs)
    if _assignment(tree, "__all__") is None:
        raise MiniStreamError(
            f"{CONFIGS_INIT_PY} has no __all__: a new form; extend ministream/fork/registry.py (config_forms)"
        )
    exports = "class-to-module" if isinstance(_assignment(tree, "_CLASS_TO_MODULE"), ast.Dict) else "imports"
    return registry, exports


def _architectures(registry: ast.Module) -> dict[str, tuple[str, str]]:
    node = _models_dict(registry)
    if node is None:
        raise MiniStreamError(
            f"{REGISTRY_PY} has no _TEXT_GENERATION_MODELS dict (nor {MODELS_INIT_PY} a "
            f"_GENERATION_MODELS one): a new registry form; extend ministream/fork/registry.py"
        )
    found = {}
    for k, v in zip(node.keys, node.values):
        if isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Tuple) and len(v.elts) == 2:
            module, cls = v.elts
            if (
                isinstance(module, ast.Constant)
                and isinstance(cls, ast.Constant)
                and isinstance(module.value, str)
                and isinstance(cls.value, str)
            ):
                found[k.value] = (module.value, cls.value)
    return found


def _config_types(config: ast.Module, form: str, package: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(model_type -> config class, model_type -> module of that class) of _CONFIG_REGISTRY; `package`:
    _config_package."""
    # a class config.py neither imports nor defines is no working registration (a NameError on import)
    bound = {
        a.asname or a.name: _from_module(n, CONFIG_PY_MODULE)
        for n in config.body
        if isinstance(n, ast.ImportFrom)
        for a in n.names
    }
    bound |= {a.asname or a.name: a.name for n in config.body if isinstance(n, ast.Import) for a in n.names}
    bound |= {n.name: CONFIG_PY_MODULE for n in config.body if isinstance(n, ast.ClassDef)}
    types, modules = {}, {}
    for k, v in _entries(config, _required(config, "_CONFIG_REGISTRY", CONFIG_PY)):
        if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
            continue
        if form == "lazy" and isinstance(v, ast.Constant) and isinstance(v.value, str):
            cls, module = v.value, package.get(v.value)  # LazyConfigDict looks the name up in the package
        elif isinstance(v, ast.Name) and v.id in bound:
            cls, module = v.id, bound[v.id]
            if module == CONFIGS_PACKAGE:  # imported from the package: from where the package has it
                module = package.get(cls)
        else:
            continue
        types[k.value] = cls
        if module:
            modules[k.value] = module
    return types, modules


def _entries(tree: ast.Module, node: ast.expr) -> Iterator[tuple[ast.expr, ast.expr]]:
    """(key, value) nodes of a dict display or a LazyConfigDict(...) call (a keyword's key as a
    Constant), following `**` into an inline dict or a module-level one."""
    pairs: list[tuple[ast.expr | None, ast.expr]]
    if isinstance(node, ast.Call):
        pairs = [(ast.Constant(k.arg) if k.arg else None, k.value) for k in node.keywords]
    else:
        assert isinstance(node, ast.Dict), ast.dump(node)  # config_forms: a dict or a LazyConfigDict(...)
        pairs = list(zip(node.keys, node.values))
    for k, v in pairs:
        if k is not None:
            yield k, v
            continue
        inner = _assignment(tree, v.id) if isinstance(v, ast.Name) else v
        if isinstance(inner, ast.Dict):
            yield from _entries(tree, inner)


def _from_module(node: ast.ImportFrom, module: str) -> str:
    """The absolute module `node` (in `module`, not a package's __init__) imports from."""
    if not node.level:
        assert node.module is not None  # only `from . import x` has none
        return node.module
    base = module.rsplit(".", node.level)[0]
    return f"{base}.{node.module}" if node.module else base


def _config_package(configs: ast.Module, form: str) -> dict[str, str]:
    """Class -> module, for each class the configs package has as an attribute (which is how config.py
    and LazyConfigDict get it), in __all__ or not (0.30's DeepseekV41Config is not)."""
    if form == "class-to-module":  # its module __getattr__ imports these on first use
        return ast.literal_eval(_required(configs, "_CLASS_TO_MODULE", CONFIGS_INIT_PY))
    # __init__.py is the package itself: a relative import starts from a module inside it
    return {
        a.asname or a.name: _from_module(n, f"{CONFIGS_PACKAGE}.__init__")
        for n in configs.body
        if isinstance(n, ast.ImportFrom) and n.module
        for a in n.names
    }


# --- adding MiniStream: each entry next to its closest alphabetical neighbours -----------------


def add_architecture(text: str) -> str:
    """registry.py with "MiniStreamForCausalLM": ("ministream", "MiniStreamForCausalLM") in
    _TEXT_GENERATION_MODELS."""
    node = _models_dict(ast.parse(text))
    if node is None:
        raise MiniStreamError(
            f"{REGISTRY_PY} has no _TEXT_GENERATION_MODELS dict (nor {MODELS_INIT_PY} a "
            f"_GENERATION_MODELS one): a new registry form; extend ministream/fork/registry.py "
            f"(add_architecture)"
        )
    return _insert_entry(
        text,
        _dict_spans(node),
        ARCH,
        f'"{ARCH}": ("{MODEL_TYPE}", "{ARCH}"),',
        "the model registry (_TEXT_GENERATION_MODELS / _GENERATION_MODELS)",
    )


def add_config(config: str, configs: str) -> tuple[str, str]:
    """config.py and configs/__init__.py with MiniStreamConfig registered for model_type "ministream"."""
    registry, exports = config_forms(config, configs)
    if registry in ("dict", "autoconfig"):
        config = _add_to_dict_registry(config)
        if registry == "autoconfig":
            config = _add_autoconfig_register(config)
    else:
        node = _required(ast.parse(config), "_CONFIG_REGISTRY", CONFIG_PY)
        assert isinstance(node, ast.Call), ast.dump(node)  # config_forms: "lazy" is a LazyConfigDict(...)
        spans = [(k.arg, k.lineno, _end(k)) for k in node.keywords if k.arg]
        config = _insert_entry(
            config, spans, MODEL_TYPE, f'{MODEL_TYPE}="{CONFIG_CLASS}",', f"{CONFIG_PY} _CONFIG_REGISTRY"
        )
    return config, _add_export(configs, exports)


def _add_to_dict_registry(config: str) -> str:
    node = _assignment(ast.parse(config), "_CONFIG_REGISTRY")
    config = _insert_entry(
        config, _dict_spans(node), MODEL_TYPE, f'"{MODEL_TYPE}": {CONFIG_CLASS},', f"{CONFIG_PY} _CONFIG_REGISTRY"
    )
    # the classes are imported by name from the package: one more import line after that import
    imports = [n for n in ast.parse(config).body if isinstance(n, ast.ImportFrom) and n.module == CONFIGS_PACKAGE]
    if not imports:
        raise MiniStreamError(
            f"{CONFIG_PY} does not import from {CONFIGS_PACKAGE}: a new form; "
            f"extend ministream/fork/registry.py (add_config)"
        )
    lines = config.splitlines(keepends=True)
    lines.insert(_end(imports[0]), f"from {CONFIGS_PACKAGE} import {CONFIG_CLASS}\n")
    return "".join(lines)


def _add_export(configs: str, form: str) -> str:
    tree = ast.parse(configs)
    if form == "class-to-module":
        # beside the classes of vLLM's own configs package (0.34 keeps transformers' classes in a group below)
        spans = _dict_spans(_assignment(tree, "_CLASS_TO_MODULE"), CONFIGS_PACKAGE + ".")
        configs = _insert_entry(
            configs,
            spans,
            CONFIG_CLASS,
            f'"{CONFIG_CLASS}": "{CONFIG_MODULE}",',
            f"{CONFIGS_INIT_PY} _CLASS_TO_MODULE",
        )
    else:
        spans = [
            (n.module, n.lineno, _end(n))
            for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(CONFIGS_PACKAGE + ".")
        ]
        configs = _insert_entry(
            configs, spans, CONFIG_MODULE, f"from {CONFIG_MODULE} import {CONFIG_CLASS}", f"{CONFIGS_INIT_PY} imports"
        )
    spans = _list_spans(_assignment(ast.parse(configs), "__all__"))
    if len({first for _, first, _ in spans}) != len(spans):
        raise MiniStreamError(f"{CONFIGS_INIT_PY} __all__ is not one name per line; add {CONFIG_CLASS!r} by hand")
    return _insert_entry(configs, spans, CONFIG_CLASS, f'"{CONFIG_CLASS}",', f"{CONFIGS_INIT_PY} __all__")


def _assignment(tree: ast.Module, name: str) -> ast.expr | None:
    """The value assigned to module-level `name` (plain or annotated), None if there is none."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return node.value
    return None


def _required(tree: ast.Module, name: str, path: str) -> ast.expr:
    """_assignment, refused where `name` is not assigned."""
    node = _assignment(tree, name)
    if node is None:
        raise MiniStreamError(f"{path} has no {name} = ...: a new form; extend ministream/fork/registry.py")
    return node


def _end(node: ast.expr | ast.stmt | ast.keyword) -> int:
    """The last line of a parsed node (ast.parse sets it on every node)."""
    assert node.end_lineno is not None
    return node.end_lineno


def _dict_spans(node: ast.expr | None, values: str = "") -> list[tuple[str, int, int]]:
    """(key, first line, last line) of each string key of a dict display (with `values`, only the keys whose value
    is a string starting so); none for anything else."""
    if not isinstance(node, ast.Dict):
        return []
    return [
        (k.value, k.lineno, _end(v))
        for k, v in zip(node.keys, node.values)
        if isinstance(k, ast.Constant)
        and isinstance(k.value, str)
        and (not values or (isinstance(v, ast.Constant) and str(v.value).startswith(values)))
    ]


def _list_spans(node: ast.expr | None) -> list[tuple[str, int, int]]:
    """(item, first line, last line) of each string of a list display; none for anything else."""
    if not isinstance(node, ast.List):
        return []
    return [(e.value, e.lineno, _end(e)) for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


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
    indent = m.group(0) if (m := re.match(r"\s*", lines[first - 1])) else ""
    lines.insert(last if i >= 0 else first - 1, f"{indent}{line}\n")
    return "".join(lines)
