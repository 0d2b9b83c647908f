"""Fixtures shared by the test files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def lslm_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache directory per test session (shared by the lslm test files), never ~/.cache.

    Files that build tokenizers or token blocks opt in with
    ``pytestmark = pytest.mark.usefixtures("lslm_cache")``.
    """
    path = tmp_path_factory.getbasetemp() / "lslm_cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LSLM_CACHE_DIR", str(path))
        yield path


#: Notebooks whose subject is torchrun itself: their launches keep it under test too.
TORCHRUN_NOTEBOOKS = ("01_multiprocessing.ipynb",)
_CHOSEN_LAUNCHER = os.environ.get("LSLM_LAUNCHER")  # set before pytest started: used for every test


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Launches in the tests fork their ranks from lslm's fork server instead of starting torchrun.

    ``lslm.launch(launcher="forkserver")`` (lslm/launcher/forkserver.py) gives each rank torchrun's environment,
    rendezvous and worker, without an interpreter importing torch per rank and per agent: that start-up was most of
    a short job's time, over hundreds of launches. torchrun itself stays under test: tests/test_launch.py, the
    README's commands, the browser's cell and the notebooks about torchrun (``TORCHRUN_NOTEBOOKS``, whose kernel
    starts with this variable set: kernels inherit the environment) launch through it. ``LSLM_LAUNCHER`` set
    before pytest starts wins, e.g. ``LSLM_LAUNCHER=torchrun make test`` runs every launch through torchrun.
    """
    if _CHOSEN_LAUNCHER is None:
        torchrun = any(name in str(item.path) for name in TORCHRUN_NOTEBOOKS)
        os.environ["LSLM_LAUNCHER"] = "torchrun" if torchrun else "forkserver"
