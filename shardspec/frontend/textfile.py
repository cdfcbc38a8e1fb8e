"""Reading the text files users name (specs, manifests, HF manifests, config.json) with
bounds: a device (``/dev/zero``), a FIFO or an absurdly large file is refused before it is
read, as an ``OSError`` whose ``strerror`` says why, so every caller reports it as it
reports a missing file.

Pure Python: the compiler (no torch) and the runtime both read through it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from pathlib import Path

# No spec, manifest or HF manifest comes near this; a larger file is a mistake.
MAX_TEXT_BYTES = 256 * 1024 * 1024


def read_text(path: str | os.PathLike, *, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of regular file ``path`` (a byte order mark dropped). Raises
    ``OSError`` for a path that is not a regular file, holds more than ``limit`` bytes or
    cannot be a path (a NUL in it), and ``UnicodeDecodeError`` for bytes that are not
    UTF-8."""
    p = Path(path)
    if "\0" in str(p):  # os.stat would raise ValueError, not OSError
        raise OSError(errno.EINVAL, "the path holds a NUL character", str(p))
    if not stat.S_ISREG(os.stat(p).st_mode):  # before opening: a FIFO would block open()
        raise OSError(errno.EINVAL, "not a regular file", str(p))
    with open(p, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # swapped in meanwhile
            raise OSError(errno.EINVAL, "not a regular file", str(p))
        if st.st_size > limit:
            raise OSError(
                errno.EFBIG, f"{st.st_size} bytes, more than the {limit} a text file may have"
            )
        # As much as the file holds (f.read(limit + 1) would allocate the whole limit up
        # front: 256 MB for every file), and on up to the limit if it grew since fstat.
        want = st.st_size + 1
        data = f.read(want)
        if len(data) == want:
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:  # grew while being read
        raise OSError(errno.EFBIG, f"more than the {limit} bytes a text file may have")
    return data.decode("utf-8-sig")


def file_mode() -> int:
    """The mode a plain ``open(..., "w")`` would give a new file (``mkstemp`` gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


# A JSON string literal as a regex, matched without a backtracking entry per character:
# Python's engine keeps one per repetition of a group (150 MB for a 1 MB string written
# `(?:[^"\\]|\\.)*`); here only escapes repeat the group, and on 3.11 the repeat is
# possessive and keeps none.
JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*' + ("+" if sys.version_info >= (3, 11) else "") + '"'


def positions(
    text: str, pattern: re.Pattern[str], *, whole: bool = False
) -> dict[str, tuple[int, int]]:
    """For each match of ``pattern`` in JSON ``text``, its group 1 (a JSON string literal)
    read as a string -> the (line, col) of that literal (with ``whole``, of the match);
    the first match wins. Lines are counted at ``\\n`` as the file is read once, never
    split."""
    out: dict[str, tuple[int, int]] = {}
    line, counted = 1, 0
    for m in pattern.finditer(text):
        at = m.start(0 if whole else 1)
        line += text.count("\n", counted, at)
        counted = at
        try:
            name = json.loads(m.group(1))
        except ValueError:  # pragma: no cover - the file parsed as JSON
            continue
        out.setdefault(name, (line, at - text.rfind("\n", 0, at)))
    return out


def replace_text(path: str | os.PathLike, text: str) -> None:
    """Replace the regular file ``path`` (through a symbolic link: its target) with
    ``text`` (UTF-8, ``\\n`` line ends) atomically: a temporary file in the same folder,
    given the file's mode, then renamed over it; on failure the file is as it was and the
    temporary file is gone. Raises ``OSError``."""
    import tempfile

    target = Path(os.path.realpath(path))
    mode = stat.S_IMODE(os.stat(target).st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
