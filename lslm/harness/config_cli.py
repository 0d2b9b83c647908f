"""Config dataclasses: one set of field checks and one command line, both generated from the fields.

A recipe's settings are a dataclass. Each field may carry metadata through
:func:`option` (``help``, ``choices``, bounds ``ge``/``gt``); its type annotation says
what the command line parses:

* ``int``, ``float``, ``str`` (and ``X | None`` of those, default ``None``): ``--name VALUE``;
* ``bool``: ``--name`` / ``--no-name``;
* ``typing.Literal["a", "b"]`` or ``option(..., choices=...)``: ``--name {a,b}``.

:func:`check_fields` (called from the dataclass's ``__post_init__``) raises ``ValueError``
with the field's name for a wrong type, a value out of bounds or an unknown choice, so a
config built in Python is checked exactly like one parsed from the command line, and
:func:`parse_config` turns that ``ValueError`` into the usual argparse error (exit code 2),
before any process starts. Field names map to flags with ``_`` -> ``-`` (``--batch-size``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

__all__ = ["check_fields", "config_parser", "option", "parse_config"]

C = TypeVar("C")
_SCALARS = (int, float, str, bool)


def option(default: Any, *, help: str = "", choices: Sequence[Any] | None = None, ge: float | None = None,
           gt: float | None = None) -> Any:
    """A dataclass field with a default and command-line metadata.

    ``help`` is shown by ``--help``; ``choices`` restricts the value (also checked in Python);
    ``ge``/``gt`` are inclusive/exclusive lower bounds checked by :func:`check_fields`.
    """
    meta = {"help": help, "choices": tuple(choices) if choices is not None else None, "ge": ge, "gt": gt}
    return dataclasses.field(default=default, metadata=meta)


def _field_kind(annotation: Any) -> tuple[type, bool, tuple[Any, ...] | None]:
    """``(scalar type, optional, literal choices)`` of a field annotation; TypeError if unsupported."""
    optional = False
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(annotation)) != 2:
            raise TypeError(f"unsupported config field type {annotation!r}: use X or X | None")
        optional, annotation, origin = True, args[0], typing.get_origin(args[0])
    if origin is Literal:
        values = typing.get_args(annotation)
        kinds = {type(v) for v in values}
        if len(kinds) != 1 or not kinds <= set(_SCALARS):
            raise TypeError(f"Literal choices must share one scalar type, got {values!r}")
        return kinds.pop(), optional, tuple(values)
    if annotation not in _SCALARS:
        raise TypeError(f"unsupported config field type {annotation!r}: int, float, str, bool, Literal or X | None")
    return annotation, optional, None


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], type, bool, tuple[Any, ...] | None]]:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind, optional, literal = _field_kind(hints[f.name])
        choices = f.metadata.get("choices") or literal
        out.append((f, kind, optional, choices))
    return out


def check_fields(cfg: Any) -> None:
    """Check every field of the dataclass instance ``cfg`` against its type, bounds and choices.

    Raises ``ValueError`` naming the class, the field and what was expected. ``int`` fields
    reject ``bool`` and floats; ``float`` fields accept ints; ``None`` is allowed only for
    ``X | None`` fields.
    """
    name = type(cfg).__name__
    for f, kind, optional, choices in _fields(type(cfg)):
        value = getattr(cfg, f.name)
        if value is None and optional:
            continue
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise ValueError(f"{name}.{f.name} must be of type {kind.__name__}{' or None' if optional else ''}, "
                             f"got {value!r}")
        if choices is not None and value not in choices:
            raise ValueError(f"unknown {f.name} {value!r}; expected one of {choices}")
        ge, gt = f.metadata.get("ge"), f.metadata.get("gt")
        if ge is not None and not value >= ge:
            raise ValueError(f"{name}.{f.name} must be >= {ge:g}, got {value!r}")
        if gt is not None and not value > gt:
            raise ValueError(f"{name}.{f.name} must be > {gt:g}, got {value!r}")


def config_parser(cls: type, *, prog: str | None = None, description: str | None = None,
                  parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """An ``argparse`` parser with one flag per field of the dataclass ``cls`` (defaults from the class).

    Pass ``parser`` to add the flags to an existing parser (e.g. one that already has ``--nproc``).
    """
    parser = parser or argparse.ArgumentParser(prog=prog, description=description)
    defaults = cls()  # the class's own defaults, validated once
    for f, kind, _optional, choices in _fields(cls):
        default = getattr(defaults, f.name)
        flag = f"--{f.name.replace('_', '-')}"
        text = f"{f.metadata.get('help') or ''} (default: {default})".strip()
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=default, choices=choices, help=text,
                                metavar=None if choices else kind.__name__.upper())
    return parser


def parse_config(cls: type[C], argv: Sequence[str] | None = None, *,
                 parser: argparse.ArgumentParser | None = None, **parser_kwargs: Any) -> tuple[C, dict[str, Any]]:
    """Parse ``argv`` into ``cls(...)``; return the config and the values of any extra flags ``parser`` had.

    A ``ValueError`` from the config's own checks becomes ``parser.error`` (message, exit code 2).
    """
    parser = config_parser(cls, parser=parser, **parser_kwargs)
    values = vars(parser.parse_args(argv))
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    try:
        cfg = cls(**{k: v for k, v in values.items() if k in names})
    except ValueError as exc:
        parser.error(str(exc))
    return cfg, {k: v for k, v in values.items() if k not in names}
