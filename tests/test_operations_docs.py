"""The operator's documentation names only what exists: every shipped alert has a
runbook its annotation points at, every `fuyouctl` command the docs quote is one the
CLI parses, every config key they name is a key of the config, and every link to a
heading of these pages finds it. Reads files and builds the CLI's parser: no daemon."""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from fuyoud import config as config_mod
from fuyouctl import cli as ctl

REPO = Path(__file__).resolve().parent.parent
OPS = REPO / "docs" / "operations.md"
RUNBOOKS = REPO / "docs" / "operations-runbooks.md"
PAGES = [OPS, RUNBOOKS]
ALERTS = REPO / "deploy" / "fuyoud-alerts.yml"

CODE_BLOCK = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
INLINE = re.compile(r"`([^`]+)`")
FUYOUCTL = re.compile(r"(?:^|[\s/'])fuyouctl((?:[ \t]+[^\s`'|;&#]+)*)")
# fuyouctl's own options that take a value (the word after them is not the subcommand)
GLOBAL_WITH_VALUE = {o for a in ctl.parser(plan=False)._actions if a.option_strings and a.nargs != 0 for o in a.option_strings}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> dict[str, str]:
    """Anchor -> heading text, outside code blocks (repeated anchors get -1, -2...)."""
    text = CODE_BLOCK.sub("", path.read_text())
    anchors: dict[str, str] = {}
    for m in re.finditer(r"^#{1,6} (.+)$", text, re.M):
        base = slug(m.group(1))
        anchor, n = base, 0
        while anchor in anchors:
            n += 1
            anchor = f"{base}-{n}"
        anchors[anchor] = m.group(1).strip()
    return anchors


def code_texts(path: Path) -> list[str]:
    """What the page shows as code: fenced blocks, then inline spans outside them."""
    text = path.read_text()
    blocks = [m.group(1) for m in CODE_BLOCK.finditer(text)]
    return blocks + [" ".join(span.split()) for span in INLINE.findall(CODE_BLOCK.sub("", text))]


def alert_rules() -> list[dict]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"] if "alert" in rule]


# -- (a) every alert has a runbook, and its annotation points at it -----------------------------
def test_the_alert_file_has_alerts():
    assert len(alert_rules()) >= 5


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda r: r["alert"])
def test_every_alert_has_a_runbook_its_annotation_points_at(rule):
    name = rule["alert"]
    url = rule.get("annotations", {}).get("runbook_url")
    assert url, f"{name} has no runbook_url annotation"
    path, _, anchor = url.partition("#")
    target = REPO / path
    assert target in PAGES, f"{name}'s runbook_url names {path}, not an operations page"
    anchors = headings(target)
    assert anchor in anchors, f"{name}'s runbook_url anchor #{anchor} is no heading of {path}"
    assert anchors[anchor] == name, f"{name}'s runbook_url points at the section {anchors[anchor]!r}"


def test_every_runbook_is_of_a_shipped_alert():
    names = {r["alert"] for r in alert_rules()}
    sections = {h for h in headings(RUNBOOKS).values() if h.startswith("Fuyoud")}
    assert sections == names


# -- (b) every fuyouctl command quoted exists --------------------------------------------------
def quoted_commands() -> list[tuple[str, list[str]]]:
    """(page, the words after `fuyouctl`) for every fuyouctl command shown as code."""
    found = []
    for path in PAGES:
        for code in code_texts(path):
            for line in code.splitlines():
                for m in FUYOUCTL.finditer(line):
                    words = m.group(1).replace("...", "").split()
                    if words:
                        found.append((path.name, words))
    return found


def split_command(words: list[str]) -> tuple[list[str], str | None, list[str]]:
    """(fuyouctl's own options, the subcommand or None, the options given after it)."""
    i, own = 0, []
    while i < len(words) and words[i].startswith("-"):
        own.append(words[i].split("=")[0])
        i += 1 + (words[i] in GLOBAL_WITH_VALUE and "=" not in words[i])
    if i >= len(words):
        return own, None, []
    return own, words[i], [w.split("=")[0] for w in words[i + 1:] if w.startswith("--")]


def test_the_docs_quote_fuyouctl_commands():
    subcommands = {split_command(words)[1] for _, words in quoted_commands()}
    assert {"status", "sessions", "drain", "checkpoint", "health", "plan"} <= subcommands


def test_every_quoted_fuyouctl_command_and_option_exists():
    parser = ctl.parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    global_options = {o for a in parser._actions for o in a.option_strings}
    for page, words in quoted_commands():
        own, command, options = split_command(words)
        quoted = f"{page} quotes `fuyouctl {' '.join(words)}`"
        assert set(own) <= global_options, f"{quoted}: fuyouctl has no {sorted(set(own) - global_options)}"
        if command is None:
            continue
        assert command in commands, f"{quoted}: no command {command!r}"
        known = {o for a in commands[command]._actions for o in a.option_strings}
        for option in options:
            assert option in known, f"{quoted}: {command} has no {option}"


# -- (c) every config key named exists -----------------------------------------------------------
SECTIONS = {f.name: f.type for f in dataclasses.fields(config_mod.Config)}


def config_keys() -> dict[str, str]:
    """`section.key` -> page, for `[section] key` and `section.key` in backticks."""
    keys = {}
    for path in PAGES:
        text = path.read_text()
        for m in re.finditer(r"`\[(\w+)\]\s+(\w+)", text):
            keys[f"{m.group(1)}.{m.group(2)}"] = path.name
        for m in re.finditer(r"`(\w+)\.(\w+)`", text):
            if m.group(1) in SECTIONS:
                keys[f"{m.group(1)}.{m.group(2)}"] = path.name
    return keys


def section_fields(name: str) -> set[str]:
    cls = SECTIONS[name]
    cls = getattr(config_mod, cls) if isinstance(cls, str) else cls
    return {f.name for f in dataclasses.fields(cls)}


def test_the_docs_name_config_keys():
    assert {"metrics.listen", "memory.pinned_budget", "storage.data_dirs"} <= set(config_keys())


def test_every_config_key_named_exists():
    for key, page in sorted(config_keys().items()):
        section, name = key.split(".")
        assert section in SECTIONS, f"{page} names [{section}] {name}: no section [{section}]"
        assert name in section_fields(section), f"{page} names [{section}] {name}: no such key"


# -- links to headings ---------------------------------------------------------------------------
@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_links_to_headings_of_these_pages_resolve(path):
    text = CODE_BLOCK.sub("", path.read_text())
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
        page = (path.parent / target).resolve() if target else path
        if page not in PAGES:
            continue
        assert anchor in headings(page), f"{path.name} links to {target}#{anchor}, no such heading"
