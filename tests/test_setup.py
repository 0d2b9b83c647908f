"""The set-up: environment.yml mirrors pyproject.toml; `make lab` serves JupyterLab; `lslm doctor` works."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import tomllib
import yaml

from lslm.runtime.startup import free_port

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


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_make_lab_serves_jupyterlab() -> None:
    port = free_port()
    token = "lslm-test-token"
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"PORT={port}",
         f"LAB_ARGS=--no-browser --ServerApp.token={token} --ServerApp.ip=127.0.0.1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 90
        answer = None
        while time.time() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2) as r:
                    answer = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.5)
        assert answer is not None, proc.stdout.read().decode() if proc.poll() is not None else "no answer in 90 s"
        assert "started" in answer
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=5) as r:
            names = {item["name"] for item in json.loads(r.read())["content"]}
        assert any(n.startswith("00_") for n in names), names  # it serves the notebooks folder
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        os.killpg(proc.pid, signal.SIGTERM)
        psutil.wait_procs(children, timeout=10)
        proc.wait(timeout=10)


def test_lslm_doctor_says_ok() -> None:
    out = subprocess.run([sys.executable, "-m", "lslm.cli", "doctor"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("lslm doctor: OK"), last
    assert "gloo=yes" in out.stdout and "torch" in out.stdout
