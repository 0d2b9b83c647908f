"""Normalise executed notebooks so that re-running an unchanged one leaves no diff but real output changes.

``make notebooks`` runs this after executing every notebook; run it by hand after saving one from JupyterLab:

    python scripts/normalize_notebooks.py notebooks/*.ipynb          # rewrite in place
    python scripts/normalize_notebooks.py --check notebooks/*.ipynb  # exit 1 if any would change

What it changes, and why:

* ``metadata.kernelspec`` becomes what the installed kernel reports (``Python 3 (ipykernel)``), so JupyterLab
  does not rewrite it on opening and mark the notebook modified;
* per-cell ``metadata.execution`` (nbclient's timestamps, new on every run) is removed;
* widget state (``metadata.widgets``) and widget outputs are removed: a saved widget renders as its
  ``text/plain`` fallback in an untrusted notebook, which is its state when first displayed (a progress bar
  reads ``0/60`` above the finished result), or as an error once the kernel that owned it is gone. Widgets come
  back when the cell is run; ``lslm.progress`` writes text bars, which are kept;
* consecutive stream outputs are merged and carriage-return overwrites resolved, as a terminal (and JupyterLab)
  shows them: a text progress bar is saved as its final line only.

Outputs are otherwise kept. The file is written as nbformat writes it (indent 1, sorted keys, trailing newline).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import nbformat

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "widgets"
# Everything on a line up to the last carriage return that has text after it is overwritten by that text.
_OVERWRITTEN = re.compile(r"[^\n]*\r(?=[^\n])")
_DANGLING_CR = re.compile(r"\r+(?=\n|$)")


def installed_kernelspec(name: str = "python3") -> dict[str, str]:
    """The ``kernelspec`` metadata JupyterLab writes for kernel ``name`` as installed in this environment."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel as exc:
        raise ValueError(f"no Jupyter kernel named {name!r} is installed here; install ipykernel "
                         f"(`pip install ipykernel`) in the environment that runs JupyterLab") from exc
    return {"display_name": spec.display_name, "language": spec.language, "name": name}


def resolve_carriage_returns(text: str) -> str:
    """``text`` as a terminal shows it: each line keeps only what follows its last carriage return."""
    text = text.replace("\r\n", "\n")
    return _DANGLING_CR.sub("", _OVERWRITTEN.sub("", text))


def _clean_outputs(outputs: list[Any]) -> list[Any]:
    """Drop widget outputs and merge streams, resolving carriage returns."""
    cleaned: list[Any] = []
    for out in outputs:
        if WIDGET_VIEW in out.get("data", {}):
            continue  # its text fallback is the widget's first state, not its last
        if (out.get("output_type") == "stream" and cleaned and cleaned[-1].get("output_type") == "stream"
                and cleaned[-1].get("name") == out.get("name")):
            cleaned[-1]["text"] += out["text"]  # ipykernel splits one stream into chunks at flush times
            continue
        cleaned.append(out)
    for out in cleaned:
        if out.get("output_type") == "stream":
            out["text"] = resolve_carriage_returns(out["text"])
    return cleaned


def normalize(nb: Any, kernelspec: dict[str, str]) -> Any:
    """Normalise notebook ``nb`` (an ``nbformat`` node) in place and return it; see the module docstring."""
    nb.metadata["kernelspec"] = dict(kernelspec)
    nb.metadata.pop(WIDGET_STATE, None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = _clean_outputs(cell.outputs)
    return nb


def normalize_file(path: Path, kernelspec: dict[str, str], check: bool = False) -> bool:
    """Normalise the notebook at ``path`` (rewritten unless ``check``); return whether it was not normalised."""
    before = path.read_text(encoding="utf-8")
    nb = normalize(nbformat.reads(before, as_version=4), kernelspec)
    after = nbformat.writes(nb) + "\n"
    changed = after != before
    if changed and not check:
        path.write_text(after, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    """Command line: normalise the given notebooks in place, or with ``--check`` only report which would change."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path, help="notebook files (.ipynb)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if any notebook would change")
    parser.add_argument("--kernel", default="python3", help="kernel whose spec goes into the metadata (python3)")
    opts = parser.parse_args(argv)
    missing = [str(p) for p in opts.notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    kernelspec = installed_kernelspec(opts.kernel)
    changed = [p for p in opts.notebooks if normalize_file(p, kernelspec, check=opts.check)]
    verb = "not normalised" if opts.check else "normalised"
    for p in changed:
        print(f"{verb}: {p}")
    return 1 if changed and opts.check else 0


if __name__ == "__main__":
    sys.exit(main())
