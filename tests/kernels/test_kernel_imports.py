"""The kernels stand alone: no module of pallas_kernels imports the engine (anything of
`jaxengine` outside `jaxengine.pallas_kernels`), so the engine's choices (which backend runs)
live in the engine and the kernels can be used and tested on their own."""

from __future__ import annotations

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "pallas_kernels"


def _imported_modules(tree: ast.AST) -> list[str]:
    """Every absolute import of the file as a dotted name, function-level ones included
    (`from a.b import c` as "a.b.c")."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [f"{node.module}.{alias.name}" for alias in node.names]
    return out


def test_kernels_import_nothing_of_the_engine():
    files = sorted(KERNELS.glob("*.py"))
    assert files
    bad = {}
    for f in files:
        names = _imported_modules(ast.parse(f.read_text(), str(f)))
        engine = [n for n in names if (n == "jaxengine" or n.startswith("jaxengine."))
                  and not n.startswith("jaxengine.pallas_kernels")]
        if engine:
            bad[f.name] = engine
    assert bad == {}
