"""The tree is a picture of the architecture:

* each package's directory is named as it is imported (client/fuyou_client,
  client/fuyouctl, proto/fuyou_proto, fuyoud);
* no module in the whole tree (the packages, bench/, tests/, examples/, docs/, native/)
  imports one that imports it back, counting every import (those under TYPE_CHECKING,
  those inside functions and relative ones too); a package's ``__init__`` is a facade
  over its own modules, which import each other directly, never through it (that
  would be a circle);
* the client's subpackages are layered: each imports only those before it in LAYERS;
  so are the daemon's, in DAEMON_LAYERS; the daemon's package imports neither the
  client's nor fuyouctl's, and the client's imports neither the daemon's nor fuyouctl's;
* no client module touches another's private names (``x._name``, ``from m import _name``);
* no client function is longer than 80 lines without a comment saying why;
* no Python file in the tree is longer than ~500 lines without saying why at its top
  ("Past ~500 lines on purpose: ..."), generated code aside.
"""
from __future__ import annotations

import ast
import functools
import importlib
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"fuyoud": REPO / "fuyoud", "fuyou_client": REPO / "client" / "fuyou_client",
            "fuyouctl": REPO / "client" / "fuyouctl", "fuyou_proto": REPO / "proto" / "fuyou_proto"}
CLIENT = PACKAGES["fuyou_client"]
DAEMON = PACKAGES["fuyoud"]
# Directories of scripts that import each other as top-level modules (``import common``,
# ``from conftest import ...``: each puts its own directory, or another of these, on sys.path).
SCRIPTS = ["bench", "tests", "examples", "docs", "native", "."]

# The client's layers, lowest first (docs/architecture.md describes each).
LAYERS = ["errors", "optim", "connection", "device", "model", "memory", "offload", "gradients", "groups", "steps",
          "activations", "blockmajor", "checkpoints", "parallel", "sizing", "engine", "integrations"]

# The daemon's layers, lowest first (docs/design/architecture.md, "The daemon", describes each):
# top-level modules by their name, subpackages by theirs; server.py is the one place that builds.
DAEMON_LAYERS = ["errors", "units", "failpoints", "config", "concurrency", "sessions", "io", "memory", "storage",
                 "optimizer", "checkpoints", "operations", "api", "server", "cli", "__main__"]

# Private attributes of torch, transformers and the standard library the client may use.
FOREIGN_PRIVATE = {"_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_version", "_schema",
                   "_cdata", "_getframe", "_foreach_norm", "_make_wrapper_subclass", "_initialize_weights",
                   "_init_weights", "_reset_parameters", "_get_default_group", "_get_backend", "_timeout",
                   "_save_checkpoint", "_save", "_move_model_to_device", "_base",  # (a view's base: swapper.py)
                   "_C",  # (torch._C: _cuda_clearCublasWorkspaces, devices.py)
                   # PEFT's (integrations/peft.py runs PEFT's own merge on each layer: its refusals
                   # checked first, a DoRA layer's weight-norm cache put back as it was after)
                   "_check_merge_allowed", "_caches",
                   # transformers' experts' own gate (model/experts.py: a part gates as its module does)
                   "_apply_gate"}
LONG_FUNCTION = 80
LONG_FILE = 500
# Long files another change is splitting (issue 41: the block-major schedule).


def module_name(root: Path, package: str, path: Path) -> str:
    return ".".join([package, *path.relative_to(root).with_suffix("").parts]).removesuffix(".__init__")


@functools.cache
def _sources() -> dict[str, Path]:
    """Every Python module of the tree: the packages' by their dotted names, the scripts'
    as ``dir:stem`` (the name they are imported by is the stem)."""
    found = {}
    for package, root in PACKAGES.items():
        found.update({module_name(root, package, p): p for p in root.rglob("*.py") if "__pycache__" not in p.parts})
    for d in SCRIPTS:
        found.update({f"{d}:{p.stem}": p for p in sorted((REPO / d).glob("*.py"))})
    return found


def _deepest(name: str, known) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


@functools.cache
def _graph() -> dict[str, set[str]]:
    """module -> the tree's modules it imports (any import anywhere in it). A script's
    top-level import is its own directory's module first, then a package's, then another
    scripts' directory's (bench/ and tests/ put each other on sys.path); never for a name of
    the standard library (already imported when a script starts)."""
    sources = _sources()
    scripts = {}
    for key in sources:
        if ":" in key:
            scripts.setdefault(key.split(":")[1], []).append(key)
    graph = {}
    for name, path in sources.items():
        own = name.split(":")[0] + ":" if ":" in name else None
        package = None if own else (name if path.name == "__init__.py" else name.rpartition(".")[0])

        def resolve(target: str) -> str | None:
            top = target.split(".")[0]
            if own and top not in sys.stdlib_module_names:
                if own + top in sources:
                    return own + top
                if top not in PACKAGES and scripts.get(top):
                    return scripts[top][0]
            return _deepest(target, sources) if top in PACKAGES else None

        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # (relative: from the module's package up)
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:  # (from package import submodule: that submodule)
                    sub = f"{base}.{a.name}"
                    deps.add(sub if sub in sources else resolve(base) if base else None)
        graph[name] = {d for d in deps if d and d != name}
    return graph


def imports(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports (any import anywhere in it)."""
    return {m: {d for d in deps if d.split(".")[0] == package} for m, deps in _graph().items()  # (copies)
            if m.split(".")[0] == package}


@pytest.mark.parametrize("package", list(PACKAGES))
def test_each_package_lives_in_a_directory_of_its_name(package):
    module = importlib.import_module(package)
    assert Path(module.__file__).resolve().parent == PACKAGES[package].resolve()


def test_no_import_circles_anywhere_in_the_tree():
    graph = _graph()
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


def test_the_graph_sees_the_scripts_imports():
    """The circle check reads bench/'s and tests/' own imports (a graph without them would
    pass whatever they did)."""
    graph = _graph()
    assert "bench:gpu_cases" in graph["bench:gpu_worker"] and "bench:common" in graph["bench:gpu"]
    assert "tests:conftest" in graph["tests:test_daemon"]
    assert "fuyoud.io.engine" in graph["fuyoud.io.threadpool"]  # (from .engine import ...)
    assert "fuyou_client.sizing.cli" in graph["fuyouctl.plan"]


def _check_layers(package: str, root: Path, layers: list[str]) -> None:
    graph = imports(root, package)
    graph.pop(package)
    layer = {package: -1}  # (the package's own __init__: its version, below every layer)
    for module in graph:
        top = module.split(".")[1]
        assert top in layers, f"{module}: its place {top!r} is not in the layers (nor docs/design/architecture.md)"
        layer[module] = layers.index(top)
    wrong = [f"{m} imports {d}" for m, deps in graph.items() for d in deps if layer[d] > layer[m]]
    assert not wrong, "imports against the layers: " + "; ".join(sorted(wrong))
    unused = [name for name in layers if not any(m.split(".")[1] == name for m in graph)]
    assert not unused, f"the layers name what {package} does not have: {unused}"


def test_the_daemon_is_layered():
    """Each subpackage (or top module) of fuyoud imports only the layers before it."""
    _check_layers("fuyoud", DAEMON, DAEMON_LAYERS)


def test_the_daemon_and_the_client_import_neither_the_other_nor_fuyouctl():
    """fuyouctl uses both (the daemon's config, the client's planner); neither uses it or
    the other."""
    graph = _graph()
    crossing = [f"{m} imports {d}" for m, deps in graph.items() for d in deps
                if (m.split(".")[0], d.split(".")[0]) in {("fuyoud", "fuyou_client"), ("fuyoud", "fuyouctl"),
                                                          ("fuyou_client", "fuyoud"), ("fuyou_client", "fuyouctl")}]
    assert not crossing, crossing


def test_the_client_is_layered():
    """Each subpackage (or top module) imports only the layers before it."""
    _check_layers("fuyou_client", CLIENT, LAYERS)


def _client_sources():
    for path in sorted(CLIENT.rglob("*.py")):
        yield path.relative_to(CLIENT), path.read_text()


def test_no_client_module_touches_another_ones_private_names():
    touched = []
    for rel, text in _client_sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if node.attr not in FOREIGN_PRIVATE:
                    touched.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fuyou_client"):
                touched += [f"{rel}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not touched, "private names used from outside their object or module:\n" + "\n".join(touched)


def test_no_long_client_function_without_a_reason():
    """A function over LONG_FUNCTION lines says why in a comment on its first line
    (``# long: ...``)."""
    long = []
    for rel, text in _client_sources():
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > LONG_FUNCTION and "# long:" not in lines[node.lineno - 1]:
                    long.append(f"{rel}:{node.lineno}: {node.name} ({length} lines)")
    assert not long, "functions too long, with no reason given:\n" + "\n".join(long)


def _page_misses(section: str, root: Path, layers: list[str], prose: tuple[str, ...] = ()) -> list[str]:
    """The layers' rows in a section of docs/design/architecture.md that are missing or do
    not name each of their files (a layer in ``prose`` has its files named in the text)."""
    page = (REPO / "docs" / "design" / "architecture.md").read_text()
    page = page.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in page.splitlines()
            if line.startswith("| `") and "|" in line[1:]}
    missing = []
    for layer in layers:
        path = root / layer
        if not path.is_dir():
            if not any(f"`{layer}.py`" in key for key in rows):
                missing.append(f"{layer}.py")
            continue
        row = rows.get(f"`{layer}/`")
        if row is None:
            missing.append(f"{layer}/")
            continue
        if layer in prose:
            row = page
        missing += [f"{layer}/{f.name}" for f in sorted(path.glob("*.py"))
                    if f.name != "__init__.py" and f"`{f.name}`" not in row]
    return missing


def test_no_long_file_without_a_reason():
    """A file past LONG_FILE lines is split by what it does, or says why not in its first
    lines (its docstring: "Past ~500 lines on purpose")."""
    long = []
    for path in sorted(_sources().values()):
        rel = path.relative_to(REPO).as_posix()
        lines = path.read_text().splitlines()
        head = "\n".join(lines[:150])
        if len(lines) > LONG_FILE and "DO NOT EDIT" not in lines[0] and \
                "Past ~500 lines on purpose" not in head:
            long.append(f"{rel} ({len(lines)} lines)")
    assert not long, "files too long, with no reason given:\n" + "\n".join(long)


def test_the_architecture_page_names_every_client_part():
    """docs/design/architecture.md gives each client layer its row, naming each of its files."""
    missing = _page_misses("The client", CLIENT, LAYERS, prose=("sizing",))  # (sizing's files: the paragraph after the table)
    assert not missing, f"docs/design/architecture.md does not describe: {missing}"


def test_the_architecture_page_names_every_daemon_part():
    """... and each of the daemon's, in "The daemon"."""
    missing = _page_misses("The daemon", DAEMON, DAEMON_LAYERS)
    assert not missing, f"docs/design/architecture.md does not describe: {missing}"


def test_no_package_face_hides_one_of_its_modules():
    """A name a package's __init__ exports is not also one of its modules' names (``from
    package import name`` would give one or the other depending on what ran first);
    engine's ``attach`` aside: the function is the module's one public name, as before."""
    hidden = []
    for init in CLIENT.rglob("__init__.py"):
        package = init.parent.relative_to(CLIENT).as_posix()
        dotted = module_name(CLIENT, "fuyou_client", init)
        modules = {p.stem for p in init.parent.glob("*.py")} | {p.name for p in init.parent.iterdir() if p.is_dir()}
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module != dotted:  # (not ``from package import module``)
                hidden += [f"{package}: {a.asname or a.name}" for a in node.names
                           if (a.asname or a.name) in modules and (package, a.asname or a.name) != ("engine", "attach")]
    assert not hidden, f"names that hide a module of their package: {hidden}"


def test_the_wheel_holds_every_package_and_deploy_file():
    """pyproject.toml finds the packages: every directory of .py files in them is a package
    (a folder without __init__.py would be left out of a wheel), and every file under
    deploy/ that the docs tell operators to use is among the data files."""
    import tomllib

    from setuptools import find_packages

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for where in project["packages"]["find"]["where"]:
        found |= set(find_packages(where=str(REPO / where), include=project["packages"]["find"]["include"]))
    for package, root in PACKAGES.items():
        for d in {p.parent for p in root.rglob("*.py") if "__pycache__" not in p.parts}:
            name = ".".join([package, *d.relative_to(root).parts])
            assert name in found, f"{name} is not in the wheel (no __init__.py?)"
    shipped = {f for files in project["data-files"].values() for f in files}
    wanted = {str(p.relative_to(REPO)) for p in (REPO / "deploy").rglob("*") if p.is_file()}
    assert wanted <= shipped, f"deploy files missing from the wheel: {sorted(wanted - shipped)}"
