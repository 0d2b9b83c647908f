"""Read the source of cell-defined functions and classes, and tell a stub from an attempt.

``inspect.getsource`` finds a function typed in a notebook cell (IPython keeps every
cell in ``linecache``), but not a class on Python < 3.13: a class records no file of
its own, and the cell's ``__main__`` has none. :func:`source_of` then looks for the
class definition in the cells IPython cached, starting from its methods' files.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from collections.abc import Iterable
from typing import Any


def _class_source_from_cells(cls: type) -> str | None:
    """The newest ``class <name>`` definition in a cached cell, preferring the files of its methods."""
    files = [f.__code__.co_filename for f in vars(cls).values() if inspect.isfunction(f)]
    files += [f for f in reversed(list(linecache.cache)) if f not in files]  # newest cells last in the cache
    for filename in files:
        lines = linecache.getlines(filename)
        if not lines:
            continue
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:
            continue
        found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
        if found:
            node = found[-1]  # redefined in the same cell: the last one is the live one
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "".join(lines[start - 1:node.end_lineno])
    return None


def source_of(obj: Any) -> str:
    """The dedented source of a function or class; ``ValueError`` if it cannot be found."""
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError) as exc:
        if inspect.isclass(obj):
            text = _class_source_from_cells(obj)
            if text is not None:
                return textwrap.dedent(text)
        raise ValueError(f"cannot read the source of {getattr(obj, '__name__', obj)!r}: define it with "
                         f"`def`/`class` in a notebook cell or a file") from exc


def _is_stub_body(body: list[ast.stmt]) -> bool:
    """Only a docstring and/or ``raise NotImplementedError[(...)]``, and at least the raise."""
    rest = body[1:] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
        and isinstance(body[0].value.value, str) else body
    if len(rest) != 1 or not isinstance(rest[0], ast.Raise) or rest[0].exc is None:
        return False
    exc = rest[0].exc
    target = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(target, ast.Name) and target.id == "NotImplementedError"


def _stub_parts(obj: Any) -> list[str]:
    """Names of the stubs in ``obj``: ``[name]`` for a stub function, ``["Cls.meth", ...]`` for a class.

    An object whose source cannot be read counts as no stub: an in-process check just runs
    it, and a launched check fails to capture it with its own clear error.
    """
    try:
        tree = ast.parse(source_of(obj))
    except ValueError:
        return []
    node = tree.body[0]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [obj.__name__] if _is_stub_body(node.body) else []
    if isinstance(node, ast.ClassDef):
        return [f"{obj.__name__}.{n.name}" for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_stub_body(n.body)]
    return []


def is_stub(obj: Any) -> bool:
    """True if ``obj`` (a function, or a class with a method) still holds a stub body to write."""
    return bool(_stub_parts(obj))


def stub_names(objs: Iterable[Any]) -> list[str]:
    """Every stub among ``objs`` (functions, and methods of classes), in order."""
    return [name for obj in objs for name in _stub_parts(obj)]
