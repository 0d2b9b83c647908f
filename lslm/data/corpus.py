"""The shipped corpus: eight Shakespeare plays (public domain), about 1 MB of text.

The text lives gzipped inside the package (``lslm/data/corpus/shakespeare.txt.gz``,
see ``PROVENANCE.md`` next to it), so the course needs no download. Tools such as
``datasets.load_dataset("text", ...)`` want plain files, so :func:`corpus_files`
writes the decompressed text once into the lslm cache directory.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
from pathlib import Path

from lslm.runtime.files import atomic_write_bytes

__all__ = ["cache_dir", "corpus_path", "load_corpus_text", "corpus_sha256", "corpus_files"]

_CORPUS_NAME = "shakespeare"


def cache_dir() -> Path:
    """The lslm cache directory: ``$LSLM_CACHE_DIR`` if set, else ``~/.cache/lslm`` (created if missing)."""
    env = os.environ.get("LSLM_CACHE_DIR")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "lslm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def corpus_path() -> Path:
    """Path of the gzipped corpus shipped inside the package."""
    return Path(__file__).resolve().parent / "corpus" / f"{_CORPUS_NAME}.txt.gz"


@functools.lru_cache(maxsize=1)
def load_corpus_text() -> str:
    """The whole corpus as one string (plays separated by blank lines, ``\\n`` line endings)."""
    # Cached: decompressing is cheap (~10 ms) but tokenizer, dataset and tests all ask for it.
    return gzip.decompress(corpus_path().read_bytes()).decode("utf-8")


@functools.lru_cache(maxsize=1)
def corpus_sha256() -> str:
    """Hex sha256 of the decompressed corpus text: the cache key of everything derived from it."""
    return hashlib.sha256(load_corpus_text().encode("utf-8")).hexdigest()


def corpus_files(directory: str | os.PathLike[str] | None = None) -> list[Path]:
    """Write the corpus as plain UTF-8 text and return the file list (one file today).

    ``directory`` defaults to ``<cache_dir()>/corpus``. The file name carries the
    corpus hash, so a changed corpus never reuses a stale file, and an existing file
    of the right size is reused without rewriting it. Safe to call from many
    processes at once.
    """
    base = Path(directory) if directory is not None else cache_dir() / "corpus"
    data = load_corpus_text().encode("utf-8")
    path = base / f"{_CORPUS_NAME}-{corpus_sha256()[:16]}.txt"
    # The name pins the content, and writes are atomic, so a file of the right size is complete.
    if not (path.is_file() and path.stat().st_size == len(data)):
        atomic_write_bytes(path, data)
    return [path]
