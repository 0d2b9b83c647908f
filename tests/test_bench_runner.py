"""The bench runner and the benches on it: interleaving, barriers, critical path, medians, the three files.

The runner is driven without processes: a fake clock gives exact durations and a fake
``gather`` stands in for the other ranks. The collectives bench runs end to end in a
one-rank gloo world inside this process (its launch replaced by a direct call); the
DDP bench's two-process quick run is in tests/test_recipe_ddp.py. No timing is asserted
except the fake clock's.
"""

from __future__ import annotations

import io
import json
import sys
from contextlib import redirect_stdout

import pytest
import torch

from lslm.bench.devices import device_env
from lslm.harness import StepTimer, Variant, critical_path, gather_ranks, run_variants


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_round_robin_warmup_barrier_and_hooks() -> None:
    log: list[tuple[str, int]] = []
    barriers, rounds = [], []

    def variant(name: str) -> Variant:
        return Variant(name, lambda timer, i: log.append((name, i)), after=lambda i: f"{name}{i}")

    res = run_variants([variant("a"), variant("b")], steps=2, warmup=1, barrier=lambda: barriers.append(len(log)),
                       after_round=rounds.append)
    # Interleaved, warm-up first, each round starting one variant later (no variant always first).
    assert log == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert barriers == [0, 1, 2, 3, 4, 5]  # a barrier before every call
    assert rounds == [0, 1, 2]
    assert list(res) == ["a", "b"] and res["a"].extra == ["a1", "a2"]  # after(): timed rounds only
    assert len(res["b"].total_s) == 2


def test_critical_path_and_medians_with_fake_times() -> None:
    clock = FakeClock()
    # Per variant and round, rank 0's (compute, exposed) durations.
    script = {"a": [(9.0, 9.0), (1.0, 4.0), (2.0, 1.0), (3.0, 1.0)], "b": [(9.0, 9.0), (5.0, 0.0), (6.0, 0.0),
                                                                          (7.0, 0.0)]}

    def variant(name: str) -> Variant:
        def run(timer: StepTimer, i: int) -> None:
            compute, exposed = script[name][i]
            clock.t += compute
            timer.mark("backward_end")
            clock.t += exposed

        return Variant(name, run)

    def two_ranks(local: torch.Tensor) -> torch.Tensor:
        # Rank 1: compute 1.5 s longer than rank 0 and no exposed time, except in b's 2nd timed round.
        other = local.clone()
        other[..., 1] += 1.5
        other[..., 2] = 0.0
        other[..., 0] = other[..., 1]
        other[1, 1] = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
        return torch.stack([local, other])

    res = run_variants([variant("a"), variant("b")], steps=3, warmup=1, clock=clock, barrier=lambda: None,
                       gather=two_ranks, phases={"compute": ("start", "backward_end"),
                                                 "exposed": ("backward_end", "end")}, critical="compute")
    a, b = res["a"], res["b"]
    # a: rank 0 totals 5, 3, 4; rank 1 totals 2.5, 3.5, 4.5 -> max 5, 3.5, 4.5; median 4.5.
    assert a.total_s == [5.0, 3.5, 4.5] and a.median() == 4.5
    # Rank 1 computes longer in every round: the phases are its own (its wait is 0).
    assert a.phases_s == {"compute": [2.5, 3.5, 4.5], "exposed": [0.0, 0.0, 0.0]} and a.median("compute") == 3.5
    # b round 2: rank 1 is fast (0.5 s), so rank 0 is the critical path there.
    assert b.total_s == [6.5, 6.0, 8.5] and b.phases_s["compute"] == [6.5, 6.0, 8.5]
    assert b.median() == 6.5


def test_critical_path_tensor() -> None:
    every = torch.tensor([[[[3.0, 1.0, 2.0]]], [[[2.0, 1.5, 0.5]]]])  # [rank, variant, round, (total, c, e)]
    assert critical_path(every, critical=1).tolist() == [[[3.0, 1.5, 0.5]]]
    assert critical_path(every).tolist() == [[[3.0, 1.0, 2.0]]]
    with pytest.raises(ValueError, match="rank, variant, round"):
        critical_path(every[0])


def test_runner_rejects_bad_input() -> None:
    v = Variant("a", lambda timer, i: None)
    with pytest.raises(ValueError, match="distinct names"):
        run_variants([v, v], steps=1)
    with pytest.raises(ValueError, match="critical phase"):
        run_variants([v], steps=1, phases={"x": ("start", "end")}, critical="y")
    with pytest.raises(ValueError, match="steps >= 1"):
        run_variants([v], steps=0)
    with pytest.raises(ValueError, match="bench device"):
        device_env("tpu")
    assert device_env("cpu") == {"LSLM_DEVICE": "cpu", "LSLM_BACKEND": "gloo"} and device_env("auto") == {}
    assert gather_ranks(torch.ones(2)).shape == (1, 2)  # no process group: a one-rank world


def test_collectives_bench_writes_what_it_prints(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end in a one-rank gloo world: the runner on real collectives, the table, the three files."""
    from lslm.bench import collectives

    def launch_here(target: str, nproc: int, env: dict, **kwargs):
        assert target == "lslm.bench.collectives:worker" and env == device_env("cpu")
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("RANK", raising=False)
        return [collectives.worker(**{k: v for k, v in kwargs.items() if k not in ("timeout", "output")})]

    import lslm.launcher.launch  # noqa: F401 - the module (lslm.launcher.launch is also the function's name)

    monkeypatch.setattr(sys.modules["lslm.launcher.launch"], "launch", launch_here)
    buf = io.StringIO()
    with redirect_stdout(buf):
        res = collectives.run(nprocs=(1,), sizes=(4096, 65536), repeats=2, warmup=1, out_dir=tmp_path,
                              kinds=["all_reduce", "broadcast"])
    rows = res[1]["rows"]
    assert [(r["algorithm"], r["bytes"]) for r in rows[:2]] == [("torch.all_reduce", 4096), ("torch.all_reduce", 65536)]
    assert {r["algorithm"] for r in rows} == {"torch.all_reduce", *collectives.LSLM_ALGORITHMS["all_reduce"],
                                              "torch.broadcast", *collectives.LSLM_ALGORITHMS["broadcast"]}
    assert all(r["time_s"] > 0 for r in rows)
    printed = buf.getvalue()
    assert (tmp_path / "collectives.txt").read_text() == printed
    assert "== 1 processes (gloo) ==" in printed and printed.splitlines()[-1].startswith("ring all-reduce / torch")
    assert json.loads((tmp_path / "collectives.json").read_text())["1"]["rows"] == rows
    assert (tmp_path / "collectives.png").stat().st_size > 0


def test_launch_overhead_and_cli_write_the_three_files(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from lslm.bench import launch_overhead
    from lslm.cli import main

    rows = [{"launcher": launcher, "nproc": n, "job": job, "median_s": 2.0 + n, "min_s": 1.5 + n, "max_s": 3.0 + n,
             "repeats": 3} for launcher in ("torchrun", "forkserver") for n in (2, 4) for job in ("echo", "smoke")]
    monkeypatch.setattr(launch_overhead, "measure", lambda nprocs, repeats: rows)
    assert main(["bench", "launch", "--out", str(tmp_path), "--repeats", "3"]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "launch_overhead.txt").read_text() == printed
    assert printed.splitlines()[1] == "torchrun        2 echo        4.00    3.50    5.00"
    assert json.loads((tmp_path / "launch_overhead.json").read_text()) == rows
    assert (tmp_path / "launch_overhead.png").stat().st_size > 0
    with pytest.raises(SystemExit):  # an unknown device is refused by the command line
        main(["bench", "ddp", "--device", "tpu"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # CUDA asked for on a machine without GPUs: an error before any launch
            main(["bench", "collectives", "--device", "cuda", "--out", str(tmp_path)])
        assert "no CUDA device is available" in capsys.readouterr().err
