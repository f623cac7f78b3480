"""The one exception family for a user's mistakes (no torch, no ray).

A :class:`UserError` is something the user can fix: a config field, a path, a file's content,
a missing dependency, a cluster that is not there. Its message is one line naming the culprit
(the field or path), the value, and the fix. ``maskgrpo`` prints it as ``maskgrpo: <message>``
and exits 2, without a traceback unless ``--debug`` (or ``MASKGRPO_DEBUG=1``) asks for one; any
other exception is a bug and keeps its traceback (exit 1).
"""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """A mistake the user can fix; the message says what, where and how (one line)."""


def one_line(message: str) -> str:
    """``message`` on one line (a multi-line message's lines joined with ``; ``)."""
    out = ""
    for part in (p.strip() for p in str(message).splitlines()):
        if part:
            out += part if not out else (" " if out.endswith(":") else "; ") + part
    return out


def read_utf8(path: Path, error: type[UserError], label: str = "") -> str:
    """The text of a file a user named; ``error`` (one line: ``label`` and the path, why, the
    fix) when it is not readable or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except PermissionError:
        raise error(f"{label}{path}: not readable (permission denied); fix its mode") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{label}{path}: not UTF-8 text (byte {err.start}); re-encode the file as UTF-8"
        ) from None
