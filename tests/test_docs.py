"""The documentation's Python examples cannot rot: every one compiles, and those marked
``<!-- test: run -->`` run, as a user would paste them, against a private daemon with
small limits (the one seam: ``start_daemon`` gets small data files, where the docs' call
would preallocate 16 GiB), a tiny GPT-2 as ``model`` and a few batches as ``data``.
Links between the documents point at files that exist."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(<!-- test: run -->\n)?```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")

PRELUDE = textwrap.dedent("""
    import torch, transformers, fuyou_client
    _start = fuyou_client.start_daemon
    def _small(state_dir=None, config=None, **kw):
        small = {"storage": {"capacity_per_device": "512MiB"}, "memory": {"pinned_budget": "768MiB"}}
        return _start(state_dir, config={**small, **(config or {})}, **kw)
    fuyou_client.start_daemon = _small
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32))
    data = [torch.randint(0, 256, (2, 16)) for _ in range(3)]
""")


def examples():
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(m.group(2), bool(m.group(1)), id=f"{path.relative_to(REPO)}:{line}")


@pytest.mark.parametrize("code, runs", list(examples()))
def test_the_examples_compile(code, runs):
    compile(code, "<doc>", "exec")


def marked_examples():
    """The examples marked to run: the first (the README's) in the default suite, the others,
    each a Python start, a daemon and a training run (about 15 s), with `-m slow`."""
    marked = [p for p in examples() if p.values[1]]
    return [pytest.param(p.values[0], id=p.id, marks=() if i == 0 else pytest.mark.slow) for i, p in enumerate(marked)]


@pytest.mark.parametrize("code", marked_examples())
def test_the_marked_examples_run(code, tmp_path):
    proc = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_there_are_examples_that_run():
    assert sum(1 for p in examples() if p.values[1]) >= 2


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_links_between_documents_resolve(path):
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to {target}, which does not exist"
