"""Draw lslm's layers (run `python images/architecture.py`; images/architecture.png is committed).

The layers are read from the import-linter contract in pyproject.toml, the one `make lint` enforces, so the
picture cannot drift from the rule: one band per layer, lowest at the bottom; boxes side by side in a band are
independent of each other (``a | b``) unless the band says they may import each other (``a : b``); a dashed box is
a package the contract names but that does not exist yet (``(zero)``: the ZeRO chapter).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from diagram import arrow, box  # noqa: E402  (images/diagram.py)

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the [test] extras install tomli
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: one line under each package's name: what it holds
GIST = {
    "runtime": "init_distributed, grid,\nParallelContext, ledger",
    "show": "source listings\ntrimmed to the idea",
    "launcher": "lslm.launch: torchrun\nfrom a notebook",
    "models": "small GPT,\nHF builders",
    "data": "corpus, tokenizer,\nsamplers",
    "metrics": "memory by owner, theory formulas, step-time and collective cost models",
    "collectives": "every collective\nfrom send/recv",
    "data_parallel": "DataParallel written out,\nDDP, accumulation",
    "harness": "config -> CLI, run-or-launch,\ntimer, bench runner",
    "plan": "memory / comm / time\ncalculator, search",
    "layer_drop": "progressive layer\ndropping (PLD)",
    "precision": "loss scaler, master\nweights, fp16/bf16",
    "tensor_parallel": "f/g, parallel layers,\napply_tensor_parallel",
    "pipeline": "schedules, executor,\nsimulator, 2BW",
    "zero": "ZeRO-1/2/3,\noffload",
    "three_d": "TP inside PP stages,\nDP / ZeRO-1 across",
    "context_parallel": "ring attention,\nzig-zag, Ulysses",
    "expert_parallel": "MoE router, capacity,\nexperts by all-to-all",
    "recipes": "training recipes\non the harness",
    "plot": "the figures",
    "bench": "side-by-side\nbenchmarks",
    "demos": "what the notebooks\nlaunch",
    "exercises": "checkers, hints,\nsolutions",
    "integrations": "torchrun scripts, Lightning,\nAccelerate, DeepSpeed",
    "cli": "the lslm command",
}
COLOURS = ["#e8eef7", "#dcebdc", "#fdf0d5", "#e9e1f3", "#fde2e0", "#e0f0f3", "#f1eadf", "#eeeeee"]


def _exists(name: str) -> bool:
    return (ROOT / "lslm" / name).is_dir() or (ROOT / "lslm" / f"{name}.py").is_file()


def layers_from_pyproject(path: Path = ROOT / "pyproject.toml") -> list[tuple[list[tuple[str, bool]], bool]]:
    """The layers contract, lowest first: per layer, its ``(package, exists yet)`` pairs and whether they are
    independent of each other."""
    contracts = tomllib.loads(path.read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    out = []
    for layer in reversed(layers):  # the contract lists the highest layer first
        independent = ":" not in layer
        names = [n.strip() for n in re.split(r"[|:]", layer)]
        out.append(([(n.strip("()"), _exists(n.strip("()"))) for n in names], independent))
    return out


def architecture(path: Path) -> None:
    """One band per layer, lowest at the bottom, every package a box in its band."""
    layers = layers_from_pyproject()
    widest = max(len(names) for names, _ in layers)
    band_h, gap, box_w = 1.0, 0.25, 2.3
    width = widest * (box_w + 0.25) + 1.9
    fig, ax = plt.subplots(figsize=(width * 0.95, len(layers) * (band_h + gap) * 0.95 + 0.9), dpi=80)
    ax.set_xlim(0, width)
    ax.set_ylim(-0.2, len(layers) * (band_h + gap) + 0.1)
    ax.axis("off")
    for i, (names, independent) in enumerate(layers):
        y = i * (band_h + gap)
        box(ax, 1.3, y, width - 1.45, band_h, "", COLOURS[i % len(COLOURS)], lw=0.6)
        ax.text(0.75, y + band_h / 2, f"layer {i + 1}", ha="center", va="center", fontsize=10, weight="bold")
        row_w = len(names) * box_w + (len(names) - 1) * 0.25
        if len(names) == 1:
            row_w = width - 2.0  # a layer of one package spans its band
        x = 1.3 + (width - 1.45 - row_w) / 2
        w = row_w if len(names) == 1 else box_w
        for name, exists in names:
            label = f"{name}\n{GIST.get(name, '')}".strip() if exists else f"{name} (planned)\n{GIST.get(name, '')}"
            box(ax, x, y + 0.1, w, band_h - 0.2, label, "white", fontsize=8.5, ls="-" if exists else "--")
            x += w + 0.25
        if not independent and len(names) > 1:
            ax.text(width - 0.2, y + band_h + 0.02, "these may import each other (no cycles)", ha="right",
                    va="bottom", fontsize=7.5, style="italic")
    top = len(layers) * (band_h + gap) - gap
    arrow(ax, (0.25, 0.1), (0.25, top - 0.1), lw=1.6)
    ax.text(0.12, top / 2, "imports go down only", rotation=90, ha="center", va="center", fontsize=9)
    ax.set_title("lslm's layers: a package imports only from the layers below it (make lint checks it)", fontsize=12)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    architecture(HERE / "architecture.png")
    print("wrote", HERE / "architecture.png")
