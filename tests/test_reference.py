"""docs/reference.md is what docs/gen_reference.py makes from the code now: an option,
method, config key or metric added without a docstring entry, or a docstring changed
without regenerating the page, fails here."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "docs" / "reference.md"


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def page(gen) -> str:
    return gen.render()


def section(page: str, heading: str) -> str:
    start = page.index(f"\n{heading}\n")
    end = page.find("\n## ", start + 1)
    return page[start:end if end >= 0 else len(page)]


def test_the_committed_page_is_what_the_code_says(page):
    assert REFERENCE.read_text() == page, "docs/reference.md is stale: run python docs/gen_reference.py"


def test_every_attach_option_is_there(page):
    from fuyou_client import AttachOptions
    text = section(page, "## `fuyou_client.attach`")
    for name in [f.name for f in dataclasses.fields(AttachOptions)] + ["plan", "options"]:
        assert re.search(rf"^- \*\*`{name}`\*\* \(default: `[^`]*`\): \S", text, re.M), name


def test_every_config_key_is_there_with_its_meaning(page):
    from fuyoud.config import Config
    text = section(page, "## fuyoud's config")
    for sec in dataclasses.fields(Config):
        part = text[text.index(f"### `[{sec.name}]`"):]
        part = part[:part.find("\n### ", 1) if "\n### " in part[1:] else len(part)]
        for f in dataclasses.fields(sec.default_factory):
            assert re.search(rf"^- \*\*`{f.name}`\*\* \(default: [^)]+\): \S", part, re.M), f"{sec.name}.{f.name}"


def test_every_public_engine_method_and_property_is_there(page):
    from fuyou_client import Engine
    text = section(page, "## `Engine`")
    for name, member in vars(Engine).items():
        if not name.startswith("_") and (callable(member) or isinstance(member, property)):
            assert f"**`engine.{name}" in text, name


def test_a_missing_entry_is_an_error(gen):
    doc = """Options.

      ``a``: the first.
    """
    assert gen.documented(doc, ["a"], "X") == {"a": "the first."}
    with pytest.raises(SystemExit, match="no docstring entry for b"):
        gen.documented(doc, ["a", "b"], "X")


def test_check_exits_1_with_a_diff_on_a_stale_page(gen, page, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gen, "render", lambda: page)  # (rendered once, above)
    stale = tmp_path / "reference.md"
    stale.write_text(page.replace("## fuyoud's metrics", "## metrics"))
    assert gen.main(["--check"], path=stale) == 1
    assert "+## fuyoud's metrics" in capsys.readouterr().out
    assert gen.main([], path=stale) == 0
    assert gen.main(["--check"], path=stale) == 0
