"""Rank-aware printing and progress bars: by default only global rank 0 speaks.

Progress bars are tqdm's plain text bars everywhere, in a notebook too: a widget bar
(``tqdm.auto``) is saved as its *initial* text (``0/60``), which is what an untrusted
notebook from a fresh clone shows, while the text bar writes its final state into the
cell's output.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.std import tqdm

T = TypeVar("T")


def _env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def rank_print(*args: Any, ranks: Iterable[int] | None = (0,), rank: int | None = None, **kwargs: Any) -> None:
    """Print on the listed global ranks only (``ranks=None``: every rank), prefixed ``[rank r]``.

    ``rank`` defaults to the ``RANK`` environment variable set by torchrun, so this
    works before and after ``init_distributed``.
    """
    r = _env_rank() if rank is None else rank
    if ranks is not None and r not in set(ranks):
        return
    kwargs.setdefault("flush", True)
    stream = kwargs.get("file") or sys.stdout
    if getattr(stream, "lslm_prefixed", False):  # under lslm.launch every line is tagged already
        print(*args, **kwargs)
    else:
        print(f"[rank {r}]", *args, **kwargs)


def in_notebook_kernel() -> bool:
    """Whether this process is a Jupyter kernel (IPython running under ``IPKernelApp``).

    Processes started by ``lslm.launch`` from a notebook are not kernels: they answer False.
    """
    ipython = sys.modules.get("IPython")  # never import IPython just to ask
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and "IPKernelApp" in shell.config


def progress(iterable: Iterable[T] | None = None, *, all_ranks: bool = False, rank: int | None = None,
             **kwargs: Any) -> tqdm[T]:
    """A tqdm progress bar shown on global rank 0 only (or on every rank with ``all_ranks``).

    Bars on other ranks are created disabled, so loops stay identical on every rank.
    Outside a notebook the bar goes to stderr, as tqdm does; in a notebook kernel it is the
    same text bar written to stdout, so the saved cell shows the finished bar (not a widget
    that a fresh clone renders as ``0%``) without stderr's error colouring.
    """
    r = _env_rank() if rank is None else rank
    kwargs.setdefault("disable", not all_ranks and r != 0)
    kwargs.setdefault("file", sys.stdout if in_notebook_kernel() else sys.stderr)
    if all_ranks:
        kwargs.setdefault("desc", f"rank {r}")
        kwargs.setdefault("position", r)
    return tqdm(iterable, **kwargs)
