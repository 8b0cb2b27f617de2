"""pysource: reading a release's Python files without importing them: what a module defines, where an import points.

One reader for every check that asks "does this release's module define X" (matrix's import check, the
model checks' names), so that they cannot disagree.
"""

import ast


def import_target(package: str, level: int, module: str) -> str:
    """The tree path a relative import names: from package tests/models/language/generation,
    level 3 and module utils -> tests/models/utils."""
    parts = package.split("/")
    return "/".join(parts[: len(parts) - level + 1] + (module.split(".") if module else []))


def top_level(module: ast.Module) -> tuple[set[str], list[ast.ImportFrom]]:
    """The names a module binds at import (in if/try/with blocks too), and its star imports."""
    names: set[str] = set()
    stars: list[ast.ImportFrom] = []
    todo: list[ast.AST] = list(module.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*" and isinstance(node, ast.ImportFrom):  # `import *` does not parse
                    stars.append(node)
                else:
                    names.add(a.asname or a.name.split(".")[0])
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if isinstance(node, (ast.If, ast.While)):  # if (x := ...):
            names |= {n.target.id for n in ast.walk(node.test) if isinstance(n, ast.NamedExpr)}
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo.extend(getattr(node, field, []))
        if isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
            targets = (
                [node.target]
                if isinstance(node, (ast.For, ast.AsyncFor))
                else [i.optional_vars for i in node.items if i.optional_vars]
            )
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names, stars


def imported(module: ast.Module) -> dict[str, tuple[int, str, str]]:
    """Local name -> (level, module, name) of each `from module import name [as local]`, at any depth (the
    function-level imports vLLM uses to break cycles too); the first binding of a name wins."""
    found: dict[str, tuple[int, str, str]] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name != "*":
                    found.setdefault(a.asname or a.name, (node.level, node.module or "", a.name))
    return found


def find_class(module: ast.Module, name: str) -> ast.ClassDef | None:
    """The class `name` defined at the top of `module` (in if/try blocks too)."""
    todo: list[ast.AST] = list(module.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
    return None


def class_attributes(cls: ast.ClassDef) -> set[str]:
    """The names a class has of its own: bound in its body (methods, fields, properties) and every `self.x = ...`
    of its methods (its instance attributes)."""
    names = top_level(ast.Module(body=cls.body, type_ignores=[]))[0]
    return names | {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def assigned_classes(cls: ast.ClassDef, attr: str) -> list[str]:
    """The callees of every `self.<attr> = Callee(...)` (or annotated) in the class's methods: the classes an
    instance attribute is built from, as named there."""
    found = []
    for node in ast.walk(cls):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        value = getattr(node, "value", None)
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == attr
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and isinstance(value, ast.Call)
            ):
                found += _built_by(cls, ast.unparse(value.func))
    return found


def _built_by(cls: ast.ClassDef, callee: str) -> list[str]:
    """`callee`, or for a factory method of the class (self._make_x()), the callees of its returns."""
    method = next(
        (m for m in cls.body if isinstance(m, ast.FunctionDef) and f"self.{m.name}" == callee),
        None,
    )
    if method is None:
        return [callee]
    return [
        ast.unparse(n.value.func)
        for n in ast.walk(method)
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Call)
    ]
