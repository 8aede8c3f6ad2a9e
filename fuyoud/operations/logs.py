"""Logs: one line per event, ``key=value`` (logfmt), to stderr.

    ts=2026-11-22T10:01:02.345Z level=info logger=fuyoud msg="session 3 opened: uid 1000 ..."

Under systemd (stderr is the journal: $JOURNAL_STREAM names it) each line starts with
its syslog priority, ``<6>level=info ...``, which journald turns into the entry's
priority, and carries no timestamp (the journal keeps its own). Tracebacks stay on
their event's line (``exc="..."``, newlines escaped). Session and admin tokens are never
logged.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time

_BARE = re.compile(r"^[^\s=\"\\\x00-\x1f]+$")
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def _value(v: object) -> str:
    s = str(v)
    return s if _BARE.match(s) else json.dumps(s, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    def __init__(self, journald: bool = False):
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        fields = []
        if not self.journald:
            ms = int(record.created * 1000) % 1000
            fields.append(("ts", time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z"))
        fields += [("level", record.levelname.lower()), ("logger", record.name), ("msg", record.getMessage())]
        if record.exc_info:
            fields.append(("exc", self.formatException(record.exc_info)))
        line = " ".join(f"{k}={_value(v)}" for k, v in fields)
        if self.journald:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{line}"
        return line


def stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM=<dev>:<inode> of the journal stream it connected."""
    want = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def setup(level: str, fmt: str = "auto") -> None:
    """Configure the root logger: ``fmt`` is "auto" (journald format under systemd,
    else logfmt with timestamps), "logfmt" or "journald"."""
    journald = fmt == "journald" or (fmt == "auto" and stderr_is_journal())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter(journald))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
