"""The GitHub workflow parses and runs the same `make test` on a CPU runner and a self-hosted GPU runner."""

from __future__ import annotations

import pytest

from tests.helpers import REPO_ROOT

yaml = pytest.importorskip("yaml")  # PyYAML comes with transformers


def test_ci_workflow_runs_make_test_on_cpu_and_gpu() -> None:
    workflow = yaml.safe_load((REPO_ROOT / ".github" / "workflows" / "ci.yml").read_text())
    jobs = workflow["jobs"]
    assert set(jobs) == {"cpu", "gpu"}
    assert jobs["cpu"]["runs-on"] == "ubuntu-latest" and jobs["gpu"]["runs-on"] == ["self-hosted", "gpu"]
    for name, job in jobs.items():
        runs = [step["run"] for step in job["steps"] if "run" in step]
        assert any(r.startswith("make test") for r in runs), name
        pythons = [step["with"]["python-version"] for step in job["steps"] if "setup-python" in step.get("uses", "")]
        assert pythons == ["3.11"], name
    assert "whl/cpu" in [s["run"] for s in jobs["cpu"]["steps"] if "run" in s][0]  # no multi-GB CUDA wheel on CPU
