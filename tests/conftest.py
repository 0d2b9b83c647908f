"""Fixtures shared by the test files."""

from __future__ import annotations

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
