"""The set-up: environment.yml mirrors pyproject.toml; `make lab` serves JupyterLab; `lslm doctor` works;
scripts/normalize_notebooks.py (run by `make notebooks`) leaves notebooks that open unmodified."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import ModuleType

import nbformat
import psutil
import pytest
import yaml

from lslm.runtime.startup import free_port

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # Python 3.10: the [test] extras install tomli there
    tomllib = pytest.importorskip("tomli", reason="Python 3.10 reads TOML with tomli: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower()


def test_environment_yml_mirrors_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"]) | set(project["optional-dependencies"]["test"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = {req for req in pip_section if not req.startswith("-e")}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"
    python_pin = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert python_pin == "python" + project["requires-python"]


def test_makefile_installs_the_pinned_deepspeed_after_torch() -> None:
    """DeepSpeed's sdist builds against the installed torch: the Makefile installs pyproject's pin after torch,
    without build isolation (else pip would build it against a fresh torch: the CUDA one on Linux)."""
    make = (ROOT / "Makefile").read_text()
    pin = re.search(r"^DEEPSPEED \?= (\S+)$", make, re.M)
    assert pin is not None
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert pin.group(1) in test_extra
    steps = ('"$(TORCH)"', "--no-build-isolation $(DEEPSPEED)", '-e ".[test]"')
    torch_at, ds_at, rest_at = (make.index(step) for step in steps)
    assert torch_at < ds_at < rest_at and "DS_BUILD_OPS=0 $(BIN)/python -m pip install" in make


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # let the 302 surface as an HTTPError, to read where it points


def test_make_lab_serves_jupyterlab() -> None:
    """`make lab` serves the repository root (so ../images links load), opens on notebooks/, and with the
    course's Lab settings (no Jupyter news fetched: no "get notified about official Jupyter news?" pop-up).

    It runs from this interpreter's environment (VENV=sys.prefix) with the install step skipped (``-o``),
    so the test never creates or updates an environment.
    """
    port = free_port()
    token = "lslm-test-token"
    proc = subprocess.Popen(
        ["make", "-s", "-o", f"{sys.prefix}/.lslm-installed", "lab", f"VENV={sys.prefix}", f"PORT={port}",
         f"LAB_ARGS=--no-browser --ServerApp.token={token} --ServerApp.ip=127.0.0.1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        answer = None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    answer = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.5)
        assert answer is not None, proc.stdout.read().decode() if proc.poll() is not None else "no answer in 90 s"
        assert "started" in answer

        def names(folder: str) -> set[str]:
            with urllib.request.urlopen(f"{base}/api/contents/{folder}?token={token}", timeout=5) as r:
                return {item["name"] for item in json.loads(r.read())["content"]}

        assert {"notebooks", "images"} <= names(""), names("")  # the root is served ...
        assert any(n.startswith("00_") for n in names("notebooks")), names("notebooks")
        png = sorted(p.name for p in (ROOT / "images").glob("*.png"))[0]
        with urllib.request.urlopen(f"{base}/files/images/{png}?token={token}", timeout=5) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "image/png"  # ... so ../images/*.png loads
        with pytest.raises(urllib.error.HTTPError) as redirect:  # ... and the browser opens on notebooks/
            urllib.request.build_opener(_NoRedirect).open(f"{base}/?token={token}", timeout=5)
        location = urllib.parse.urlsplit(redirect.value.headers["Location"])
        assert redirect.value.code == 302 and location.path == "/lab/tree/notebooks", location
        # The course's Lab defaults (.jupyter/labconfig) are served: news is never fetched, so Lab does not ask.
        plugin = "@jupyterlab/apputils-extension:notification"
        with urllib.request.urlopen(f"{base}/lab/api/settings/{plugin}?token={token}", timeout=10) as r:
            schema = json.loads(r.read())["schema"]["properties"]
        assert schema["fetchNews"]["default"] == "false", schema["fetchNews"]
        assert schema["checkForUpdates"]["default"] is False, schema["checkForUpdates"]
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        os.killpg(proc.pid, signal.SIGTERM)
        psutil.wait_procs(children, timeout=10)
        proc.wait(timeout=10)


def test_lslm_doctor_says_ok(capsys: pytest.CaptureFixture[str]) -> None:
    """`lslm doctor` through the console script's entry point, in this process (as tests/test_readme_commands.py
    runs the README's `lslm` commands): its smoke job still launches real ranks, without one more interpreter."""
    from lslm.cli import main

    rc = main(["doctor"])
    out = capsys.readouterr().out
    assert rc == 0, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("lslm doctor: OK"), last
    assert "gloo=yes" in out and "torch" in out


# -- scripts/normalize_notebooks.py ---------------------------------------------------------------------
def _normalizer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("normalize_notebooks", ROOT / "scripts" / "normalize_notebooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
WIDGET = "application/vnd.jupyter.widget-view+json"


def _executed_notebook() -> nbformat.NotebookNode:
    """A notebook as nbclient saves it: run timestamps, a widget bar, a text bar in chunks, a figure."""
    v4 = nbformat.v4
    stamps = {"iopub.execute_input": "2026-01-01T00:00:00Z", "shell.execute_reply": "2026-01-01T00:00:01Z"}
    cell = v4.new_code_cell("train()", execution_count=1, metadata={"execution": stamps, "tags": ["keep"]})
    cell.outputs = [
        v4.new_output("display_data", data={WIDGET: {"model_id": "abc"}, "text/plain": "train:   0%|  | 0/60"}),
        v4.new_output("stream", name="stdout", text="\rtrain:   0%|          | 0/60"),
        v4.new_output("stream", name="stdout", text="\rtrain:  50%|#####     | 30/60"),
        v4.new_output("stream", name="stdout", text="\rtrain: 100%|##########| 60/60\n"),
        v4.new_output("stream", name="stdout", text="loss 6.9 -> 5.4\n"),
        v4.new_output("stream", name="stderr", text="a warning\n"),
        v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"}),
        v4.new_output("execute_result", data={"text/plain": "42"}, execution_count=1),
    ]
    md = v4.new_markdown_cell("![diagram](../images/x.png)", metadata={"execution": stamps})
    nb = v4.new_notebook(cells=[md, cell])
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"},
                   "widgets": {"application/vnd.jupyter.widget-state+json": {"state": {"abc": {}}}}}
    return nb


def test_normalize_keeps_outputs_and_drops_what_changes_every_run() -> None:
    norm = _normalizer()
    nb = norm.normalize(_executed_notebook(), KERNELSPEC)
    assert nb.metadata == {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    md, cell = nb.cells
    assert md.metadata == {} and cell.metadata == {"tags": ["keep"]}
    assert cell.execution_count == 1
    assert [(o.output_type, o.get("name")) for o in cell.outputs] == [
        ("stream", "stdout"), ("stream", "stderr"), ("display_data", None), ("execute_result", None)]
    assert cell.outputs[0].text == "train: 100%|##########| 60/60\nloss 6.9 -> 5.4\n"  # the finished bar only
    assert cell.outputs[2].data["image/png"] == "iVBORw0KGgo=" and cell.outputs[3].data == {"text/plain": "42"}
    nbformat.validate(nb)
    assert norm.normalize(copy.deepcopy(nb), KERNELSPEC) == nb  # idempotent


@pytest.mark.parametrize(("raw", "shown"), [
    ("a\rb\n", "b\n"),
    ("abc\r\n", "abc\n"),
    ("x\r", "x"),
    ("one\nA\rB\rC\nthree", "one\nC\nthree"),
    ("no carriage return\n", "no carriage return\n"),
])
def test_carriage_returns_resolve_as_a_terminal_shows_them(raw: str, shown: str) -> None:
    assert _normalizer().resolve_carriage_returns(raw) == shown


def test_normalize_command_check_then_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    norm = _normalizer()
    path = tmp_path / "nb.ipynb"
    nbformat.write(_executed_notebook(), path)
    before = path.read_text()
    assert norm.main(["--check", str(path)]) == 1 and path.read_text() == before  # --check writes nothing
    assert norm.main([str(path)]) == 0
    assert norm.main(["--check", str(path)]) == 0  # a second pass changes nothing
    text = path.read_text()
    assert text.endswith("}\n") and '"execution"' not in text and WIDGET not in text
    assert json.loads(text)["metadata"]["kernelspec"] == norm.installed_kernelspec()
    assert "not normalised" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        norm.main([str(tmp_path / "missing.ipynb")])


def test_committed_notebooks_are_normalised() -> None:
    """The committed notebooks are as `make notebooks` leaves them, so JupyterLab opens them unmodified."""
    norm = _normalizer()
    kernelspec = norm.installed_kernelspec()
    stale = [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if norm.normalize_file(p, kernelspec, True)]
    assert not stale, f"run `python scripts/normalize_notebooks.py notebooks/*.ipynb`: not normalised: {stale}"
