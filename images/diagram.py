"""Drawing primitives shared by the scripts that make the course's diagrams."""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes
from matplotlib.patches import FancyBboxPatch


def box(ax: Axes, x: float, y: float, w: float, h: float, text: str, color: str, fontsize: float = 9,
        lw: float = 0.8, **kw: Any) -> None:
    """A rounded box with centred text, lower-left corner at (x, y)."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black", lw=lw, **kw))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def arrow(ax: Axes, xy: tuple[float, float], xytext: tuple[float, float], **kw: Any) -> None:
    """An arrow from ``xytext`` to ``xy``; ``kw`` goes to the arrow properties (lw, color, ...)."""
    ax.annotate("", xy=xy, xytext=xytext, arrowprops={"arrowstyle": "->", "lw": 1, **kw})
