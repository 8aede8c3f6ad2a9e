"""Writes docs/reference.md from the code, so that the reference cannot drift from it:
``attach``'s options, the Engine's methods and properties, FuyouTrainer's and the
optimizers' arguments, fuyoud's config keys and the metrics it exports.

    python docs/gen_reference.py           # rewrites docs/reference.md
    python docs/gen_reference.py --check   # exits 1, with a diff, when the page is stale

Descriptions come from docstrings. A class whose fields are documented in its docstring
(``AttachOptions``, the config's sections, FuyouTrainer's arguments) has one entry per
field: a line that starts with the field's name in double backquotes and a colon, and the
lines after it. A field without an entry is an error, so is a public Engine method
without a docstring. FuyouTrainer is read from its source with ``ast`` (importing
transformers takes seconds); the metrics from a fresh registry and the collector run
over an empty daemon's snapshot.
"""
from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import difflib
import inspect
import re
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "docs" / "reference.md"
ENTRY = re.compile(r"``(\w+)``: ")
TRANSFORMERS = REPO / "client" / "fuyou_client" / "integrations" / "transformers.py"


# -- docstrings to Markdown -------------------------------------------------------------------
def join(lines: list[str]) -> str:
    """Lines of a docstring as one line of Markdown: ``code`` becomes `code`, a code span
    broken after a dot is joined without a space, ``<`` outside code is escaped."""
    text = ""
    for line in lines:
        line = line.strip()
        if text and not (text.count("``") % 2 and text.endswith(".")):
            text += " "
        text += line
    parts = text.replace("``", "`").split("`")
    return "`".join(p if i % 2 else p.replace("<", "\\<") for i, p in enumerate(parts))


def paragraphs(doc: str) -> list[list[str]]:
    """A docstring's paragraphs, each a list of lines (indentation kept)."""
    out: list[list[str]] = [[]]
    for line in inspect.cleandoc(doc).splitlines():
        if line.strip():
            out[-1].append(line)
        elif out[-1]:
            out.append([])
    return [p for p in out if p]


def first_paragraph(obj) -> str:
    doc = inspect.getdoc(obj)
    if not doc:
        raise SystemExit(f"{getattr(obj, '__qualname__', obj)} has no docstring: write one (docs/reference.md "
                         "is made from it)")
    return join(paragraphs(doc)[0])


def entries(doc: str, names) -> list[tuple[str, list[tuple[str, str]]]]:
    """A docstring that documents fields as (heading, [(field, text)]) per paragraph: an
    entry is a line starting with a field's name in double backquotes and a colon, and
    the lines after it; the lines before a paragraph's first entry are its heading."""
    groups: list[tuple[list[str], list[tuple[str, list[str]]]]] = []
    for para in paragraphs(doc):
        groups.append(([], []))
        for line in para:
            m = ENTRY.match(line.strip())
            if m and m.group(1) in names:
                groups[-1][1].append((m.group(1), [line.strip()[m.end():]]))
            elif groups[-1][1]:
                groups[-1][1][-1][1].append(line)
            else:
                groups[-1][0].append(line)
    return [(join(h), [(name, join(text)) for name, text in es]) for h, es in groups]


def documented(doc: str, names: list[str], owner: str) -> dict[str, str]:
    """Each of ``names`` -> its entry in ``doc``; an error naming those without one."""
    found = {name: text for _, es in entries(doc, names) for name, text in es}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"{owner}: no docstring entry for {', '.join(missing)}: add ``name``: description")
    return found


def bullet(name: str, default: str | None, text: str) -> str:
    where = f" (default: `{default}`)" if default is not None else ""
    return f"- **`{name}`**{where}: {text}"


def title_and_rest(heading: str) -> tuple[str, str]:
    """``Title: the rest.`` -> (``Title``, ``The rest.``)."""
    title, _, rest = heading.partition(":")
    rest = rest.strip()
    return title.strip(), rest[:1].upper() + rest[1:]


def plain_signature(fn, name: str, drop_self: bool = False) -> str:
    """``name(a, b=1, *c, **d)``: no annotations, as a call is written."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1 if drop_self else 0:]
    sig = sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in params],
                      return_annotation=inspect.Signature.empty)
    return f"{name}{sig}"


def field_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    return repr(f.default_factory())


# -- the client ------------------------------------------------------------------------------
def attach_section() -> list[str]:
    from fuyou_client.engine.attach import attach
    from fuyou_client.engine.options import AttachOptions
    fields = dataclasses.fields(AttachOptions)
    names = [f.name for f in fields]
    documented(AttachOptions.__doc__, names, "AttachOptions")
    out = ["## `fuyou_client.attach`", "", f"`{plain_signature(attach, 'attach')}` returns an `Engine`.", "",
           first_paragraph(attach), "", "The options are keyword arguments of `attach`; all but the last two "
           "(read by `attach` itself) are the fields of `fuyou_client.AttachOptions`.", ""]
    by_name = {f.name: f for f in fields}
    for heading, es in entries(AttachOptions.__doc__, names):
        if not es:
            continue
        title, rest = title_and_rest(heading)
        out += [f"### {title}", ""] + ([rest, ""] if rest else [])
        out += [bullet(name, field_default(by_name[name]), text) for name, text in es] + [""]
    out += ["### Read by `attach` itself", ""]
    out += [bullet(name, default, text) for name, default, text in attach_own_options(attach)] + [""]
    return out


def attach_own_options(attach) -> list[tuple[str, str, str]]:
    """The keyword options ``attach`` takes out of ``**options`` itself (``options.pop(name,
    default)``), each with the paragraph of attach's docstring that starts with its name
    and ``=``."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(attach).lstrip())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pop"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "options"):
            name = ast.literal_eval(node.args[0])
            default = ast.unparse(node.args[1]) if len(node.args) > 1 else None
            found.append((node.lineno, name, default))
    out = []
    for _, name, default in sorted(found):
        paras = [p for p in paragraphs(attach.__doc__) if p[0].startswith(f"``{name}=``: ")]
        if not paras:
            raise SystemExit(f"attach: its docstring has no ``{name}=``: paragraph")
        out.append((name, default, join(paras[0])[len(f"`{name}=`: "):]))
    return out


def engine_section() -> list[str]:
    from fuyou_client.engine.engine import Engine
    out = ["## `Engine`", "", "What `attach` returns. `with attach(...) as engine:` closes it at the end.", "",
           "### Attributes", ""]
    init = ast.parse(inspect.getsource(Engine.__init__).strip())  # (its self.name = ...)
    names = [n for n in vars(Engine) if not n.startswith("_")]
    targets = [t for node in ast.walk(init) if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    names += [t.attr for target in targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
              if isinstance(t, ast.Attribute) and not t.attr.startswith("_")]
    for _, es in entries(Engine.__doc__, names):  # (the attributes the docstring gives an entry)
        out += [bullet(f"engine.{name}", None, text) for name, text in es]
    out += ["", "### Methods and properties", ""]
    for name, member in vars(Engine).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            returns = inspect.signature(member.fget).return_annotation
            kind = f" → `{returns}`" if returns is not inspect.Signature.empty else ""
            settable = " (settable)" if member.fset is not None else ""
            out.append(f"- **`engine.{name}`**{kind}{settable}: {first_paragraph(member)}")
        elif inspect.isfunction(member):
            out.append(f"- **`engine.{plain_signature(member, name, drop_self=True)}`**: {first_paragraph(member)}")
    return out + [""]


def trainer_section() -> list[str]:
    """FuyouTrainer, from its source (ast): its own arguments, the Trainer's it reads."""
    tree = ast.parse(TRANSFORMERS.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FuyouTrainer")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    own = [(a.arg, ast.unparse(d)) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults)]
    doc = ast.get_docstring(cls)
    texts = documented(doc, [name for name, _ in own], "FuyouTrainer")
    call = ", ".join(["*args", *(f"{n}={d}" for n, d in own), "**kwargs"])
    out = ["## `FuyouTrainer`", "", "`from fuyou_client.integrations.transformers import FuyouTrainer`", "",
           f"`FuyouTrainer({call})`: {join(paragraphs(doc)[0])}", ""]
    out += [bullet(name, default, texts[name]) for name, default in own] + [""]
    decided = next(ast.literal_eval(n.value) for n in tree.body
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "DECIDED")
    out += ["`fuyou=` may not set these options, which the Trainer's arguments decide: "
            + ", ".join(f"`{k}` ({why})" for k, why in decided.items()) + ".", ""]
    for para in paragraphs(ast.get_docstring(tree))[1:]:
        if para[0].startswith(" "):
            continue  # (the example)
        if para[0].startswith("* "):
            items: list[list[str]] = []
            for line in para:
                items.append([line[2:]]) if line.startswith("* ") else items[-1].append(line)
            out += [f"- {join(item)}" for item in items] + [""]
        else:
            out += [join(para), ""]
    return out


def optimizer_section() -> list[str]:
    from fuyou_client.optim import SGD, AdamW
    out = ["## `AdamW` and `SGD`", ""]
    for cls in (AdamW, SGD):
        call = ", ".join(f"{f.name}={field_default(f)}" for f in dataclasses.fields(cls))
        out += [f"### `fuyou_client.{cls.__name__}({call})`", ""]
        for para in paragraphs(cls.__doc__):
            out += [join(para), ""]
    return out


def serve_section() -> list[str]:
    """serve_optimizer: the optimizer ranks' call (docs/guide/optimizer-host.md)."""
    from fuyou_client.engine.serve import serve_optimizer
    out = ["## `fuyou_client.serve_optimizer`", "", f"`{plain_signature(serve_optimizer, 'serve_optimizer')}` "
           "returns a `Served` (the commands it served, by kind, and the group steps).", ""]
    for para in paragraphs(serve_optimizer.__doc__):
        out += [join(para), ""]
    return out


# -- fuyoud --------------------------------------------------------------------------------
def toml_value(key: str, value, size_keys, auto_zero) -> str:
    """A default as it is written in fuyoud.toml: sizes with a unit, "auto" for 0 where
    that is what "auto" means."""
    if key in auto_zero and value == 0:
        return '"auto"'
    if key in size_keys and value:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value % (1 << shift) == 0:
                return f'"{value >> shift}{unit}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if key == "daemon.socket_mode":
        return oct(value)
    return repr(value)


def config_default(key: str, f: dataclasses.Field, size_keys, auto_zero) -> str:
    """A field's default; one computed on the host where the daemon runs is the first
    sentence of its default factory's docstring."""
    if f.default is not dataclasses.MISSING:
        return f"`{toml_value(key, f.default, size_keys, auto_zero)}`"
    if f.default_factory is list:
        return "`[]`"
    text = first_paragraph(f.default_factory).split(". ")[0].rstrip(".")
    return text[:1].lower() + text[1:]


def config_section() -> list[str]:
    from fuyoud import config
    out = ["## fuyoud's config", "", "A TOML file, `fuyoud --config FILE`; every key is optional. "
           "`fuyoud --config FILE --check-config` checks one. Sizes take bytes or units: `4096`, `\"64MiB\"`, "
           "`\"2GiB\"`, `\"1.5TB\"`. `deploy/fuyoud.toml` is a sample with every key.", ""]
    for section in dataclasses.fields(config.Config):
        cls = section.default_factory
        fields = dataclasses.fields(cls)
        texts = documented(cls.__doc__, [f.name for f in fields], cls.__name__)
        heading = entries(cls.__doc__, texts)
        title, rest = title_and_rest(heading[0][0])
        out += [f"### `{title}`", "", rest, ""]
        out += [f"{h}" for h, _ in heading[1:] if h] + ([""] if any(h for h, _ in heading[1:]) else [])
        for f in fields:
            key = f"{section.name}.{f.name}"
            default = config_default(key, f, config._SIZE_KEYS, config._AUTO_ZERO)
            out.append(f"- **`{f.name}`** (default: {default}): {texts[f.name]}")
        out.append("")
    return out


def zero(cls):
    """An instance of dataclass ``cls`` with every field empty: what the metrics collector
    reads from a daemon with nothing in it."""
    values = {}
    for name, hint in typing.get_type_hints(cls).items():
        origin = typing.get_origin(hint) or hint
        if dataclasses.is_dataclass(origin):
            values[name] = zero(origin)
        elif origin is dict:
            values[name] = collections.defaultdict(int)
        else:
            values[name] = origin()
    return cls(**values)


def metrics_section() -> list[str]:
    from prometheus_client.metrics import MetricWrapperBase

    from fuyoud.operations import metrics as m
    from fuyoud.operations.snapshot import Snapshot
    families = []
    for wrapper in vars(m.Metrics()).values():
        if isinstance(wrapper, MetricWrapperBase):
            families += [(family, wrapper._labelnames) for family in wrapper.describe()]
    families += [(family, family._labelnames) for family in m._DaemonCollector(lambda: zero(Snapshot)).collect()]
    suffix = {"counter": "_total", "info": "_info"}  # (what a scrape shows; a histogram's series follow)
    out = ["## fuyoud's metrics", "", "Served at `[metrics] listen` (`/metrics`), in the Prometheus text format.", ""]
    for family, labels in families:
        name = f"`{family.name}{suffix.get(family.type, '')}`"
        if family.type == "histogram":
            name += " (`_bucket`, `_sum`, `_count`)"
        by = f", by {', '.join(f'`{label}`' for label in labels)}" if labels else ""
        out.append(f"- **{name}** ({family.type}{by}): {join([family.documentation])}.")
    return out + [""]


# -- the page --------------------------------------------------------------------------------
def render() -> str:
    """docs/reference.md as the code says it now."""
    lines = ["# Reference", "",
             "What each option, method, config key and metric is. This page is generated from the code's "
             "docstrings by `docs/gen_reference.py`, and a test fails when it differs from them: edit the "
             "docstring, then run `python docs/gen_reference.py`.", "",
             "[`attach`](#fuyou_clientattach) · [`Engine`](#engine) · [`FuyouTrainer`](#fuyoutrainer) · "
             "[`AdamW` and `SGD`](#adamw-and-sgd) · [`serve_optimizer`](#fuyou_clientserve_optimizer) · "
             "[fuyoud's config](#fuyouds-config) · "
             "[fuyoud's metrics](#fuyouds-metrics)", ""]
    for section in (attach_section, engine_section, trainer_section, optimizer_section, serve_section,
                    config_section, metrics_section):
        lines += section()
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None, path: Path = REFERENCE) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1, with a diff, if the page differs")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        path.write_text(text)
        return 0
    old = path.read_text() if path.exists() else ""
    if old == text:
        return 0
    sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                               f"{path.name} (committed)", f"{path.name} (from the code)"))
    print(f"\n{path} is stale: run python docs/gen_reference.py", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
