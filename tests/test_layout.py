"""The tree is a picture of the architecture: each package's directory is named as it is
imported (client/fuyou_client, proto/fuyou_proto, fuyoud), and no module of a package
imports, at run time, one that imports it back (imports under TYPE_CHECKING aside, and
the package's own __init__, a facade, aside)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"fuyoud": REPO / "fuyoud", "fuyou_client": REPO / "client" / "fuyou_client",
            "fuyou_proto": REPO / "proto" / "fuyou_proto"}


def imports(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports when it runs."""
    graph = {}
    for path in root.rglob("*.py"):
        name = ".".join([package, *path.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
                       for n in ast.walk(node)}
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module == package:  # from package import submodule
                deps.update(f"{package}.{a.name}" for a in node.names)
            elif node.module.startswith(package + "."):
                deps.add(node.module)
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m and d != package} for m, deps in graph.items()}


@pytest.mark.parametrize("package", list(PACKAGES))
def test_each_package_lives_in_a_directory_of_its_name(package):
    module = importlib.import_module(package)
    assert Path(module.__file__).resolve().parent == PACKAGES[package].resolve()


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_circles(package):
    graph = imports(PACKAGES[package], package)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module, path):
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
