"""exit_process: os._exit only where gloo ran (its threads abort interpreter finalization), sys.exit elsewhere."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from lslm.runtime import startup
from tests.helpers import fake_world


class HardExit(Exception):
    """Stands in for os._exit, which would end the test process."""


@pytest.fixture
def hard_exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise HardExit

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(startup, "_gloo_started", False)
    return codes


def test_without_gloo_the_process_exits_normally(hard_exits: list[int]) -> None:
    # NCCL (here: the fake backend) or no process group: finalization runs (atexit, loggers, profilers).
    with pytest.raises(SystemExit) as exc:
        startup.exit_process(3)
    assert exc.value.code == 3 and hard_exits == []
    with fake_world(0, 2):  # a live group of another backend
        with pytest.raises(SystemExit) as exc:
            startup.exit_process(0)
        assert not dist.is_initialized()  # torn down first
    assert exc.value.code == 0 and hard_exits == []


def test_after_a_gloo_start_finalization_is_skipped(hard_exits: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    # init_distributed on gloo sets the flag; the group is usually destroyed already (``with ctx:``)
    monkeypatch.setattr(startup, "_gloo_started", True)
    with pytest.raises(HardExit):
        startup.exit_process(4)
    assert hard_exits == [4]


def test_a_live_gloo_group_counts_as_gloo(hard_exits: list[int]) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(HardExit):
        startup.exit_process(5)
    assert hard_exits == [5] and not dist.is_initialized()
