"""Where benchmark results go: one JSON (keyed by world size) and one PNG per benchmark."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_results(results: dict[int, Any], out_dir: str | Path, name: str,
                  plot: Callable[[dict[int, Any], Path], None]) -> tuple[Path, Path]:
    """Write ``results`` to ``out_dir/name.json`` and draw ``out_dir/name.png`` with ``plot``; return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    plot(results, png_path)
    print(f"wrote {json_path} and {png_path}")
    return json_path, png_path
