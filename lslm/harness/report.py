"""One writer for every benchmark: the printed table as ``.txt``, the numbers as ``.json``, the figure as ``.png``.

A bench prints through a :class:`Report`, which keeps every line it prints. At the end
``write(data, plot)`` writes ``NAME.json`` and ``NAME.png`` and prints one ``wrote ...``
line; leaving the ``with`` block writes ``NAME.txt``, which is then exactly what the
bench printed, that line and any printed after it included. So the committed
``bench/results/*.txt`` files are produced by the bench itself, never captured by hand.
With ``out_dir=None`` nothing is written and the report only prints.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from lslm.runtime.files import atomic_write_bytes

__all__ = ["Report"]


class Report:
    """Print-and-keep for a bench named ``name``; files go to ``out_dir`` (``None``: print only)."""

    def __init__(self, name: str, out_dir: str | Path | None) -> None:
        self.name = name
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.lines: list[str] = []

    def path(self, suffix: str) -> Path | None:
        """``out_dir/name.suffix``, or None when the report writes nothing."""
        return self.out_dir / f"{self.name}.{suffix}" if self.out_dir is not None else None

    def print(self, text: str = "") -> None:
        """Print ``text`` (may hold several lines) and keep it for the ``.txt``."""
        print(text, flush=True)
        self.lines.extend(text.split("\n"))

    def write(self, data: Any, plot: Callable[[Any, Path], None] | None = None) -> None:
        """Write ``data`` as JSON (a dict's keys made strings, e.g. world sizes) and ``plot(data, png_path)``;
        print which files. The ``.txt`` is written when the report closes, with every line printed until then.
        """
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        ready = {str(k): v for k, v in data.items()} if isinstance(data, dict) else data
        text = json.dumps(ready, indent=1) + "\n"
        atomic_write_bytes(self.path("json"), text.encode("utf-8"))
        if plot is not None:
            plot(data, self.path("png"))
        written = [self.path("txt"), self.path("json")] + ([self.path("png")] if plot is not None else [])
        self.print(f"wrote {', '.join(map(str, written[:-1]))} and {written[-1]}")

    def close(self) -> Path | None:
        """Write ``name.txt`` with every printed line; return its path (None when writing nothing)."""
        if self.out_dir is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path("txt"), ("\n".join(self.lines) + "\n").encode("utf-8"))
        return self.path("txt")

    def __enter__(self) -> Report:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:  # a failed bench leaves the previous results in place
            self.close()
