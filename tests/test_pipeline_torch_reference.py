"""torch.distributed.pipelining on lslm's GPT stages (lslm.pipeline.torch_reference) against one process.

Every torch schedule class runs the stages of :func:`~lslm.pipeline.partition.split_gpt`
(one launch of 2 processes: all seven at p = 2; one of 4: all seven at p = 4 and four at
p = 2 x dp = 2) and must give the serial GPT's loss and gradients. Tolerance: fp32
rounding. Micro-batching sums per-micro-batch gradients (each a mean over its own tokens)
where the serial step takes one mean over the batch: the same numbers added in another
order. Measured: loss within 1.1e-7 relative, gradients within 1e-6 of each parameter's
largest entry; we allow ``LOSS_RTOL = 1e-6`` and ``GRAD_RTOL = 5e-6``. A schedule that
dropped or doubled a micro-batch, or did not divide by ``m``, would be off by >= 1/m.

How torch averages is pinned down too: ``scale_grads=False`` leaves the *sum* over
micro-batches (``m`` times the mean), and gradients not zeroed before a step are divided
by ``m`` along with the new ones (``"stale"``).

lslm's own executor is compared with torch's twin schedule directly (same stages, same batch) at p = 4, m = 8
(every schedule) and at p = 2 with m = 1 and m = 4 (GPipe and 1F1B; one launch of 2 processes).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline import torch_reference as tr
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from tests.helpers import backends, fake_world, run_workers

LOSS_RTOL, GRAD_RTOL = 1e-6, 5e-6
ALL = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


def _names() -> set[str]:
    from tests.pipeline_torch_workers import config

    with torch.device("meta"):
        return {n for n, _ in GPT(config()).named_parameters()}


def _check(results: list[dict], key: str, pp: int) -> None:
    per_rank = [r[key] for r in results]
    for r in per_rank:
        assert "error" not in r, f"{key}: {r.get('trace', r.get('error'))}"
        assert r["loss"] == pytest.approx(r["want_loss"], rel=LOSS_RTOL), key
        assert r["grad_rel_err"] <= GRAD_RTOL, (key, r["grad_rel_err"])
        assert r["missing_grads"] == [], key
        assert r["pp"] == pp
    # Within one replica the pipeline ranks hold disjoint parameters that together are the whole GPT.
    for dp in {r["dp_rank"] for r in per_rank}:
        held = [n for r in per_rank if r["dp_rank"] == dp for n in r["names"]]
        assert len(held) == len(set(held)) and set(held) == _names(), key
        stages = sorted(s for r in per_rank if r["dp_rank"] == dp for s in r["rank_stages"])
        assert stages == list(range(len(per_rank[0]["stage_to_rank"])))


@pytest.mark.parametrize("backend", backends(2))
def test_every_torch_schedule_at_p2_equals_the_serial_step(backend: str) -> None:
    cases = [[2, s, 4, None] for s in ALL] + [
        [2, "Interleaved1F1B", 2, 3], [2, "ZBVZeroBubble", 2, None],  # 3 stages per rank; ZBV with m < 2p
        [2, "1F1B", 4, None, "sum"], [2, "InterleavedZeroBubble", 4, 2, "sum"],
        [2, "GPipe", 4, None, "stale"], [2, "DualPipeV", 4, None, "stale"]]
    res = run_workers("tests.pipeline_torch_workers:check", 2, backend=backend, timeout=300, cases=cases)
    keys = list(res[0])
    assert len(keys) == len(cases)
    for key in keys:
        _check(res, key, 2)
    assert res[0]["p2-DualPipeV-m4-vNone"]["stage_to_rank"] == [0, 1, 1, 0]
    assert res[0]["p2-Interleaved1F1B-m2-v3"]["rank_stages"] == [0, 2, 4]


@pytest.mark.parametrize("backend", backends(4))
def test_every_torch_schedule_at_p4_and_with_data_parallel_replicas(backend: str) -> None:
    cases = [[4, "GPipe", 4, None], [4, "1F1B", 4, None], [4, "Interleaved1F1B", 8, 2], [4, "LoopedBFS", 4, 2],
             [4, "InterleavedZeroBubble", 4, 2], [4, "InterleavedZeroBubble", 4, 1], [4, "ZBVZeroBubble", 8, None],
             [4, "DualPipeV", 8, None],
             [2, "1F1B", 4, None], [2, "Interleaved1F1B", 4, 2], [2, "InterleavedZeroBubble", 4, 2],
             [2, "DualPipeV", 4, None]]
    res = run_workers("tests.pipeline_torch_workers:check", 4, backend=backend, timeout=400, cases=cases)
    for key in res[0]:
        _check(res, key, int(key[1]))
    assert [r["p4-DualPipeV-m8-vNone"]["rank_stages"] for r in res] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [r["p2-1F1B-m4-vNone"]["dp_rank"] for r in res] == [0, 1, 0, 1]


# -- single process: names and the rules torch's constructors apply ----------------------------
def test_schedule_names() -> None:
    assert tr.torch_spec("1f1b")[0] == "1F1B" and tr.torch_spec("ScheduleDualPipeV")[0] == "DualPipeV"
    assert tr.torch_spec("interleaved")[1].cls_name == "ScheduleInterleaved1F1B"
    assert tr.torch_spec("zb-h1")[1].cls_name == "ScheduleInterleavedZeroBubble"
    assert tr.check_torch_config("zb-h1", 2, 4) == 1 and tr.check_torch_config("InterleavedZeroBubble", 2, 4) == 2
    with pytest.raises(ValueError, match="unknown torch pipeline schedule 'pipedream'"):
        tr.torch_spec("pipedream")
    with pytest.raises(ValueError, match="exactly 2 stage"):
        tr.check_torch_config("dualpipev", 2, 4, 3)
    with pytest.raises(ValueError, match="8 stages but the model has 4 blocks"):
        tr.check_torch_config("Interleaved1F1B", 4, 4, 2, n_layer=4)
    with pytest.raises(ValueError, match="12 rows does not split into 8"):
        tr.check_torch_config("GPipe", 2, 8, batch_size=12)
    assert tr.stage_to_rank("v", 3, 2) == (0, 1, 2, 2, 1, 0) and tr.stage_to_rank("loop", 2, 3) == (0, 1, 0, 1, 0, 1)


@pytest.mark.parametrize("pp", [2, 4])
def test_check_torch_config_refuses_exactly_what_torch_refuses(pp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake world (no processes): torch's constructors raise iff :func:`check_torch_config` does."""
    cfg = GPTConfig.tiny(n_layer=12, block_size=8, vocab_size=64, n_embd=16, n_head=2)
    with fake_world(0, pp):
        ctx = ParallelContext.create(RankGrid.build(pp, pp=pp), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake")
        for name, m in itertools.product(tr.TORCH_SCHEDULES, range(1, 10)):
            spec = tr.TORCH_SCHEDULES[name]
            for v in [spec.default_v] if spec.fixed_v else [1, 2, 3]:
                try:
                    tr.check_torch_config(name, pp, m, v, n_layer=12)
                    ours = None
                except ValueError as exc:
                    ours = str(exc)
                with monkeypatch.context() as patch:  # only torch's own checks
                    patch.setattr(tr, "check_torch_config", lambda *a, v=v, **k: v)
                    try:
                        tr.TorchPipeline(GPT(cfg), ctx, name, m, v)
                        theirs = None
                    except ValueError as exc:
                        theirs = str(exc)
                assert (ours is None) == (theirs is None), (name, pp, m, v, ours, theirs)


@pytest.mark.parametrize("backend", backends(4))
def test_lslm_schedules_equal_their_torch_twins_at_p4(backend: str) -> None:
    """lslm's executor and torch's schedule class on the same stages: the same loss and gradients at p = 4.

    Both run the same stage modules on the same micro-batches; lslm weights each micro-batch's
    loss by 1/m before its backward, torch divides the summed gradients by m after it. With m a
    power of two these are the same floating-point operations (measured: bit-identical); the
    bound allows a BLAS that orders a reduction differently.
    """
    out = run_workers("lslm.demos.pipeline_demo:torch_side_by_side_worker", 4, backend=backend, timeout=240,
                      schedules=["gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev"], microbatches=8,
                      batch_size=8, model=dict(n_layer=8, n_embd=32, n_head=2, block_size=16, vocab_size=96))
    for rank_result in out:
        assert [r["schedule"] for r in rank_result["results"]] == ["gpipe", "1f1b", "interleaved", "zb-h1",
                                                                     "dualpipev"]
        for r in rank_result["results"]:
            assert abs(r["lslm_loss"] - r["torch_loss"]) <= LOSS_RTOL * abs(r["torch_loss"]), r
            assert r["max_grad_diff_torch"] <= GRAD_RTOL * r["max_grad"], r
            assert abs(r["lslm_loss"] - r["serial_loss"]) <= LOSS_RTOL * abs(r["serial_loss"]), r


# -- lslm against torch at small m, p = 2 ------------------------------------------------------------------------
SMALL_M = [("gpipe", 1), ("1f1b", 1), ("gpipe", 4), ("1f1b", 4)]


def _torch_refusal(schedule: str, m: int) -> str | None:
    """Why torch cannot run ``schedule`` with ``m`` micro-batches at p = 2 (None when it can)."""
    try:
        tr.check_torch_config(schedule, 2, m)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module", params=backends(2))
def small_m_run(request: pytest.FixtureRequest) -> dict[str, Any]:
    """One launch of 2 processes: every case of SMALL_M that torch accepts, lslm and torch side by side."""
    cases = [[s, m] for s, m in SMALL_M if _torch_refusal(s, m) is None]
    out = run_workers("tests.pipeline_torch_workers:side_by_side", 2, backend=request.param, timeout=240, pp=2,
                      cases=cases)
    assert all(list(r) == [f"{s}-m{m}" for s, m in cases] for r in out)
    return {"results": out}


@pytest.mark.parametrize(("schedule", "m"), SMALL_M, ids=[f"{s}-m{m}" for s, m in SMALL_M])
def test_lslm_schedules_equal_their_torch_twins_at_small_m(small_m_run: dict[str, Any], schedule: str,
                                                          m: int) -> None:
    """m = 1 (one micro-batch: no pipelining at all) and m = 4 at p = 2: lslm and torch give the same loss and
    gradients, with the bound of :func:`test_lslm_schedules_equal_their_torch_twins_at_p4` (m is a power of two,
    so lslm's 1/m before the backward and torch's after it are the same operations)."""
    refusal = _torch_refusal(schedule, m)
    if refusal is not None:  # torch's Schedule1F1B needs m >= p: nothing to compare against
        pytest.skip(refusal)
    held = []
    for rank_result in small_m_run["results"]:
        r = rank_result[f"{schedule}-m{m}"]
        assert abs(r["lslm_loss"] - r["torch_loss"]) <= LOSS_RTOL * abs(r["torch_loss"]), r
        assert r["max_grad_diff_torch"] <= GRAD_RTOL * r["max_grad"], r
        assert abs(r["lslm_loss"] - r["serial_loss"]) <= LOSS_RTOL * abs(r["serial_loss"]), r
        held += r["names"]
    assert sorted(held) == sorted(_names())  # the comparison covered every parameter, each on one rank
