"""Checks on a launch request, run before any process starts (a bad request costs no start-up time).

Every number is checked for its kind as well as its range (``True`` is not a
process count, ``"10"`` and NaN are not timeouts), the target is imported and its
signature bound to the given arguments, the grid sizes must tile the world, and a
request for CUDA is refused on a machine without it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` >= 1; ``ValueError`` for bools, floats, strings and non-positive numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def timeout_seconds(value: Any) -> float:
    """A timeout in seconds: a positive number, or ``None`` / ``math.inf`` for no limit.

    ``NaN`` (which compares false with everything and would switch the limit off
    silently), zero, negatives, bools and strings are refused.
    """
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value) or value <= 0:
        raise ValueError(f"timeout must be a positive number of seconds (or None for no limit), got {value!r}")
    return float(value)


def target_string(target: str | Callable[..., Any]) -> str:
    """``"package.module:function"`` for a target given as that string or as a module-level function."""
    if callable(target):
        module = getattr(target, "__module__", None)
        name = getattr(target, "__qualname__", "")
        if module in (None, "__main__") or "<locals>" in name or "<lambda>" in name:
            raise ValueError(
                f"{target!r} is defined in a notebook cell or __main__; launched processes cannot import it. "
                "Put the worker in a module (lslm.recipes has many) and pass 'package.module:function', "
                "or use lslm.exercises to run a cell-defined function.")
        return f"{module}:{name}"
    if not isinstance(target, str) or not target:
        raise ValueError(f"target must be 'package.module:function' or a module-level function, got {target!r}")
    return target


def import_target(target: str, extra_path: Iterable[str]) -> Callable[..., Any]:
    """Import the function ``target`` names (with ``extra_path`` on ``sys.path`` meanwhile)."""
    module_name, _, attr = target.partition(":")
    added = [p for p in extra_path if p not in sys.path]
    sys.path[:0] = added
    try:
        try:
            spec = importlib.util.find_spec(module_name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise ValueError(f"unknown target {target!r}: no module named {module_name!r} can be imported")
        module = importlib.import_module(module_name)
        fn = getattr(module, attr or "worker", None)
        if not callable(fn):
            raise ValueError(f"unknown target {target!r}: {module_name!r} has no function {attr or 'worker'!r}")
        return fn
    finally:
        for p in added:
            sys.path.remove(p)


def check_arguments(target: str, fn: Callable[..., Any], args: Mapping[str, Any]) -> None:
    """Bind ``args`` to ``fn``'s signature; ``ValueError`` naming an unexpected or missing argument."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature: nothing to check
        return
    try:
        sig.bind(**args)
    except TypeError as exc:
        accepted = [p.name for p in sig.parameters.values()
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        hint = ""
        for name in args:
            if name not in sig.parameters and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
                close = difflib.get_close_matches(name, accepted, n=1)
                if close:
                    hint = f"; did you mean {close[0]!r} instead of {name!r}?"
                    break
        bare = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty)  # annotations are noise here (and strings under PEP 563)
        raise ValueError(f"{target} cannot be called with these arguments: {exc} "
                         f"(its signature is {getattr(fn, '__name__', target)}{bare}){hint}") from None


def check_device_request(env: Mapping[str, str], nproc: int) -> None:
    """Refuse ``LSLM_DEVICE=cuda`` / ``LSLM_BACKEND=nccl`` here, before starting, when this machine cannot honour it.

    Only when one is set: then :func:`~lslm.runtime.startup.choose_device_and_backend`
    runs here exactly as it would on local rank 0.
    """
    if not (env.get("LSLM_DEVICE") or env.get("LSLM_BACKEND")):
        return
    from lslm.runtime.startup import choose_device_and_backend

    choose_device_and_backend(0, nproc, environ=env)


def validate(target: str | Callable[..., Any], nproc: int, nnodes: int = 1, timeout: float | None = 300.0,
             args: dict[str, Any] | None = None, pythonpath: Iterable[str] = (),
             env: Mapping[str, str] | None = None) -> str:
    """Check a launch request before any process starts; return the target as a string.

    Raises ``ValueError`` for a process or node count that is not an integer >= 1, a
    timeout that is not a positive number (or None), an unknown target, arguments its
    function does not accept, grid sizes (``tp``/``pp``/``cp``/``dp``) that do not tile the
    world, arguments that are not JSON-serialisable, or a CUDA request without CUDA.
    """
    nproc, nnodes = positive_int("nproc", nproc), positive_int("nnodes", nnodes)
    timeout_seconds(timeout)
    args = args or {}
    tgt = target_string(target)
    fn = import_target(tgt, pythonpath)
    try:
        json.dumps(args)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"worker arguments must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from exc
    check_arguments(tgt, fn, args)
    grid_sizes = {k: args[k] for k in ("tp", "pp", "cp", "dp") if args.get(k) is not None}
    if grid_sizes:
        # Workers take the grid sizes as tp/pp/cp/dp by convention: reject a grid that
        # cannot tile the world now, not after N processes have started.
        from lslm.runtime.grid import resolve_sizes

        resolve_sizes(nproc * nnodes, **grid_sizes)
    check_device_request(env or {}, nproc)
    return tgt
