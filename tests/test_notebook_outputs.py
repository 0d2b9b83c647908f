"""The committed notebooks' saved outputs name no path of the machine that ran them.

A reader sees the outputs before running anything; a temporary folder, a home directory or the
absolute path of the checkout says nothing to them (and leaks who ran it where). Outputs that need
to show a path print a placeholder or a path relative to the repository instead.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

#: Absolute paths that only exist on the machine that executed the notebook.
MACHINE_PATHS = {
    "a temporary folder": r"(?<![\w.~-])/(?:tmp|var/tmp)/[\w.-]",
    "a macOS temporary folder": r"/(?:private/)?var/folders/",
    "a macOS private folder": r"/private/var/",
    "a home directory": r"(?<![\w.~-])/(?:home|Users)/[\w.-]+/",
    "root's home directory": r"(?<![\w.~-])/root/",
    "the build path of a torch wheel": r"(?<![\w.~-])/__w/",
}


def _local_prefixes() -> dict[str, str]:
    """This machine's own absolute paths: the checkout, the main checkout of a worktree, the environment."""
    out = {"the repository's absolute path": str(ROOT), "the Python environment's path": sys.prefix}
    git = ROOT / ".git"
    if git.is_file():  # a git worktree: .git names the main repository's git folder
        main = Path(git.read_text().split("gitdir:", 1)[1].strip()).parents[2]
        out["the main checkout's absolute path"] = str(main)
    return {what: re.escape(path.rstrip("/")) + r"(?=/|\b)" for what, path in out.items() if len(path) > 1}


def output_texts(cell: dict) -> list[str]:
    """Every text a code cell's saved outputs show: streams, text/* and JSON data, tracebacks."""
    texts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append("".join(out["text"]) if isinstance(out["text"], list) else out["text"])
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/") or mime.endswith("json"):
                texts.append(value if isinstance(value, str) else json.dumps(value) if not isinstance(value, list)
                             else "".join(value))
        texts.extend(out.get("traceback", []))
    return texts


def machine_paths(text: str, patterns: dict[str, str]) -> list[str]:
    """``'<what>: <excerpt>'`` for every machine path in ``text``."""
    found = []
    for what, pattern in patterns.items():
        for hit in re.finditer(pattern, text):
            start = text.rfind("\n", 0, hit.start()) + 1
            end = text.find("\n", hit.end())
            found.append(f"{what}: {text[start:end if end >= 0 else None].strip()[:160]}")
    return found


def test_the_patterns_catch_what_they_should() -> None:
    patterns = {**MACHINE_PATHS, **_local_prefixes()}
    for text in ("saved /tmp/ddp_script_qicqbl54/checkpoint.pt", "/var/folders/x1/T/abc", "/private/var/x",
                 "/home/alice/lslm/notebooks", "/Users/bob/x", "[/__w/pytorch/pytorch/third_party/gloo]",
                 f"{ROOT}/lslm/show.py", f"File {sys.prefix}/lib/site.py"):
        assert machine_paths(text, patterns), text
    for text in ("--out <temporary folder>", "lslm/recipes/ddp_script.py", "../images/x.png", "1/tmp", "a/b/c"):
        assert not machine_paths(text, patterns), text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_outputs_name_no_machine_path(path: Path) -> None:
    patterns = {**MACHINE_PATHS, **_local_prefixes()}
    cells = json.loads(path.read_text())["cells"]
    found = [f"cell {i}: {hit}" for i, cell in enumerate(cells) if cell["cell_type"] == "code"
             for text in output_texts(cell) for hit in machine_paths(text, patterns)]
    assert not found, f"{path.name}: saved outputs name paths of the machine that ran it:\n" + "\n".join(found)
