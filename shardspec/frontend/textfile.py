"""Reading the text files users name (specs, manifests, HF manifests, config.json) with
bounds: a device (``/dev/zero``), a FIFO or an absurdly large file is refused before it is
read, as an ``OSError`` whose ``strerror`` says why, so every caller reports it as it
reports a missing file.

Pure Python: the compiler (no torch) and the runtime both read through it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

# No spec, manifest or HF manifest comes near this; a larger file is a mistake.
MAX_TEXT_BYTES = 256 * 1024 * 1024


def read_text(path: str | os.PathLike, *, limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of regular file ``path`` (a byte order mark dropped). Raises
    ``OSError`` for a path that is not a regular file or holds more than ``limit`` bytes,
    and ``UnicodeDecodeError`` for bytes that are not UTF-8."""
    p = Path(path)
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
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while being read
        raise OSError(errno.EFBIG, f"more than the {limit} bytes a text file may have")
    return data.decode("utf-8-sig")


def file_mode() -> int:
    """The mode a plain ``open(..., "w")`` would give a new file (``mkstemp`` gives 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
