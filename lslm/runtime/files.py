"""Files that readers never see half-written: one primitive that the corpus cache, checkpoints and reports share.

It lives in the runtime, the lowest layer, because writers sit in several layers above it (``lslm.data``'s caches,
``lslm.tensor_parallel.checkpoint``, ``lslm.harness``'s reports and logs).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes"]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never see a partial file.

    Several ranks may build the same cache file at the same moment: each writes a
    private temporary file in the same directory and renames it into place with
    ``os.replace``, which is atomic on POSIX and Windows. The last writer wins, and
    since every writer produces the same bytes, that is harmless.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates 0600 files; a shared cache should be readable like a normal file.
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        # Leave no stray temporary file behind if the write or the rename failed.
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
