"""Checks of a bench's settings, run before any process starts.

A bad setting (no world size, zero repeats, a negative message size) must end in one
``ValueError`` that says what to pass instead, not in a traceback from inside a
launched job ("no median for empty data") after the processes have started. The
command line (:mod:`lslm.bench.cli`) applies the same rules as argparse types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["at_least", "comma_world_sizes", "memory_bench_args", "world_sizes"]


def at_least(name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer >= ``minimum`` (bool excluded), else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def world_sizes(nprocs: Sequence[Any], minimum: int = 1, why: str = "") -> tuple[int, ...]:
    """The world sizes ``nprocs`` as a tuple: at least one, each an integer >= ``minimum``, none repeated.

    ``why`` (e.g. "data parallelism needs peers") is added to the message when a size is too small.
    """
    sizes = tuple(nprocs)
    if not sizes:
        raise ValueError("nprocs is empty: give at least one world size (number of processes), e.g. (2, 4)")
    for n in sizes:
        if isinstance(n, bool) or not isinstance(n, int) or n < minimum:
            reason = f" ({why})" if why else ""
            raise ValueError(f"world sizes (nprocs) must be integers >= {minimum}{reason}, got {n!r}")
    repeated = sorted({n for n in sizes if sizes.count(n) > 1})
    if repeated:
        raise ValueError(f"world sizes (nprocs) must not repeat (each is one launch and one table), got {sizes}")
    return sizes


def comma_world_sizes(text: str) -> tuple[int, ...]:
    """An argparse ``type`` for a comma-separated list of world sizes (``"2,4"``): each an integer >= 1, none
    repeated; a bad list is an ``argparse.ArgumentTypeError`` that shows the form expected."""
    import argparse

    try:
        return world_sizes([int(s) for s in text.split(",")])
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"world sizes like 2,4 (integers >= 1, comma-separated), got {text!r}: "
                                         f"{err}") from None


def memory_bench_args(prog: str, doc: str, out: str, sizes: str, argv: list[str] | None) -> Any:
    """The command line the memory benches share (``--out`` path without extension, ``--sizes`` world sizes,
    ``--quick`` for a tiny model), parsed from ``argv`` (``None``: ``sys.argv``)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    parser.add_argument("--out", default=out, help="path without extension")
    parser.add_argument("--sizes", type=comma_world_sizes, default=sizes, help="world sizes, comma-separated")
    parser.add_argument("--quick", action="store_true", help="a tiny model (a smoke run, not the committed table)")
    return parser.parse_args(argv)
