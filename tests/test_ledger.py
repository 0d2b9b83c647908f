"""The comm ledger v2: records with labels, axes, issue and (on request) completion times; thread safety; no CUDA
on CPU.

Pure, or in torch's fake process group (nothing moves, every call returns at once):
the byte counts and times on real processes are checked in tests/test_context.py.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lslm.runtime import Comm, CommLedger, CommRecord, ParallelContext, RankGrid
from tests.helpers import fake_world


def _ctx(grid: RankGrid, rank: int) -> ParallelContext:
    return ParallelContext.create(grid, rank=rank, local_rank=rank, node_rank=0, device=torch.device("cpu"),
                                  backend="fake", timeout_s=5)


# -- ledger v2: records, selection, threads ---------------------------------------------------
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


def test_ledger_selects_and_summarises_by_axis() -> None:
    ledger = CommLedger()
    for op, nbytes, axis in (("all_reduce", 100, "dp"), ("all_reduce", 40, "dp,cp"), ("all_gather", 60, "tp"),
                             ("all_reduce", 10, "dp")):
        ledger.record(CommRecord(op, nbytes, group_size=4, axis=axis))
    assert ledger.total_bytes(axis="dp") == 110 and ledger.calls("all_reduce", axis="dp,cp") == 1
    assert ledger.total_bytes("all_reduce", since=1, axis="dp") == 10
    assert ledger.summary(by="axis") == {"dp": {"calls": 2, "bytes": 110, "bus_bytes": 165.0},
                                         "dp,cp": {"calls": 1, "bytes": 40, "bus_bytes": 60.0},
                                         "tp": {"calls": 1, "bytes": 60, "bus_bytes": 45.0}}
    with pytest.raises(ValueError, match="by must be one of"):
        ledger.summary(by="peer")


def test_completion_is_set_once_and_after_issue() -> None:
    rec = CommRecord("all_reduce", 4, group_size=2)
    assert rec.completion_s is None and rec.duration_s is None
    rec.complete()
    first = rec.completion_s
    assert first is not None and rec.issue_s <= first and rec.duration_s == first - rec.issue_s
    rec.complete(first + 10)  # a later stamp (e.g. wait() after the future's callback) does not move it
    assert rec.completion_s == first
    d = rec.as_dict()
    assert d["completion_s"] == first and d["axis"] == "" and d["bus_bytes"] == 4.0


def test_records_and_completions_from_many_threads() -> None:
    ledger = CommLedger()
    recs = [CommRecord("send", 1, group_size=2, label=str(i)) for i in range(400)]
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            ledger.summary()  # takes the lock while writers append
            seen.append(len(ledger.to_list()))

    def writer(chunk: list[CommRecord]) -> None:
        for r in chunk:
            ledger.record(r)
            r.complete()
            r.complete(0.0)

    t_read = threading.Thread(target=reader)
    t_read.start()
    writers = [threading.Thread(target=writer, args=(recs[i::4],)) for i in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    t_read.join()
    assert ledger.calls() == 400 and sorted(int(r.label) for r in ledger.records) == list(range(400))
    assert all(r.completion_s is not None and r.completion_s >= r.issue_s for r in recs)
    assert seen == sorted(seen)  # the list only grows, and every read saw a consistent snapshot


class _StubWork:
    """A work handle as gloo returns them: with a future (collectives) or without (send/recv)."""

    def __init__(self, future: Any = None) -> None:
        self.future, self.done, self.source = future, False, 7

    def get_future(self) -> Any:
        if self.future is None:
            raise RuntimeError("Work::getFuture not implemented.")
        return self.future

    def wait(self, timeout: Any = None) -> bool:
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done

    def source_rank(self) -> int:
        return self.source


def test_timed_work_stamps_completion_from_the_future_or_the_wait() -> None:
    from lslm.runtime.completion import TimedWork

    # gloo's send/recv: no future; the completion is the return of wait() (or a true is_completed()).
    rec = CommRecord("send", 4, group_size=2)
    work = TimedWork(_StubWork(), [rec.done], torch.device("cpu"))
    assert not work.is_completed() and rec.completion_s is None
    assert work.wait() is True and rec.completion_s is not None and work.source_rank() == 7
    # A collective: the future's callback stamps it the moment the result is set; wait() changes nothing.
    fut: torch.futures.Future[Any] = torch.futures.Future()
    rec2 = CommRecord("all_reduce", 4, group_size=2)
    work2 = TimedWork(_StubWork(fut), [rec2.done], torch.device("cpu"))
    assert rec2.completion_s is None and work2.get_future() is fut
    fut.set_result(None)
    stamped = rec2.completion_s
    assert stamped is not None and rec2.issue_s <= stamped
    work2.wait()
    assert rec2.completion_s == stamped


def test_a_paused_ledger_counts_what_it_skipped() -> None:
    ledger = CommLedger()
    with ledger.paused():
        ledger.record(CommRecord("barrier", 0, group_size=2))
    ledger.enabled = False
    ledger.record(CommRecord("barrier", 0, group_size=2))
    ledger.enabled = True
    ledger.record(CommRecord("barrier", 0, group_size=2))
    assert ledger.calls() == 1 and ledger.dropped == 2
    ledger.reset()
    assert ledger.calls() == 0 and ledger.dropped == 0


def test_a_disabled_ledger_hands_back_torchs_p2p_works_and_counts_them() -> None:
    from lslm.runtime.completion import TimedWork

    with fake_world(0, 2):
        comm = Comm()
        comm.ledger.enabled = False
        x = torch.ones(4)
        works = comm.batch_isend_irecv([dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, torch.empty(4), 1)])
        works.append(comm.isend(x, 1))
        works.append(comm.irecv(torch.empty(4), 1))
        for w in works:
            assert not isinstance(w, TimedWork)
            w.wait()
        assert comm.ledger.calls() == 0 and comm.ledger.dropped == 4
        with pytest.raises(ValueError, match="contiguous"):
            comm.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4, 2).t(), 1)])
        comm.ledger.enabled = True
        comm.isend(x, 1).wait()
        assert comm.ledger.calls() == 1 and comm.ledger.records[0].completion_s is None  # no timeline asked
        with comm.ledger.timed():
            comm.isend(x, 1).wait()
        assert comm.ledger.calls() == 2 and comm.ledger.records[1].completion_s is not None


def test_a_disabled_ledger_is_torchs_call_plus_a_counter_for_every_collective() -> None:
    """The fast path: no record, no completion, torch's own work back; counted in dropped; on again: recorded."""
    from lslm.runtime.completion import TimedWork

    with fake_world(0, 2):
        comm = Comm()
        comm.ledger.enabled = False
        x, out = torch.ones(4), torch.empty(8)
        work = comm.all_reduce(x, async_op=True)
        assert work is not None and not isinstance(work, TimedWork)
        work.wait()
        assert comm.all_reduce(x) is None
        comm.broadcast(x, 0)
        comm.reduce(x, 0)
        comm.all_gather([torch.empty(4), torch.empty(4)], x)
        comm.all_gather_into_tensor(out, x)
        comm.reduce_scatter_tensor(torch.empty(4), out)
        comm.all_to_all_single(torch.empty(4), x)
        comm.barrier()
        assert comm.ledger.calls() == 0 and comm.ledger.dropped == 9
        comm.ledger.enabled = True
        assert not isinstance(comm.all_reduce(x, async_op=True), TimedWork)  # recorded, but no timeline asked
        comm.all_reduce(x)
        assert comm.ledger.calls() == 2 and comm.ledger.dropped == 9
        comm.ledger.record_completion = True
        assert isinstance(comm.all_reduce(x, async_op=True), TimedWork)


def test_by_default_an_enabled_ledger_records_issue_times_and_hands_back_torchs_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No timeline asked: every call recorded (bytes, label, issue time), completion_s None, torch's own works,
    and nothing of the completion machinery touched (no wrapper, no future callback, no stamp, no clock anchor)."""
    import lslm.runtime.ledger as ledger_module

    def boom(*_: object, **__: object) -> None:
        raise AssertionError("completion machinery reached without a timeline")

    for name in ("TimedWork", "stamp", "prepare"):
        monkeypatch.setattr(ledger_module, name, boom)
    with fake_world(0, 2):
        comm = Comm()
        assert not comm.ledger.record_completion and not comm.ledger.stamps_completion
        x = torch.ones(4)
        before = time.perf_counter()
        work = comm.all_reduce(x, async_op=True, label="grads")
        assert isinstance(work, dist.Work)  # torch's object itself, not a wrapper
        work.wait()
        comm.all_reduce(x)
        comm.barrier()
        comm.send(x, 1)
        comm.recv(x, 1)
        p2p = [comm.isend(x, 1), comm.irecv(torch.empty(4), 1)]
        p2p += comm.batch_isend_irecv([dist.P2POp(dist.isend, x, 1), dist.P2POp(dist.irecv, torch.empty(4), 1)])
        for w in p2p:
            assert isinstance(w, dist.Work)
            w.wait()
        recs = comm.ledger.records
        assert [r.op for r in recs] == ["all_reduce", "all_reduce", "barrier", "send", "recv", "send", "recv",
                                        "send", "recv"]
        assert recs[0].label == "grads" and recs[0].nbytes == 16 and recs[0].axis == "world"
        assert all(before <= r.issue_s <= time.perf_counter() for r in recs)
        assert all(r.completion_s is None and r.duration_s is None for r in recs)
        assert comm.ledger.to_list()[0]["completion_s"] is None


def test_with_completion_times_requested_every_call_is_stamped() -> None:
    """``record_completion`` for a run, or ``timed()`` for a scope: wrapped works, completion after issue."""
    from lslm.runtime.completion import TimedWork

    with fake_world(0, 2):
        comm = Comm(CommLedger(record_completion=True))
        assert comm.ledger.stamps_completion
        x = torch.ones(4)
        work = comm.all_reduce(x, async_op=True)
        assert isinstance(work, TimedWork) and isinstance(work.work, dist.Work)
        work.wait()
        comm.all_reduce(x)
        comm.barrier()
        comm.send(x, 1)
        for w in [comm.isend(x, 1)] + comm.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(4), 1)]):
            assert isinstance(w, TimedWork)
            w.wait()
        recs = comm.ledger.records
        assert len(recs) == 6
        assert all(r.completion_s is not None and r.issue_s <= r.completion_s for r in recs)
        # A scope on a ledger that records no completion otherwise: stamped inside, not outside.
        comm.ledger.record_completion = False
        comm.all_reduce(x, async_op=True).wait()
        with comm.ledger.timed():
            comm.all_reduce(x, async_op=True).wait()
        with comm.ledger.timed(False):
            comm.all_reduce(x, async_op=True).wait()
        assert [r.completion_s is not None for r in comm.ledger.records[6:]] == [False, True, False]


def test_timed_scopes_nest_and_count_across_threads() -> None:
    ledger = CommLedger()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with ledger.timed():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=other)
    with ledger.timed():
        with ledger.timed():
            assert ledger.stamps_completion
        assert ledger.stamps_completion  # the inner scope's exit leaves the outer one on
        t.start()
        assert inside.wait(5)
    assert ledger.stamps_completion  # the other thread's scope is still open: leaving ours did not turn it off
    leave.set()
    t.join()
    assert not ledger.stamps_completion
    with pytest.raises(RuntimeError), ledger.timed():
        raise RuntimeError("a failing step")
    assert not ledger.stamps_completion  # closed on the way out of an exception too


def test_marks_are_host_times_on_the_cpu() -> None:
    from lslm.runtime.completion import Completion, mark, resolve

    before = time.perf_counter()
    m = mark(torch.device("cpu"))
    assert isinstance(m, Completion) and before <= resolve(m) <= time.perf_counter()
    assert resolve(1.5) == 1.5 and resolve(None) is None


def test_scratch_buffers_are_reused_per_slot_thread_and_dtype_and_grow() -> None:
    comm = Comm()
    a = comm.scratch(100, torch.float32, "cpu")
    assert a.shape == (100,) and a.dtype == torch.float32
    assert comm.scratch(60, torch.float32, "cpu").data_ptr() == a.data_ptr()  # a smaller request: same memory
    b = comm.scratch(100, torch.float32, "cpu", slot=1)
    assert b.data_ptr() != a.data_ptr()  # two buffers in flight never share
    c = comm.scratch(100, torch.float64, "cpu")
    assert c.dtype == torch.float64 and comm.scratch_bytes() == 100 * 4 * 2 + 100 * 8
    bigger = comm.scratch(1000, torch.float32, "cpu")
    assert bigger.numel() == 1000 and comm.scratch_bytes() == 1000 * 4 + 100 * 4 + 100 * 8
    other: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: other.append(comm.scratch(1000, torch.float32, "cpu")))
    t.start()
    t.join()
    assert other[0].data_ptr() != bigger.data_ptr()  # autograd's thread and the main one never share either
    comm.free_scratch()
    assert comm.scratch_bytes() == 0


def test_comm_records_axis_label_and_times_in_a_fake_world() -> None:
    with fake_world(1, 4):
        bare = Comm()
        assert isinstance(bare.ledger, CommLedger) and bare.device is None
        given = CommLedger()
        assert Comm(ledger=given).ledger is given  # an empty ledger is used, not replaced
        ctx = _ctx(RankGrid.build(4, tp=2, cp=2), 1)
        bare.ledger.record_completion = ctx.comm.ledger.record_completion = True  # times checked below
        x = torch.ones(4)
        bare.all_reduce(x, label="bare")
        bare.all_reduce(x, group=ctx.tp_group)  # a group this Comm was never told about
        ctx.comm.all_reduce(x, group=ctx.group("cp", "tp"), label="world-by-axes")  # spans the world
        ctx.comm.all_reduce(x, group=ctx.tp_group, label="tp")
        ctx.comm.all_reduce(x, group=ctx.dp_group)  # dp = 1: the single-rank group
        work = ctx.comm.all_reduce(x, group=ctx.cp_group, async_op=True, label="async")
        work.wait()
        assert work.get_future() is not None
        ctx.comm.batch_isend_irecv([dist.P2POp(dist.isend, x, 0), dist.P2POp(dist.irecv, torch.empty(4), 0)])
        ctx.comm.barrier()
        assert [(r.axis, r.label) for r in bare.ledger.records] == [("world", "bare"), ("", "")]
        assert [r.axis for r in ctx.comm.ledger.records] == ["world", "tp", "self", "cp", "world", "world",
                                                             "world"]
        assert [r.op for r in ctx.comm.ledger.records][-3:] == ["send", "recv", "barrier"]
        recs = bare.ledger.records + ctx.comm.ledger.records[:-3] + ctx.comm.ledger.records[-1:]
        assert all(r.completion_s is not None and r.issue_s <= r.completion_s for r in recs)
        blocking = ctx.comm.ledger.records[:3]
        assert all(a.completion_s <= b.issue_s for a, b in zip(blocking, blocking[1:]))
        assert ctx.comm.device == torch.device("cpu") and ctx.comm.default_device() == torch.device("cpu")


def test_the_cpu_path_never_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object, **__: object) -> None:
        raise AssertionError("torch.cuda reached on the CPU path")

    for name in ("Event", "synchronize", "current_stream", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, boom)
    with fake_world(0, 2):
        ctx = _ctx(RankGrid.build(2, tp=2), 0)
        x = torch.ones(3)
        for timed in (False, True):  # without and with completion times (the CPU clock, then)
            with ctx.comm.ledger.timed(timed):
                ctx.comm.all_reduce(x)
                ctx.comm.all_reduce(x, async_op=True).wait()
                ctx.comm.isend(x, 1).wait()
                ctx.comm.barrier()
        assert ctx.comm.default_device(ctx.tp_group) == torch.device("cpu")
        assert len(ctx.comm.ledger.to_list()) == 8 and ctx.mesh.device_type == "cpu"


def test_synchronize_never_touches_cuda_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from lslm.runtime import synchronize

    def boom(*_: object) -> None:
        raise AssertionError("torch.cuda.synchronize reached on the CPU path")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    synchronize(torch.device("cpu"), torch.device("cpu"))
    synchronize()


def test_the_ledger_bench_times_every_variant_and_counts_the_disabled_calls() -> None:
    from lslm.bench.ledger import VARIANTS, measure

    with fake_world(0, 2):
        row = measure(calls=4, rounds=2, async_op=True)
    assert VARIANTS == ("torch", "disabled", "enabled", "timed")
    assert set(row) == {f"{v}_us" for v in VARIANTS} | {f"{v}_overhead_us" for v in VARIANTS[1:]} | {"dropped"}
    assert row["dropped"] == 3 + 2 * 4  # warm-up calls, then rounds x calls: nothing recorded, all counted


def test_all_gather_object_goes_through_the_ledger_with_its_bytes() -> None:
    """Objects of different sizes on 3 ranks: each rank gets all of them, in rank order; the ledger holds torch's two
    all-gathers (the sizes as int64, then the pickles padded to the longest)."""
    from tests.helpers import run_workers

    res = run_workers("tests.workers:gather_objects", 3, timeout=120)
    want = [{"rank": r, "payload": "x" * (10 * r)} for r in range(3)]
    for r in res:
        assert r["got"] == want
        assert r["ops"] == ["all_gather", "all_gather"]
        assert r["nbytes"] == [3 * 8, 3 * max(r["pickled"])]
