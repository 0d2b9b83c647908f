"""ParallelContext groups and the comm ledger, on real gloo processes."""

from __future__ import annotations

import pytest

from lslm.runtime.grid import RankGrid
from lslm.runtime.ledger import CommLedger, CommRecord
from tests.helpers import run_workers


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 4), (4, 1)])
def test_groups_on_four_processes_match_the_grid(tp: int, pp: int) -> None:
    res = run_workers("tests.workers:group_members", 4, tp=tp, pp=pp)
    grid = RankGrid.build(4, tp=tp, pp=pp)
    for r in res:
        rank = r["rank"]
        assert (r["pp"], r["dp"], r["tp"]) == tuple(grid.coords_of(rank))
        for kind in ("tp", "dp", "pp"):
            assert r[f"{kind}_members"] == grid.group_of(rank, kind)
        assert r["pp_prev"] == grid.pp_prev_rank(rank) and r["pp_next"] == grid.pp_next_rank(rank)


@pytest.mark.parametrize("nproc", [2, 4])
def test_ledger_records_exact_bytes(nproc: int) -> None:
    numel = 1000
    res = run_workers("tests.workers:ledger_volumes", nproc, numel=numel)
    n, b = nproc, numel * 4  # fp32
    for r in res:
        assert all(r["ok"].values()), r["ok"]
        s = r["summary"]
        assert s["all_reduce"] == {"calls": 1, "bytes": b, "bus_bytes": pytest.approx(2 * (n - 1) / n * b)}
        assert s["broadcast"] == {"calls": 1, "bytes": b, "bus_bytes": b}
        assert s["all_gather"] == {"calls": 1, "bytes": n * b, "bus_bytes": pytest.approx((n - 1) * b)}
        assert s["reduce_scatter"] == {"calls": 1, "bytes": n * b, "bus_bytes": pytest.approx((n - 1) * b)}
        assert s["all_to_all"] == {"calls": 1, "bytes": n * b, "bus_bytes": pytest.approx((n - 1) * b)}
        assert s["send"]["bytes"] == b and s["recv"]["bytes"] == b
        # the final barrier of ctx.destroy() is not recorded (it happens after the summary)
        rank = res.index(r)
        sends = [rec for rec in r["records"] if rec["op"] == "send"]
        recvs = [rec for rec in r["records"] if rec["op"] == "recv"]
        assert sends[0]["peer"] == (rank + 1) % n and recvs[0]["peer"] == (rank - 1) % n
        assert all(rec["group_size"] == n for rec in r["records"] if rec["op"] not in ("send", "recv"))


def test_ledger_selects_by_op_tag_and_start() -> None:
    ledger = CommLedger()
    for op, nbytes, label in (("broadcast", 8, "bcast"), ("all_reduce", 100, "g"), ("all_reduce", 40, "other"),
                            ("all_reduce", 60, "g")):
        ledger.record(CommRecord(op, nbytes, group_size=2, label=label))
    assert ledger.total_bytes() == 208 and ledger.calls() == 4
    assert ledger.total_bytes("all_reduce", label="g") == 160 and ledger.calls("all_reduce", label="g") == 2
    assert ledger.total_bytes(label="g", since=2) == 60 and ledger.calls(since=2) == 2
    assert ledger.total_bus_bytes("all_reduce", label="g") == 160  # ring, n = 2: 2(n-1)/n = 1 byte per byte
    assert [r.nbytes for r in ledger.select(label="bcast")] == [8]


def test_synchronize_never_touches_cuda_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from lslm.runtime import synchronize

    def boom(*_: object) -> None:
        raise AssertionError("torch.cuda.synchronize reached on the CPU path")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    synchronize(torch.device("cpu"), torch.device("cpu"))
    synchronize()
