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
Reads files and the option classes (no daemon): it runs in a few seconds."""
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
            # (a constant inside an f-string or a + chain is a piece of a message, not a whole one)
            inner = {id(v) for n in ast.walk(tree) if isinstance(n, (ast.JoinedStr, ast.BinOp))
                     for v in ast.walk(n) if v is not n}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if id(node) not in inner:
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


def problem(text: str) -> str | None:
    """Why ``text`` may not be quoted as an error, or None."""
    want = normal(text)
    whole, runs = literals()
    if want not in whole and len(want) < SHORTEST_FRAGMENT:
        return f"{text!r}: quote a message's whole fixed text, or a fragment of at least {SHORTEST_FRAGMENT} characters"
    if not any(want in run for run in runs):
        return f"{text!r} is not in the string literals of {', '.join(str(s.relative_to(REPO)) for s in SOURCES)}"
    return None


@pytest.mark.parametrize("text", quoted())
def test_a_quoted_message_is_one_the_code_emits(text):
    assert problem(text) is None, problem(text)


def test_every_quoted_error_has_its_cause_and_fix():
    """Each section that quotes an error says why it happens and what to do."""
    sections = re.split(r"^#{2,3} ", PAGE.read_text(), flags=re.M)[1:]
    for section in sections:
        if QUOTE.search(section):
            title = section.splitlines()[0]
            assert "**Cause.**" in section and "**Fix.**" in section, title


def test_the_check_itself_catches_a_message_the_code_cannot_emit():
    assert "not in the string literals" in problem("this model fits comfortably in the pinned budget")
    # a short piece of an f-string ("unknown optimizer {...} (adamw or sgd)") is not a whole message
    assert "at least 25 characters" in problem("unknown optimizer")
    whole, runs = literals()
    # an f-string split over lines, and a message joined with +, are found whole
    assert any("this model does not fit the session's pinned-memory budget: the smallest plan takes" in r
               for r in runs)
    assert any("; bf16 weights halve the blocks' buffers." in r for r in runs)


# -- the migration page ------------------------------------------------------------------------
def _keywords(text: str, call: str) -> list[str]:
    """Every NAME= given to ``call(...)`` itself on the page, wherever it stands in the call
    (not those of calls nested in it)."""
    names = []
    for m in re.finditer(rf"\b{call}\(", text):
        depth, top = 1, []
        for ch in text[m.end():m.end() + 1000]:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
            top.append(ch if depth == 1 else " ")
        names += re.findall(r"\b([a-z_]+)=", "".join(top))
    return names


def test_the_migration_page_names_options_that_exist():
    import fuyou_client
    import fuyoud.config as config

    text = MIGRATING.read_text()
    attach = {f.name for f in dataclasses.fields(fuyou_client.AttachOptions)} | {"plan", "options"}
    adamw = {f.name for f in dataclasses.fields(fuyou_client.AdamW)}
    sections = {f.name: {g.name for g in dataclasses.fields(f.default_factory())}
                for f in dataclasses.fields(config.Config)}
    named = _keywords(text, "attach")
    assert len(named) >= 8, named
    for name in named:
        assert name in attach, f"attach({name}=...) is not an option of attach"
    for name in _keywords(text, "AdamW"):
        assert name in adamw, f"AdamW({name}=...) is not a field of AdamW"
    keys = re.findall(r"\[([a-z]+)\] ([a-z_]+)", text)
    assert len(keys) >= 6, keys
    for section, key in keys:
        assert section in sections and key in sections[section], f"[{section}] {key} is not a key of fuyoud.toml"
