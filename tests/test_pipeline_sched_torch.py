"""lslm's schedule orders against torch.distributed.pipelining's, generated without processes."""

from __future__ import annotations

import pytest

from lslm.pipeline.actions import Action
from lslm.pipeline.schedules import build_schedule, check_schedule_config
from lslm.pipeline.torch_orders import TorchOrderUnavailable, torch_compute_order

CASES = {
    "gpipe": [(1, 3, 1), (2, 4, 1), (4, 8, 1), (3, 2, 1)],
    "1f1b": [(2, 2, 1), (2, 5, 1), (3, 6, 1), (4, 8, 1), (6, 9, 1)],
    "interleaved": [(2, 4, 2), (2, 2, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 12, 3), (2, 8, 4), (1, 3, 2)],
    "zb-h1": [(1, 2, 1), (2, 4, 1), (3, 6, 1), (4, 8, 1), (4, 4, 1), (6, 12, 1)],
    "dualpipev": [(1, 2, 2), (2, 4, 2), (2, 7, 2), (3, 6, 2), (4, 8, 2), (4, 11, 2), (5, 12, 2)],
}


def torch_order(name, p, m, v):
    try:
        order = torch_compute_order(name, p, m, v)
    except TorchOrderUnavailable as err:
        pytest.skip(f"torch's private pipelining API moved: {err}")
    if order is None:
        pytest.skip(f"torch has no {name} for p={p}, m={m}, v={v}")
    return order


@pytest.mark.parametrize("name, p, m, v", [(n, *c) for n, cs in CASES.items() for c in cs])
def test_compute_order_equals_torch(name, p, m, v):
    check_schedule_config(name, p, m, v)
    ours = [list(acts) for acts in build_schedule(name, p, m, v).compute]
    theirs = torch_order(name, p, m, v)
    for rank in range(p):
        if name == "1f1b" and rank == p - 1 and ours[rank] != theirs[rank]:
            # torch 2.13's Schedule1F1B._get_pipeline_order (visualisation only) numbers the last rank's
            # forwards from 1: allow exactly that shift, nothing else.
            shifted = [Action(a.stage, a.kind, a.mb + 1) if a.kind == "F" else a for a in ours[rank]]
            assert theirs[rank] == shifted
            continue
        assert ours[rank] == theirs[rank], f"{name} p={p} m={m} v={v} rank {rank}"


def test_torch_has_no_naive_and_refuses_what_it_refuses():
    assert torch_compute_order("naive", 2, 4) is None
    try:
        assert torch_compute_order("1f1b", 4, 2) is None  # torch's Schedule1F1B needs m >= p; lslm clips warm-up
    except TorchOrderUnavailable as err:
        pytest.skip(str(err))
