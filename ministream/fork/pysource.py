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
