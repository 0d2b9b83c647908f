"""Print a function's or class's source trimmed to the idea, for the notebooks.

``inspect.getsource`` prints everything: long docstrings and the input checks
that make a library safe but hide the algorithm. :func:`show_source` prints the
same source with the docstrings cut to their first line and the input checks
(``if ...: raise ...``) folded into one comment each, and says how many lines it
hid and how to see them all (``show_source(obj, full=True)``). The package's own lint
markers (``# lslm: cpu-ok (...)``, read by ``tests/test_backend.py``) are never shown:
they speak to the linter, not to the learner.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any

__all__ = ["show_source", "trimmed_source"]

_DOCSTRING_MODES = ("summary", "full", "none")
_CHECK = "input check"
#: A trailing lint marker of the package, e.g. ``  # lslm: cpu-ok (seeded, then moved)``.
_LINT_MARKER = re.compile(r"\s*# lslm: [a-z][a-z-]*(?: \(.*\))?\s*$")


def _strip_markers(lines: list[str]) -> list[str]:
    """``lines`` without the package's lint markers; a line that held only a marker is dropped."""
    out = []
    for line in lines:
        bare = _LINT_MARKER.sub("", line)
        if bare != line and not bare.strip():
            continue
        out.append(bare)
    return out


def _summary(doc: str) -> str:
    """The docstring's first sentence (of its first paragraph)."""
    para = " ".join(line.strip() for line in doc.strip().split("\n\n")[0].splitlines())
    cut = para.find(". ")
    return para if cut < 0 else para[:cut + 1]


def _is_check(stmts: list[ast.stmt]) -> bool:
    """True for a block that only raises: an input check (``raise ValueError(...)`` and the like)."""
    return bool(stmts) and all(isinstance(s, ast.Raise) for s in stmts)


def _hidden_ranges(tree: ast.AST, lines: list[str], docstring: str, checks: bool,
                   elide: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """0-based inclusive line ranges to replace, each with the text that stands in for it."""
    out: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and docstring != "full":
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                a, b = first.lineno - 1, first.end_lineno - 1  # type: ignore[operator]
                indent = lines[a][:len(lines[a]) - len(lines[a].lstrip())]
                summary = _summary(first.value.value)
                if docstring == "none":
                    out.append((a, b, ""))
                elif b > a:  # a multi-line docstring: keep its first line
                    out.append((a, b, f'{indent}"""{summary} [...]"""'))
        if isinstance(node, ast.If) and checks:
            indent = lines[node.lineno - 1][:len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
            if _is_check(node.body) and not node.orelse:
                out.append((node.lineno - 1, node.end_lineno - 1,  # type: ignore[operator]
                            f"{indent}# ... {_CHECK} hidden ..."))
            elif node.orelse and _is_check(node.orelse) and not isinstance(node.orelse[0], ast.If):
                a = node.orelse[0].lineno - 1
                while a > 0 and not lines[a].strip().startswith("else"):  # the `else:` line above the raise
                    a -= 1
                out.append((a, node.end_lineno - 1,  # type: ignore[operator]
                            f"{indent}# ... else: {_CHECK} hidden ..."))
        if elide and isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            head = lines[node.lineno - 1]
            if any(e in head for e in elide):
                indent = head[:len(head) - len(head.lstrip())]
                out.append((node.lineno - 1, node.end_lineno - 1,  # type: ignore[operator]
                            f"{indent}# ... [{head.strip()} ...] hidden"))
    # Keep only outermost ranges (a check inside an elided block is already gone).
    out.sort(key=lambda r: (r[0], -r[1]))
    kept: list[tuple[int, int, str]] = []
    checks_in = [1]  # input checks folded into the last kept range
    for r in out:
        if kept and r[0] <= kept[-1][1]:
            continue
        if kept and r[0] == kept[-1][1] + 1 and _CHECK in r[2] and _CHECK in kept[-1][2]:
            checks_in[-1] += 1  # consecutive checks: one line for all of them
            indent = kept[-1][2][:len(kept[-1][2]) - len(kept[-1][2].lstrip())]
            kept[-1] = (kept[-1][0], r[1], f"{indent}# ... {checks_in[-1]} {_CHECK}s hidden ...")
            continue
        kept.append(r)
        checks_in.append(1)
    return kept


def trimmed_source(obj: Any, start: str | None = None, stop: str | None = None, *, docstring: str = "summary",
                   checks: bool = True, elide: tuple[str, ...] | list[str] = (), full: bool = False
                   ) -> tuple[str, int]:
    """Return ``(text, hidden_lines)``: ``obj``'s source trimmed as :func:`show_source` describes."""
    text, hidden = _trimmed(obj, start, stop, docstring=docstring, checks=checks, elide=elide, full=full)
    return "\n".join(_strip_markers(text.split("\n"))), hidden


def _trimmed(obj: Any, start: str | None, stop: str | None, *, docstring: str, checks: bool,
             elide: tuple[str, ...] | list[str], full: bool) -> tuple[str, int]:
    if docstring not in _DOCSTRING_MODES:
        raise ValueError(f"docstring must be one of {_DOCSTRING_MODES}, got {docstring!r}")
    lines = textwrap.dedent(inspect.getsource(obj)).splitlines()
    ranges = [] if full else _hidden_ranges(ast.parse("\n".join(lines)), lines, docstring, checks, tuple(elide))
    # (original line index, text) pairs: a hidden range becomes one pair (or none).
    numbered: list[tuple[int, str]] = []
    hidden, i, k = 0, 0, 0
    while i < len(lines):
        if k < len(ranges) and ranges[k][0] == i:
            a, b, text = ranges[k]
            hidden += (b - a + 1) - (1 if text else 0)
            if text:
                numbered.append((a, text))
            i, k = b + 1, k + 1
            continue
        numbered.append((i, lines[i]))
        i += 1
    lo = 0
    if start is not None:
        lo = next((n for n, line in enumerate(lines) if start in line), None)  # type: ignore[assignment]
        if lo is None:
            raise ValueError(f"no line of {getattr(obj, '__qualname__', obj)!r} contains start={start!r}")
    hi = len(lines) - 1
    if stop is not None:
        hi = next((n for n, line in enumerate(lines) if n >= lo and stop in line), None)  # type: ignore[assignment]
        if hi is None:
            raise ValueError(f"no line of {getattr(obj, '__qualname__', obj)!r} after start contains stop={stop!r}")
    if start is not None or stop is not None:
        hidden = sum(b - a + 1 - (1 if t else 0) for a, b, t in ranges if lo <= a <= hi)
    return "\n".join(text for n, text in numbered if lo <= n <= hi), hidden


def show_source(obj: Any, start: str | None = None, stop: str | None = None, *, docstring: str = "summary",
                checks: bool = True, elide: tuple[str, ...] | list[str] = (), full: bool = False) -> None:
    """Print the source of ``obj`` trimmed to the idea, and say how to see all of it.

    * ``docstring``: ``"summary"`` keeps the first line of each multi-line docstring,
      ``"full"`` keeps docstrings whole, ``"none"`` drops them;
    * ``checks=True`` folds every input check - an ``if`` (or ``else``) block that
      only raises - into one ``# ... input check hidden ...`` line;
    * ``elide``: statements whose first line contains one of these strings are folded too
      (e.g. ``elide=("if check:",)``);
    * ``start`` / ``stop``: print only the lines from the first one containing ``start``
      to the next one containing ``stop``;
    * ``full=True``: everything, as ``inspect.getsource`` gives it.

    In every mode the package's lint markers (``# lslm: cpu-ok (...)``) are left out.
    """
    text, hidden = trimmed_source(obj, start, stop, docstring=docstring, checks=checks, elide=elide, full=full)
    print(text)
    if hidden:
        name = getattr(obj, "__qualname__", getattr(obj, "__name__", "obj"))
        print(f"# ({hidden} line{'s' * (hidden != 1)} hidden: show_source({name}, full=True) prints all)")
    print()
