"""One number the calculator reports, with the formula that produced it and where that formula comes from.

Every output of :mod:`lslm.plan` is a :class:`Term`, so a table, a notebook widget or a test can show not only
*what* the calculator predicts but *why*: ``formula`` is the expression with the symbols of the source (``Ψ``,
``s b h``, ``(p - 1)/(v m)``), ``source`` the paper section, documentation page or lslm module it is taken from.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Term", "format_bytes_gb", "format_seconds"]


@dataclass(frozen=True)
class Term:
    """A named quantity (bytes, seconds, flops or a count), its formula and its source."""

    name: str
    value: float
    unit: str  #: "B" (bytes), "s", "flop", "" (a count or a ratio)
    formula: str
    source: str

    def formatted(self) -> str:
        """The value in readable units (GB = 1e9 bytes, as the ZeRO paper and DeepSpeed print)."""
        if self.unit == "B":
            return format_bytes_gb(self.value)
        if self.unit == "s":
            return format_seconds(self.value)
        if self.unit == "flop":
            return f"{self.value:.3e} flop"
        return f"{self.value:.4g}"


def format_bytes_gb(nbytes: float) -> str:
    """Bytes in decimal units (GB = 1e9), the ZeRO paper's and DeepSpeed's unit."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def format_seconds(seconds: float) -> str:
    """Seconds as s / ms / µs."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"
