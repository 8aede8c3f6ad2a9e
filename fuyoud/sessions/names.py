"""The rules for names a client sends (object names, namespaces) and how a refused value is
echoed: lengths are checked before patterns, and an error quotes at most a short prefix
of what it refuses (a 100 KB name must not become a 100 KB error message, which gRPC
would drop as too large)."""
from __future__ import annotations

import re

from fuyoud.errors import InvalidArgument

MAX_NAME = 512  # characters of an object name
MAX_NAMESPACE = 128  # characters of a namespace
ECHO = 64  # characters of a refused value quoted in an error

NAME_RE = re.compile(r"^[^\x00-\x1f/][^\x00-\x1f]*$")
NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# A data-parallel rank's namespace: fuyou_client's attach opens one session per rank as
# "<job>.r<rank>" (e.g. "dp-1a2b3c4d.r0", "myjob.r3").
RANK_NAMESPACE_RE = re.compile(r"^(?P<job>.+)\.r(?P<rank>0|[1-9][0-9]*)$")


def shown(value: object, limit: int = ECHO) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length noted."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, (str, bytes)) else f"{len(text)} characters shown"
    return f"{text[:limit]}... ({size})"


def check_name(name: str) -> str:
    """An object name: 1-512 characters, no control characters, not starting with '/'."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME or not NAME_RE.match(name):
        raise InvalidArgument(f"bad object name {shown(name)}: 1-{MAX_NAME} characters, no control characters, "
                              "not starting with '/'")
    return name


def valid_namespace(namespace: object) -> bool:
    return (isinstance(namespace, str) and 0 < len(namespace) <= MAX_NAMESPACE
            and NAMESPACE_RE.match(namespace) is not None)


def check_namespace(namespace: str) -> str:
    if not valid_namespace(namespace):
        raise InvalidArgument(f"bad namespace {shown(namespace)}: 1-{MAX_NAMESPACE} characters of letters, "
                              "digits, '.', '_', '-', starting with a letter or digit")
    return namespace


def job_rank(namespace: str) -> tuple[str, int | None]:
    """(job, rank) of a data-parallel rank's namespace ``<job>.r<rank>``, ("", None) for
    any other: how fuyouctl and the metrics group the ranks of one job."""
    m = RANK_NAMESPACE_RE.match(namespace)
    return (m["job"], int(m["rank"])) if m else ("", None)
