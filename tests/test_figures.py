"""The documentation's figures against the committed result files they come from.

Convention: a figure taken from a result file is followed, on the same line, by

    <!-- figure: bench/results/FILE.json dotted.key[.0.key] [*N | /N] -->

The test reads that key of that file (list indices allowed; an optional factor, ``*100``
for a percentage or ``/1073741824`` for GiB), rounds it to as many decimals as the number
just before the marker is written with, and asserts the two are equal. Every result file
named so must carry, inside it, the command that wrote it, its host and its date.

A second check: no command quoted in README.md or docs/**/*.md writes into bench/results/
(``--json PATH``, ``--out PATH``, ``> PATH``), so that running a documented command never
overwrites a committed result that a page or a test depends on. Documented commands
write under .fuyou/ (git-ignored).
"""
from __future__ import annotations

import json
import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

MARKER = re.compile(r"<!--\s*figure:\s*(\S+)\s+(\S+)(?:\s+([*/])\s*([0-9.eE+-]+))?\s*-->")
# the last number before the marker: digits with optional thousands commas and decimals
NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")


def _figures():
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for m in MARKER.finditer(line):
                yield doc, lineno, line, m


FIGURES = list(_figures())


def _lookup(data, key: str):
    for part in key.split("."):
        if isinstance(data, list):
            data = data[int(part)]
        else:
            data = data[part]
    return data


def _doc_number(line: str, marker_start: int) -> str:
    before = line[:marker_start]
    # stop at the previous marker, so that each number has its own
    prev = before.rfind("-->")
    if prev >= 0:
        before = before[prev + 3:]
    numbers = NUMBER.findall(before)
    assert numbers, f"no number before the marker in: {line.strip()}"
    return numbers[-1]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_figure_marker_is_one_the_check_reads(doc):
    """A marker the check cannot parse (one split across lines among them) would be skipped
    without a word: every marker opened must be one the check, reading line by line, found."""
    opened = len(re.findall(r"<!--\s*figure", doc.read_text()))
    assert opened == sum(1 for d, *_ in FIGURES if d == doc), doc.name


def test_the_docs_carry_figure_markers():
    """The convention is in use: the main pages name the result files their figures come from."""
    docs = {doc.name for doc, *_ in FIGURES}
    assert "README.md" in docs and "performance.md" in docs


def _check(doc, lineno, line, m) -> str | None:
    path, key, op, factor = m.groups()
    where = f"{doc.relative_to(ROOT)}:{lineno}"
    result = ROOT / path
    if not path.startswith("bench/results/") or not result.is_file():
        return f"{where}: {path} is not a committed file under bench/results/"
    try:
        value = _lookup(json.loads(result.read_text()), key)
    except (KeyError, IndexError, ValueError):
        return f"{where}: {path} has no {key}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"{where}: {path} {key} is {value!r}, not a number"
    value = Decimal(repr(value))
    if op == "*":
        value *= Decimal(factor)
    elif op == "/":
        value /= Decimal(factor)
    written = _doc_number(line, m.start())
    shown = Decimal(written.replace(",", ""))
    places = Decimal(1).scaleb(shown.as_tuple().exponent)
    # rounded as the doc rounds it; a value exactly halfway may be written either way
    accepted = {value.quantize(places, rounding=ROUND_HALF_UP), value.quantize(places, rounding=ROUND_HALF_EVEN)}
    if shown not in accepted:
        return f"{where} says {written}; {path} {key} is {value} ({sorted(accepted)[0]} as the doc rounds)"
    return None


MARKED_DOCS = sorted({doc for doc, *_ in FIGURES})


@pytest.mark.parametrize("doc", MARKED_DOCS, ids=[str(d.relative_to(ROOT)) for d in MARKED_DOCS])
def test_figures_equal_their_result_files(doc):
    wrong = [msg for d, lineno, line, m in FIGURES if d == doc and (msg := _check(d, lineno, line, m))]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", sorted({m.group(1) for *_, m in FIGURES}))
def test_result_file_says_how_where_and_when(path):
    data = json.loads((ROOT / path).read_text())
    for field in ("command", "host", "date"):
        assert data.get(field), f"{path} has no {field!r}"


FENCE = re.compile(r"^(```|~~~)")
WRITES = re.compile(r"(?:--json|--out|--output|-o)[ =]+(\S+)|>>?\s*(\S+)")


def _quoted_commands(text: str):
    """Fenced blocks, indented blocks and inline code spans: what a reader copies."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            lines.append(line)
        else:
            lines.extend(re.findall(r"`([^`]+)`", line))
    # join continuation lines
    joined, cur = [], ""
    for line in lines:
        cur += line.rstrip("\\").rstrip() + " "
        if not line.rstrip().endswith("\\"):
            joined.append(cur)
            cur = ""
    return joined + ([cur] if cur else [])


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_no_documented_command_writes_into_bench_results(doc):
    bad = []
    for cmd in _quoted_commands(doc.read_text()):
        if "bench/" not in cmd and "fuyou" not in cmd:
            continue
        for m in WRITES.finditer(cmd):
            target = m.group(1) or m.group(2)
            if "bench/results" in target:
                bad.append(cmd.strip())
    assert not bad, f"{doc.relative_to(ROOT)}: commands writing into bench/results/: {bad}"


def test_bench_scripts_default_outside_bench_results():
    """No benchmark writes into bench/results/ unless told to."""
    for script in sorted((ROOT / "bench").glob("*.py")):
        text = script.read_text()
        for m in re.finditer(r"default\s*=\s*([^,)]*)", text):
            assert "bench/results" not in m.group(1) and '"results"' not in m.group(1), (script.name, m.group(0))
        assert not re.search(r'or\s+\w+(?:\.parent)?\s*(?:/\s*"bench"\s*)?/\s*"results"', text), script.name
