"""What a learner sees after `make lab`, checked in a real browser (headless Chromium driven by Playwright).

The Makefile's own ``lab`` command serves a temporary copy of the course (Makefile, pyproject.toml, notebooks/,
images/) from this interpreter's environment, with a token on a free port. One browser session then
(``lab_visit``, run once; the tests assert on what it saw):

* opens Lab's start page, which must land on notebooks/;
* opens every notebook in notebooks/ and waits for its kernel: every <img> (the ../images diagrams and the
  saved figures) must have loaded, no widget may show an error, and the notebook must not turn "modified";
* in notebook 09, runs the cell that shows the calculator widget (the normaliser drops saved widget state, so the
  widget exists only once its cell runs), waits for it to render, then changes its ZeRO stage (a dropdown) and its
  number of layers (a slider, through the slider's editable readout) and records the per-device total it reads
  after each change;
* runs, through the UI (a click in the cell, then Shift+Enter), the one cell of a scratch notebook that
  launches a 2-process job with ``lslm.launch`` and prints what the ranks returned;
* counts the toasts asking to opt into Jupyter news (none: the course's Lab defaults answer it).

Every HTTP answer of 400 or more seen by the browser, and every 404 in the server log, fails the test.
Skipped, with the reason, where Playwright for Python or a Chromium-family browser is missing (``.ci/run``
installs Debian's ``chromium``; Playwright's own browser download is never used).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from lslm.runtime.startup import free_port

ROOT = Path(__file__).resolve().parents[1]
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM = next((path for name in BROWSERS if (path := shutil.which(name))), None)
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright for Python is not installed (pip install -e '.[test]')")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or shutil.which("make") is None,
    reason=f"no Chromium-family browser on PATH (any of {', '.join(BROWSERS)}; Debian: apt-get install chromium) "
           "or no make")

SCRATCH = "zz_browser_check.ipynb"
MARK = "BROWSER-CHECK"
SCRATCH_CELL = (
    "import lslm\n"
    "results = lslm.launch('lslm.demos.smoke:worker', nproc=2, output='none', numel=8)\n"
    f"print('{MARK}', [r['rank'] for r in results], [r['ok'] for r in results])"
)
POLL_MS = 200  # Playwright polls on every animation frame by default: that keeps Chromium painting, on our 2 cores
WIDGET_ERRORS = ("Error displaying widget", "Failed to load model class", "Model not found")
_MD_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)|<img\s[^>]*src=[\"']([^\"']+)")
_IMAGE_MIMES = ("image/png", "image/jpeg", "image/gif", "image/svg+xml")


@dataclass
class Visit:
    """What one browser session saw: per notebook facts, the scratch cell's output, HTTP errors, the server log."""

    start_path: str = ""
    listed: list[str] = field(default_factory=list)
    notebooks: dict[str, dict[str, Any]] = field(default_factory=dict)
    cell_output: str = ""
    news_prompts: int = -1  # toasts asking "get notified about official Jupyter news?" seen at the end
    http_errors: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    calculator: list[str] = field(default_factory=list)  # notebook 09's widget readout: shown, after each change
    calculator_text: str = ""  # notebook 09's text once the widget cell ran (for widget errors)
    phase: str = ""  # what the browser was doing (named when it fails)
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each phase, for the test's report

    def lap(self, phase: str, since: float) -> float:
        """Record the seconds ``phase`` took since ``since``; return now."""
        now = time.perf_counter()
        self.seconds[phase] = round(now - since, 1)
        return now


def expected_images(nb: dict[str, Any]) -> int:
    """How many <img> a notebook renders: images in markdown cells plus image outputs of code cells."""
    count = 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            count += len(_MD_IMAGE.findall("".join(cell["source"])))
        elif cell["cell_type"] == "code":
            count += sum(any(m in out.get("data", {}) for m in _IMAGE_MIMES) for out in cell.get("outputs", []))
    return count


def _copy_course(dest: Path) -> None:
    """The files `make lab` serves, copied so the browser's saves and checkpoints never touch the repository."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / ".jupyter", dest / ".jupyter")  # the course's Lab setting defaults
    ignore = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.py")
    shutil.copytree(ROOT / "images", dest / "images", ignore=ignore)
    shutil.copytree(ROOT / "notebooks", dest / "notebooks", ignore=ignore)
    scratch = {"cells": [{"cell_type": "code", "execution_count": None, "id": "launch", "metadata": {},
                          "outputs": [], "source": SCRATCH_CELL}],
               "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python",
                                           "name": "python3"}},
               "nbformat": 4, "nbformat_minor": 5}
    (dest / "notebooks" / SCRATCH).write_text(json.dumps(scratch, indent=1) + "\n")


def _start_lab(tree: Path, home: Path, port: int, token: str) -> subprocess.Popen[str]:
    """`make lab` in ``tree`` with this interpreter's environment as VENV, its install step skipped (``-o``)."""
    venv = sys.prefix
    # Without the tests' LSLM_LAUNCHER (conftest.py): the browser's cell launches through torchrun, as a learner's.
    env = {k: v for k, v in os.environ.items() if k != "LSLM_LAUNCHER"}
    env |= {"JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces")}
    lab_args = (f"--no-browser --ServerApp.ip=127.0.0.1 --ServerApp.token={token} "
                "--LabApp.expose_app_in_browser=True")  # window.jupyterapp: to read kernel and dirty state
    return subprocess.Popen(["make", "-s", "-o", f"{venv}/.lslm-installed", "lab", f"VENV={venv}", f"PORT={port}",
                             f"LAB_ARGS={lab_args}"],
                            cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop make, jupyter and every kernel it started (kernels run in sessions of their own)."""
    if proc.poll() is None:
        family = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGTERM)  # jupyter shuts its kernels down on SIGTERM
        _gone, alive = psutil.wait_procs(family, timeout=15)
        for p in alive:
            p.kill()
    proc.wait(timeout=15)


# JavaScript run in the page (window.jupyterapp exists because of expose_app_in_browser).
_JS_KERNEL_IDLE = """() => { const w = window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!(k && k.status === 'idle' && w.context.isReady); }"""
_JS_IMAGES = """() => Array.from(window.jupyterapp.shell.currentWidget.node.querySelectorAll('img')).map(
  i => ({src: i.getAttribute('src').slice(0, 80), complete: i.complete, width: i.naturalWidth}))"""
_JS_STATE = """() => { const w = window.jupyterapp.shell.currentWidget;
  return {path: w.context.path, dirty: w.context.model.dirty, text: w.node.innerText}; }"""


def _open_notebook(page: Any, path: str, n_images: int, timeout_s: float = 60) -> dict[str, Any]:
    """Open ``path`` in Lab, wait for its kernel and its ``n_images`` images; return what it shows."""
    # Return nothing: Playwright would serialise the whole widget the command resolves to (seconds of CPU).
    page.evaluate("p => { window.jupyterapp.commands.execute('docmanager:open', {path: p}); }", path)
    page.wait_for_function(f"() => window.jupyterapp.shell.currentWidget?.context?.path === {json.dumps(path)}",
                           timeout=timeout_s * 1000, polling=POLL_MS)
    page.wait_for_function(_JS_KERNEL_IDLE, timeout=timeout_s * 1000, polling=POLL_MS)
    deadline = time.time() + timeout_s
    while True:  # images decode asynchronously after the cells render
        images = page.evaluate(_JS_IMAGES)
        if (len(images) >= n_images and all(i["complete"] for i in images)) or time.time() > deadline:
            break
        time.sleep(0.2)
    page.wait_for_timeout(500)  # let Lab apply the kernel's metadata (what would mark the notebook modified)
    return {**page.evaluate(_JS_STATE), "images": images, "expected_images": n_images}


CALCULATOR_NOTEBOOK = "09_3d_parallelism.ipynb"
CALCULATOR_CELL = "calc = plan_calculator("  # the code cell that shows the widget
_JS_RUN_CELL = """async (marker) => { const nb = window.jupyterapp.shell.currentWidget.content;
  const i = nb.widgets.findIndex(c => c.model.type === 'code' && c.model.sharedModel.getSource().includes(marker));
  if (i < 0) { return i; }
  nb.activeCellIndex = i;
  await nb.scrollToCell(nb.widgets[i]);
  await window.jupyterapp.commands.execute('notebook:run-cell');
  return i; }"""


def _read_changed(page: Any, selector: str, before: str, timeout_s: float = 60) -> str:
    """Wait until the element at ``selector`` shows text other than ``before``; return it."""
    page.wait_for_function("([sel, old]) => { const e = document.querySelector(sel); "
                           "return !!e && e.innerText.includes('per device:') && e.innerText !== old; }",
                           arg=[selector, before], timeout=timeout_s * 1000, polling=POLL_MS)
    return page.locator(selector).inner_text()


def _drive_calculator(page: Any, visit: Visit) -> None:
    """Run notebook 09's calculator cell, then change a dropdown and a slider; record the readout each time."""
    panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
    root = f"{panel} .lslm-plan-calculator"
    readout = f"{root} .lslm-plan-readout"
    index = page.evaluate(_JS_RUN_CELL, CALCULATOR_CELL)
    assert index >= 0, f"no code cell containing {CALCULATOR_CELL!r} in {CALCULATOR_NOTEBOOK}"
    visit.calculator.append(_read_changed(page, readout, "", timeout_s=120))
    zero = page.locator(f"{root} .widget-dropdown").filter(has_text="ZeRO stage").locator("select")
    current = zero.evaluate("s => s.options[s.selectedIndex].text")
    zero.select_option(label="3" if current != "3" else "0")
    visit.calculator.append(_read_changed(page, readout, visit.calculator[-1]))
    layers = page.locator(f"{root} .widget-slider").filter(has_text="layers L").locator(".widget-readout")
    layers.click()
    page.keyboard.press("Control+A")
    page.keyboard.type("16")
    page.keyboard.press("Enter")
    visit.calculator.append(_read_changed(page, readout, visit.calculator[-1]))
    visit.calculator_text = page.evaluate(_JS_STATE)["text"]


def _browse(page: Any, base: str, token: str, tree: Path, visit: Visit, proc: subprocess.Popen[str]) -> None:
    """What a learner does after `make lab`: open Lab, every notebook, then run the scratch notebook's cell."""
    t = time.perf_counter()
    visit.phase = "waiting for `make lab` to serve"
    deadline = time.time() + 90
    while True:  # the server needs a few seconds before it answers
        try:
            page.goto(f"{base}/?token={token}", wait_until="domcontentloaded", timeout=5000)
            break
        except playwright_api.Error:
            if proc.poll() is not None or time.time() > deadline:
                raise
            time.sleep(0.5)
    visit.phase = "loading JupyterLab's start page"
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget !== undefined",
                           timeout=60_000, polling=POLL_MS)
    page.wait_for_selector(".jp-DirListing-item", timeout=60_000)
    t = visit.lap("lab loaded", t)
    visit.start_path = page.evaluate("() => window.location.pathname")
    visit.listed = page.locator(".jp-DirListing-itemText").all_inner_texts()
    for nb_path in sorted((tree / "notebooks").glob("[0-9]*.ipynb")):
        visit.phase = f"opening notebooks/{nb_path.name}"
        visit.notebooks[nb_path.name] = _open_notebook(
            page, f"notebooks/{nb_path.name}", expected_images(json.loads(nb_path.read_text())))
        if nb_path.name == CALCULATOR_NOTEBOOK:  # after its state was recorded: running a cell changes it
            visit.phase = f"running the calculator widget of notebooks/{nb_path.name}"
            _drive_calculator(page, visit)
        t = visit.lap(nb_path.name, t)
    visit.phase = f"running the cell of notebooks/{SCRATCH}"
    _open_notebook(page, f"notebooks/{SCRATCH}", 0)
    panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
    page.locator(f"{panel} .jp-Cell .jp-InputArea-editor").first.click()
    page.keyboard.press("Shift+Enter")  # run the cell the way a learner does
    # The prompt reads [*] while the cell runs and [1] once it is done (whether it failed or not).
    page.wait_for_function(f"""() => /\\[\\d+\\]/.test(
        document.querySelector('{panel} .jp-CodeCell .jp-InputPrompt').innerText)""", timeout=120_000,
        polling=POLL_MS)
    visit.cell_output = page.locator(f"{panel} .jp-CodeCell .jp-OutputArea").first.inner_text()
    visit.news_prompts = page.get_by_text("official Jupyter news").count()  # Lab asks once restored, if at all
    visit.lap("cell run", t)


@pytest.fixture(scope="module")
def lab_visit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Visit]:
    """Serve a copy of the course with `make lab`, visit it in Chromium once, and return what was seen."""
    tree, home = tmp_path_factory.mktemp("course"), tmp_path_factory.mktemp("jupyter_home")
    _copy_course(tree)
    port, token = free_port(), secrets.token_hex(16)
    visit = Visit()
    t = time.perf_counter()
    proc = _start_lab(tree, home, port, token)
    reader = threading.Thread(target=lambda: visit.log.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        with playwright_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("response", lambda r: r.status >= 400 and visit.http_errors.append(f"{r.status} {r.url}"))
            try:
                _browse(page, f"http://127.0.0.1:{port}", token, tree, visit, proc)
            except playwright_api.Error as exc:
                log = "".join(line for line in visit.log if "Kernel is running over TCP" not in line)
                raise AssertionError(f"the browser check failed while {visit.phase}: {exc}\n"
                                     f"HTTP errors: {visit.http_errors}\nserver log:\n{log[-4000:]}") from None
            finally:
                browser.close()
    finally:
        _stop(proc)
        reader.join(timeout=10)
        visit.lap("total", t)
    yield visit


def test_lab_opens_on_notebooks_folder(lab_visit: Visit) -> None:
    assert lab_visit.start_path == "/lab/tree/notebooks", lab_visit.start_path
    assert any(name.startswith("00_") for name in lab_visit.listed), lab_visit.listed


def test_every_notebook_shows_all_its_images(lab_visit: Visit) -> None:
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))
    assert sorted(lab_visit.notebooks) == notebooks
    for name, seen in lab_visit.notebooks.items():
        broken = [i["src"] for i in seen["images"] if not (i["complete"] and i["width"] > 0)]
        assert not broken, f"{name}: images that did not load: {broken}"
        assert len(seen["images"]) == seen["expected_images"], (name, seen["images"])


def test_no_widget_error_and_no_notebook_opens_modified(lab_visit: Visit) -> None:
    for name, seen in lab_visit.notebooks.items():
        errors = [e for e in WIDGET_ERRORS if e in seen["text"]]
        assert not errors, f"{name} shows {errors}"
        assert not seen["dirty"], (f"{name} turned 'modified' on opening (its metadata differs from what the kernel "
                                   "reports): run scripts/normalize_notebooks.py on it")


def test_the_calculator_widget_renders_and_follows_its_controls(lab_visit: Visit) -> None:
    """Notebook 09's widget rendered (no widget error) and its per-device total changed with each control."""
    shown, after_dropdown, after_slider = lab_visit.calculator
    totals = [re.search(r"per device: ([\d.]+) GB", text) for text in lab_visit.calculator]
    assert all(totals), lab_visit.calculator
    assert len({m.group(1) for m in totals}) == 3, lab_visit.calculator  # each change moved the bar's total
    errors = [e for e in WIDGET_ERRORS if e in lab_visit.calculator_text]
    assert not errors, f"{CALCULATOR_NOTEBOOK} shows {errors} once the widget cell ran"


def test_a_cell_run_in_the_browser_launches_two_processes(lab_visit: Visit) -> None:
    assert f"{MARK} [0, 1] [True, True]" in lab_visit.cell_output, lab_visit.cell_output


def test_lab_does_not_ask_about_jupyter_news(lab_visit: Visit) -> None:
    """A fresh user (empty settings folder) is not asked to opt into Jupyter news: the course answers "never"."""
    assert lab_visit.news_prompts == 0, lab_visit.news_prompts


def test_no_http_error_in_browser_or_server_log(lab_visit: Visit) -> None:
    assert not lab_visit.http_errors, lab_visit.http_errors
    not_found = [line.strip() for line in lab_visit.log if re.search(r"\b404 (GET|HEAD|POST|PUT|PATCH)\b", line)]
    assert not not_found, not_found
