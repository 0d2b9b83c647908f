"""lslm.plan.overlap: the overlap conditions predicted by the plan's model, beside a trace's exposed share.

No processes: a hardware with round numbers gives every predicted time exactly, and hand-made per-step overlaps
(as lslm.metrics.overlap.analyse returns them) give the traced side exactly.
"""

from __future__ import annotations

import pytest

from lslm.bench.overlap_verdicts import load_committed
from lslm.metrics.overlap import StepOverlap
from lslm.plan.hardware import Hardware, Link
from lslm.plan.model import ModelSpec
from lslm.plan.overlap import (
    OverlapRow,
    block_forward_s,
    collective_s,
    describe_row,
    model_backward_s,
    predicted_verdict,
    traced_share,
    traced_verdict,
    verdict_row,
    weight_grad_s,
)

HW = Hardware("round", {"fp32": 1e9}, devices_per_node=2, intra=Link(1e-3, 1e6), layer_overhead_s=(0.5, 0.25),
              cores=2)
# One block: 12 h^2 = 48 matmul parameters; s = 2 tokens.
MODEL = ModelSpec(n_layer=3, hidden=2, n_head=1, vocab=5, seq_len=2, bias=False)


def _step(rank: int, comm: dict[str, float], exposed: dict[str, float], calls: dict[str, int]) -> StepOverlap:
    return StepOverlap(rank=rank, step="0", step_s=1.0, compute_s=0.5, exposed_s=sum(exposed.values()), issue_s=0.0,
                       idle_s=0.0, comm_s=comm, exposed_by_kind=exposed, bytes_by_kind={}, calls_by_kind=calls,
                       marks={})


def test_predicted_times_on_round_numbers() -> None:
    # forward: matmuls 2·s·(12 h^2) = 2·2·48 = 192, attention core 4·s^2·h = 32 flops, at 1e9/s, + 0.5 s fixed
    assert block_forward_s(MODEL, HW, 1) == pytest.approx(224e-9 + 0.5, rel=1e-12)
    assert block_forward_s(MODEL, HW, 2, tp=2) == pytest.approx(224e-9 + 0.5, rel=1e-12)
    assert weight_grad_s(MODEL, HW, 1) == pytest.approx(192e-9, rel=1e-12)
    # backward: 3 blocks x (2 x 224 flops + 0.25 s) + the head 2·(2·s·h·V) = 80 flops + 0.25 s
    assert model_backward_s(MODEL, HW, 1) == pytest.approx(3 * (448e-9 + 0.25) + 80e-9 + 0.25, rel=1e-12)
    # a ring all-reduce of 1000 B on 2 ranks: 2(n-1) = 2 alphas and 2(n-1)/n = 1 x the bytes at 1 MB/s
    assert collective_s(HW, "all_reduce_ring", 1000, 2) == pytest.approx(2e-3 + 1e-3, rel=1e-12)
    assert collective_s(HW, "all_gather_ring", 1000, 2) == pytest.approx(1e-3 + 0.5e-3, rel=1e-12)


def test_verdicts_predicted_and_traced() -> None:
    assert predicted_verdict(2.0, 1.0) == "hidden"
    assert predicted_verdict(1.0, 1.0) == "hidden"
    assert predicted_verdict(1.0, 2.0) == "exposed (comm-bound)"
    assert predicted_verdict(2.0, 1.0, spare_core=False) == "exposed (no spare core; the inequality holds)"
    assert predicted_verdict(1.0, 2.0, spare_core=False) == "exposed (no spare core; the inequality fails too)"
    assert [traced_verdict(f) for f in (None, 0.0, 0.25, 0.5, 0.75, 1.0)] == [
        "not traced", "hidden", "hidden", "partly hidden", "exposed", "exposed"]
    per_rank = {0: [_step(0, {"all_reduce@dp": 0.4, "send@pp": 1.0}, {"all_reduce@dp": 0.1}, {"all_reduce@dp": 2,
                                                                                               "send@pp": 1}),
                    _step(0, {"all_reduce@dp": 0.4}, {"all_reduce@dp": 0.0}, {"all_reduce@dp": 2})],
                1: [_step(1, {"all_reduce@dp": 0.2}, {"all_reduce@dp": 0.1}, {"all_reduce@dp": 2})]}
    assert traced_share(per_rank, "all_reduce@dp") == (6, pytest.approx(1.0), pytest.approx(0.2))
    assert traced_share(per_rank, "all_gather@dp") == (0, 0.0, 0.0)
    row = verdict_row("dp", "all_reduce", "backward >= all-reduce", 3.0, 2.0, traced_share(per_rank, "all_reduce@dp"))
    assert (row.predicted, row.traced_calls, row.traced, row.agree) == ("hidden", 6, "hidden", True)
    assert row.traced_comm_s == pytest.approx(1.0 / 6) and row.traced_exposed_fraction == pytest.approx(0.2)
    row = verdict_row("zero3", "all_gather", "forward >= all-gather", 3.0, 2.0, (4, 1.0, 0.5), spare_core=False)
    assert (row.predicted.split(" ")[0], row.traced, row.agree) == ("exposed", "partly hidden", False)
    assert row.to_dict()["agree"] is False and row.to_dict()["traced_exposed_fraction"] == 0.5
    none = verdict_row("tp", "all_reduce", "-", 1.0, 2.0, (0, 0.0, 0.0))
    assert (none.traced_comm_s, none.traced_exposed_fraction, none.traced) == (None, None, "not traced")


def test_the_committed_table_and_its_description() -> None:
    """Notebooks 04, 05 and 08 read the committed bench: one row per technique, and the words a row prints."""
    committed = load_committed()
    assert [r["technique"] for r in committed["rows"]] == ["dp", "zero3", "tp"]
    row = OverlapRow("dp", "all_reduce of a 1 kB bucket", "backward >= all-reduce", 2e-3, 1e-3, "hidden", 4, 5e-3,
                     0.5, "partly hidden").to_dict()
    assert describe_row(row, "cpu-box", 2) == (
        "dp at 2 ranks, all_reduce of a 1 kB bucket: hidden if backward >= all-reduce\n"
        "  predicted on 'cpu-box': compute 2.000 ms, communication 1.000 ms -> hidden\n"
        "  traced: 4 calls, 5.000 ms each from issue to wait on average, 50 % of it exposed -> partly hidden; "
        "prediction and trace disagree")
