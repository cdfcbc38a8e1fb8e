"""JSON text read with errors for people: one line that says what is wrong and where,
never Python's own wording (``json.loads`` raises a bare ``ValueError`` that quotes
``sys.set_int_max_str_digits()`` for a number of over 4,300 digits).

Pure Python, shared: the compiler reads manifests and HF manifests through it, the runtime
an HF checkpoint's index and config.json and a checkpoint's ``.shardspec.json``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

# Python reads integers of at most this many digits (0: any; before 3.10.7 no limit).
# json.loads raises a bare ValueError for a longer one, not a JSONDecodeError.
INT_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
# The lookbehind keeps the search linear.
_LONG_DIGITS = re.compile(rf"(?<![0-9])[0-9]{{{INT_DIGITS + 1},}}")


class JSONTextError(ValueError):
    """Why JSON text could not be read (``reason``), and where: ``line`` and ``col``,
    1-based ((1, 1) where no place can be told)."""

    def __init__(self, reason: str, line: int = 1, col: int = 1) -> None:
        super().__init__(f"{reason} (line {line}, column {col})")
        self.reason, self.line, self.col = reason, line, col


def long_number(text: str) -> tuple[str, int, int] | None:
    """Why JSON ``text`` that ``json.loads`` refused with a plain ``ValueError`` cannot
    be read, and the (line, col) of the cause: its first number of more digits than Python
    reads. ``None`` when there is no such number."""
    m = _LONG_DIGITS.search(text) if INT_DIGITS else None
    if m is None:
        return None
    line = text.count("\n", 0, m.start()) + 1
    col = m.start() - text.rfind("\n", 0, m.start())
    why = f"a number of {len(m.group())} digits (Python reads at most {INT_DIGITS})"
    return why, line, col


def loads(text: str) -> Any:
    """``json.loads(text)``; raises :class:`JSONTextError` for text it cannot read: JSON's
    own error and place, a number too long to read, or nesting too deep."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise JSONTextError(e.msg, e.lineno, e.colno) from None
    except RecursionError:
        raise JSONTextError("nested too deeply") from None
    except ValueError:  # a number json cannot read
        why, line, col = long_number(text) or ("a value json cannot read", 1, 1)
        raise JSONTextError(why, line, col) from None


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value of file ``path``. Raises ``OSError`` when the file cannot be read,
    and :class:`JSONTextError` when its text is not UTF-8 or not JSON that can be read."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise JSONTextError(f"byte {e.start} is not UTF-8") from None
    return loads(text)
