"""Rank-aware printing and progress bars: by default only global rank 0 speaks."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any, TypeVar

from tqdm.auto import tqdm

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


def progress(iterable: Iterable[T] | None = None, *, all_ranks: bool = False, rank: int | None = None,
             **kwargs: Any) -> tqdm[T]:
    """A tqdm progress bar shown on global rank 0 only (or on every rank with ``all_ranks``).

    Bars on other ranks are created disabled, so loops stay identical on every rank.
    Outside a notebook the bar goes to stderr, as tqdm does.
    """
    r = _env_rank() if rank is None else rank
    kwargs.setdefault("disable", not all_ranks and r != 0)
    kwargs.setdefault("file", sys.stderr)
    if all_ranks:
        kwargs.setdefault("desc", f"rank {r}")
        kwargs.setdefault("position", r)
    return tqdm(iterable, **kwargs)
