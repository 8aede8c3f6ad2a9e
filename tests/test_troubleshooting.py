"""The troubleshooting page quotes only messages the code can emit, and the migration page
names only options that exist.

docs/guide/troubleshooting.md quotes each error on a line ``> error: `TEXT` ``. TEXT is a
message's fixed text or a literal fragment of it (at least 25 characters where the
message has values in it). Every TEXT must occur in the string literals of fuyoud/,
client/fuyou_client/ or proto/, read with ``ast``: implicitly joined literals are one
string there already, literals joined with ``+`` are joined here, and an f-string's
placeholders split it into its literal runs. Whitespace is normalised on both sides.

docs/guide/migrating.md names attach's options as ``attach(NAME=...)``, fuyoud.toml's keys
as ``[section] key`` and the optimizer's as ``AdamW(NAME=...)``; each must exist.
Reads files only (no daemon, no torch): it runs in about a second."""
from __future__ import annotations

import ast
import dataclasses
import re
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "guide" / "troubleshooting.md"
MIGRATING = REPO / "docs" / "guide" / "migrating.md"
SOURCES = [REPO / "fuyoud", REPO / "client" / "fuyou_client", REPO / "proto"]
QUOTE = re.compile(r"^> error: `(?P<text>[^`]+)`\s*$", re.M)
SHORTEST_FRAGMENT = 25


def normal(text: str) -> str:
    return " ".join(text.split())


def _parts(node: ast.AST):
    """The pieces of a string expression, in order: str for literal text, None where a
    value goes in (a placeholder, a call, a conditional: anything not a literal)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.JoinedStr):
        for value in node.values:
            yield value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else None
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        yield from _parts(node.left)
        yield from _parts(node.right)
    else:
        yield None


def _runs(node: ast.AST) -> list[str]:
    """The literal runs of a string expression: adjacent literal pieces joined."""
    runs, current = [], []
    for part in _parts(node):
        if part is None:
            if current:
                runs.append("".join(current))
            current = []
        else:
            current.append(part)
    if current:
        runs.append("".join(current))
    return runs


@lru_cache(maxsize=1)
def literals() -> tuple[frozenset[str], tuple[str, ...]]:
    """(whole messages: string constants with no value in them, every literal run)."""
    whole, runs = set(), set()
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    whole.add(normal(node.value))
                    runs.add(normal(node.value))
                elif isinstance(node, (ast.JoinedStr, ast.BinOp)):
                    runs.update(normal(r) for r in _runs(node))
                    if isinstance(node, ast.BinOp) and None not in _parts(node):
                        whole.add(normal("".join(_parts(node))))
    return frozenset(whole), tuple(runs)


def quoted() -> list[str]:
    return [m.group("text") for m in QUOTE.finditer(PAGE.read_text())]


def test_the_page_quotes_at_least_ten_errors():
    assert len(quoted()) >= 10, quoted()


@pytest.mark.parametrize("text", quoted())
def test_a_quoted_message_is_one_the_code_emits(text):
    want = normal(text)
    whole, runs = literals()
    assert want in whole or len(want) >= SHORTEST_FRAGMENT, \
        f"{text!r}: quote a message's whole fixed text, or a fragment of at least {SHORTEST_FRAGMENT} characters"
    assert any(want in run for run in runs), \
        f"{text!r} is not in the string literals of {', '.join(str(s.relative_to(REPO)) for s in SOURCES)}"


def test_every_quoted_error_has_its_cause_and_fix():
    """Each section that quotes an error says why it happens and what to do."""
    sections = re.split(r"^#{2,3} ", PAGE.read_text(), flags=re.M)[1:]
    for section in sections:
        if QUOTE.search(section):
            title = section.splitlines()[0]
            assert "**Cause.**" in section and "**Fix.**" in section, title


def test_the_check_itself_catches_a_message_the_code_cannot_emit():
    whole, runs = literals()
    assert not any("this model fits comfortably in the pinned budget" in r for r in runs)
    # an f-string split over lines, and a message joined with +, are found whole
    assert any("this model does not fit the session's pinned-memory budget: the smallest plan takes" in r
               for r in runs)
    assert any("; bf16 weights halve the blocks' buffers." in r for r in runs)


# -- the migration page ------------------------------------------------------------------------
def _fields(path: Path, cls: str) -> set[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_the_migration_page_names_options_that_exist():
    import fuyoud.config as config

    text = MIGRATING.read_text()
    attach = _fields(REPO / "client" / "fuyou_client" / "engine" / "options.py", "AttachOptions") | {"plan", "options"}
    adamw = _fields(REPO / "client" / "fuyou_client" / "optim.py", "AdamW")
    sections = {f.name: {g.name for g in dataclasses.fields(f.default_factory())}
                for f in dataclasses.fields(config.Config)}
    named = re.findall(r"attach\(([a-z_]+)=", text)
    assert len(named) >= 8, named
    for name in named:
        assert name in attach, f"attach({name}=...) is not an option of attach"
    for name in re.findall(r"AdamW\(([a-z_]+)=", text):
        assert name in adamw, f"AdamW({name}=...) is not a field of AdamW"
    keys = re.findall(r"\[([a-z]+)\] ([a-z_]+)", text)
    assert len(keys) >= 6, keys
    for section, key in keys:
        assert section in sections and key in sections[section], f"[{section}] {key} is not a key of fuyoud.toml"
