"""lslm.metrics.step_time: the DDP step-time model, exactly, on hand-computed cases and limits;
lslm.bench.step_time_check: the measurement runs (one 2-process launch) and returns consistent fields.

No timing is asserted: only formulas, exact byte counts and the relations between fields.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from lslm.metrics.step_time import (
    LinkCost,
    critical_backward_per_byte,
    critical_world_size,
    exposed_comm_s,
    fit_ring,
    only_last_exposed_backward_s,
    predict_step,
    ring_all_reduce_s,
    split_buckets,
)

ROOT = Path(__file__).resolve().parents[1]
# beta = 1 s/byte and alpha = 0: on 2 ranks a bucket of S bytes takes exactly S seconds (2 (n-1)/n = 1).
UNIT = LinkCost(0.0, 1.0)


# -- the all-reduce cost ---------------------------------------------------------------
def test_ring_cost_hand_computed() -> None:
    link = LinkCost(1e-3, 1e-9)
    assert ring_all_reduce_s(1e6, 4, link) == pytest.approx(2 * 3 * 1e-3 + 3 / 4 * 1e6 * 2e-9)  # 7.5 ms
    with_gamma = LinkCost(1e-3, 1e-9, 4e-9)
    assert ring_all_reduce_s(1e6, 4, with_gamma) == pytest.approx(7.5e-3 + 3 / 4 * 1e6 * 4e-9)  # + 3 ms
    assert ring_all_reduce_s(5.0, 2, UNIT) == 5.0


def test_one_rank_and_free_network_cost_nothing() -> None:
    link = LinkCost(1e-3, 1e-9, 1e-9)
    assert ring_all_reduce_s(1e9, 1, link) == 0.0
    p = predict_step([4e6, 4e6, 1e6], 1, link, compute_s=0.3, optimizer_s=0.05)
    assert p.exposed_s == 0.0 and p.comm_s == 0.0 and p.step_s == pytest.approx(0.35) and p.hidden_fraction == 1.0
    free = predict_step([4e6, 4e6, 1e6], 8, LinkCost(0.0, 0.0), compute_s=0.3)
    assert free.step_s == 0.3 and not free.comm_bound


def test_monotone_in_world_size_and_bytes() -> None:
    link = LinkCost(2e-4, 4e-10, 2e-10)
    buckets = [4e6, 4e6, 4e6, 2e6]
    exposed = [exposed_comm_s(buckets, n, link, backward_s=0.02) for n in range(1, 65)]
    assert all(a <= b for a, b in zip(exposed, exposed[1:])) and exposed[0] == 0.0 < exposed[1]
    ring = [ring_all_reduce_s(s, 4, link) for s in (0, 1e3, 1e6, 1e9)]
    assert ring == sorted(ring)
    steps = [predict_step([s * k for s in buckets], 4, link, 0.03).step_s for k in (0.5, 1, 2, 4)]
    assert steps == sorted(steps) and steps[0] < steps[-1]


# -- overlap with backward ----------------------------------------------------------------
def test_exposed_hand_computed() -> None:
    # buckets of 3 and 1 bytes: all-reduces of 3 s and 1 s. Backward 4 s: bucket 0 ready at 3,
    # done at 6; bucket 1 ready at 4, starts at 6, done at 7 -> 3 s exposed.
    assert exposed_comm_s([3, 1], 2, UNIT, backward_s=4.0) == 3.0
    # T_b* = G R_0 / (G - C_0) = 4 * 3 / (4 - 3) = 12: from there on only the last bucket (1 s) shows.
    assert only_last_exposed_backward_s([3, 1], 2, UNIT) == 12.0
    assert exposed_comm_s([3, 1], 2, UNIT, backward_s=12.0) == 1.0
    assert exposed_comm_s([3, 1], 2, UNIT, backward_s=100.0) == 1.0
    assert exposed_comm_s([3, 1], 2, UNIT, backward_s=11.0) > 1.0
    assert exposed_comm_s([3, 1], 2, UNIT, backward_s=0.0) == 4.0  # no backward to hide behind: everything


def test_last_bucket_is_never_hidden() -> None:
    link = LinkCost(1e-4, 1e-9)
    for buckets in ([1e6], [2e6, 1e6], [1e6] * 7 + [3e5]):
        for backward in (0.0, 1e-3, 1.0, 1e3):
            assert exposed_comm_s(buckets, 4, link, backward) >= ring_all_reduce_s(buckets[-1], 4, link) - 1e-15


def test_comm_bound_when_communication_exceeds_backward() -> None:
    # Equal buckets: "only the last bucket exposed" starts exactly where communication = backward.
    assert only_last_exposed_backward_s([1, 1, 1, 1], 2, UNIT) == 4.0  # = the 4 buckets' all-reduce time
    assert only_last_exposed_backward_s([5], 2, UNIT) == 0.0  # one bucket: nothing can overlap anyway
    p = predict_step([1, 1, 1, 1], 2, UNIT, compute_s=3.0, backward_fraction=1.0)
    assert p.comm_bound and p.comm_s == 4.0 and p.step_s == 3.0 + p.exposed_s
    assert p.exposed_s >= p.comm_s - p.backward_s + 0.75  # E >= W - T_b + r_0, r_0 = 3 * 1/4
    q = predict_step([1, 1, 1, 1], 2, UNIT, compute_s=6.0, backward_fraction=2 / 3)  # backward 4 s
    assert not q.comm_bound and q.exposed_s == pytest.approx(1.0) and q.hidden_fraction == pytest.approx(0.75)
    # Unequal buckets: a big bucket ready shortly before backward ends has no time to hide, so more than
    # the last bucket shows although communication (13 s) is below backward (20 s): not communication-bound.
    # Bucket 2 (10 s) is ready at 20 * 12/13 and done at 20 * 12/13 + 10; then the last one: 1 s more.
    r = predict_step([1, 1, 10, 1], 2, UNIT, compute_s=20.0, backward_fraction=1.0)
    assert not r.comm_bound and r.exposed_s == pytest.approx(20 * 12 / 13 + 10 + 1 - 20)
    assert r.only_last_exposed_backward_s == pytest.approx(13 * 10 / 1)  # k = 2: G R_2 / (G - C_2)


def test_crossover_per_byte_does_not_depend_on_model_size() -> None:
    link = LinkCost(3e-4, 4e-10, 2e-10)
    cap = 1 << 20
    kappa = critical_backward_per_byte(2, link, cap)
    assert kappa == pytest.approx(2 * 3e-4 / cap + 0.5 * (8e-10 + 2e-10))
    for nbuckets in (2, 5, 40):
        grads = nbuckets * cap
        buckets = split_buckets(grads, cap)
        assert only_last_exposed_backward_s(buckets, 2, link) == pytest.approx(kappa * grads)
        assert predict_step(buckets, 2, link, kappa * grads * 0.99, backward_fraction=1.0).comm_bound
        assert not predict_step(buckets, 2, link, kappa * grads * 1.01, backward_fraction=1.0).comm_bound


def test_critical_world_size() -> None:
    link = LinkCost(3e-4, 4e-10)
    buckets = split_buckets(14_800_896, 4 << 20)
    n = critical_world_size(buckets, link, backward_s=0.05)
    assert n is not None and n > 2
    def comm(k: int) -> float:
        return predict_step(buckets, k, link, 0.05, backward_fraction=1.0).comm_s

    assert comm(n - 1) <= 0.05 < comm(n)
    assert critical_world_size(buckets, LinkCost(0.0, 0.0), backward_s=0.05) is None
    assert critical_world_size(buckets, link, backward_s=0.0) == 2


def test_split_buckets() -> None:
    assert split_buckets(10, 4) == [4, 4, 2]
    assert split_buckets(8, 4) == [4, 4]
    assert split_buckets(3, 4) == [3]


# -- fitting ------------------------------------------------------------------------------
def test_fit_recovers_known_constants() -> None:
    true = LinkCost(2.5e-4, 6e-10)
    sizes = [4096 * 4**k for k in range(7)]
    fit = fit_ring(sizes, [ring_all_reduce_s(s, 2, true) for s in sizes], 2)
    assert fit.alpha_s == pytest.approx(true.alpha_s, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(true.beta_s_per_byte, rel=1e-9) and fit.gamma_s_per_byte == 0.0
    # beta and gamma are one per-byte term at a single n: the fit folds gamma into beta.
    with_gamma = LinkCost(2.5e-4, 6e-10, 4e-10)
    fit4 = fit_ring(sizes, [ring_all_reduce_s(s, 4, with_gamma) for s in sizes], 4)
    assert fit4.beta_s_per_byte == pytest.approx(6e-10 + 2e-10, rel=1e-9)
    # Times that fall with size: a negative per-byte cost is non-physical, so it becomes 0.
    flat = fit_ring([1e3, 1e6], [2e-3, 1e-3], 2)
    assert flat.beta_s_per_byte == 0.0 and flat.alpha_s > 0


def test_link_from_committed_fit() -> None:
    fits = json.loads((ROOT / "bench/results/collectives.json").read_text())
    link = LinkCost.from_fit(fits["2"]["fit"])
    assert link.alpha_s == fits["2"]["fit"]["alpha_s"] and ring_all_reduce_s(1 << 20, 2, link) > 0


@pytest.mark.parametrize("call", [
    lambda: LinkCost(-1.0, 0.0),
    lambda: LinkCost(0.0, math.nan),
    lambda: ring_all_reduce_s(1.0, 0, UNIT),
    lambda: ring_all_reduce_s(-1.0, 2, UNIT),
    lambda: exposed_comm_s([], 2, UNIT, 1.0),
    lambda: exposed_comm_s([1, 0], 2, UNIT, 1.0),
    lambda: exposed_comm_s([1], 2, UNIT, -1.0),
    lambda: predict_step([1], 2, UNIT, 1.0, backward_fraction=1.5),
    lambda: predict_step([1], 2, UNIT, -1.0),
    lambda: split_buckets(0, 4),
    lambda: fit_ring([1.0], [1.0], 2),
    lambda: fit_ring([1.0, 2.0], [1.0, 2.0], 1),
    lambda: critical_backward_per_byte(2, UNIT, 0),
])
def test_bad_input_raises_value_error(call: Any) -> None:
    with pytest.raises(ValueError):
        call()


# -- the measurement (one launch) ------------------------------------------------------------
@functools.cache
def _measured() -> tuple[dict[str, Any], dict[str, Any]]:
    from lslm.bench.ddp import QUICK_MODEL
    from lslm.bench.step_time_check import run

    return run(QUICK_MODEL, bucket_caps_mb=(0.05, 1.0), steps=2, warmup=1, comm_repeats=2)


def test_measurement_returns_consistent_fields() -> None:
    meas, cmp_ = _measured()
    assert meas["world_size"] == 2 and [r["name"] for r in meas["rows"]] == ["local", "bucketed 0.05", "bucketed 1"]
    for row in meas["rows"]:
        assert sum(row["bucket_bytes"]) == (meas["grad_bytes"] if row["name"] != "local" else 0)
        assert row["compute_s"] == pytest.approx(row["forward_s"] + row["backward_s"], rel=1e-6)
        assert all(math.isfinite(row[k]) and row[k] >= 0 for k in ("step_s", "compute_s", "exposed_s", "comm_alone_s"))
    assert len(meas["rows"][1]["bucket_bytes"]) > len(meas["rows"][2]["bucket_bytes"]) == 1
    assert max(r["bytes"] for r in meas["sweep"]) >= max(meas["rows"][2]["bucket_bytes"])
    assert set(meas["wall_s"]) == {"setup", "steps", "comm_alone", "sweep"}

    link, local = cmp_["link"], cmp_["local"]
    assert [r["name"] for r in cmp_["rows"]] == ["bucketed 0.05", "bucketed 1"]
    for r in cmp_["rows"]:
        p = predict_step(r["bucket_bytes"], 2, r["link"], local["compute_s"],
                         backward_fraction=cmp_["backward_fraction"], optimizer_s=local["optimizer_s"])
        # the row's link: the fit's shape, scaled to this cap's measured back-to-back time
        assert p.comm_s == pytest.approx(r["measured_comm_alone_s"], rel=1e-9)
        scale = r["measured_comm_alone_s"] / r["fit_comm_s"]
        assert r["link"].alpha_s == pytest.approx(link.alpha_s * scale)
        assert r["link"].beta_s_per_byte == pytest.approx(link.beta_s_per_byte * scale)
        assert r["predicted_step_s"] == p.step_s and r["predicted_exposed_s"] == p.exposed_s
        assert r["step_rel_error"] == pytest.approx((p.step_s - r["measured_step_s"]) / r["measured_step_s"])
        assert r["predicted_exposed_s"] >= r["last_bucket_s"] - 1e-15
    assert len(cmp_["sweep_rel_error"]) == len(meas["sweep"])
    # The model's link is fitted on the caps' own buckets back to back; comm-bound is read from the measurement.
    assert cmp_["link_source"] == "buckets"
    for r, row in zip(cmp_["rows"], meas["rows"][1:]):
        assert r["comm_bound"] == (row["comm_alone_s"] > local["backward_s"])
        assert r["model_comm_bound"] == (r["predicted_comm_s"] > cmp_["backward_fraction"] * local["compute_s"])
        assert r["comm_rel_error"] == pytest.approx((r["fit_comm_s"] - row["comm_alone_s"]) / row["comm_alone_s"])
        sweep = sum(ring_all_reduce_s(b, 2, cmp_["sweep_link"]) for b in r["bucket_bytes"])
        assert r["sweep_comm_rel_error"] == pytest.approx((sweep - row["comm_alone_s"]) / row["comm_alone_s"])
    print(f"step-time model vs measurement (quick model, not a benchmark): median |error| "
          f"{cmp_['median_abs_step_error']:.0%}")


def test_run_checks_input_before_launching() -> None:
    from lslm.bench.step_time_check import run

    for kwargs in ({"nproc": 1}, {"bucket_caps_mb": (0,)}, {"bucket_caps_mb": ()}, {"steps": 0}):
        with pytest.raises(ValueError):
            run(**kwargs)


def test_fit_on_bucket_totals_recovers_known_constants() -> None:
    from lslm.metrics.step_time import fit_ring_totals

    true = LinkCost(4e-4, 8e-10)
    lists = [split_buckets(14_800_896, int(mb * 2**20)) for mb in (0.25, 1.0, 4.0)]
    totals = [sum(ring_all_reduce_s(b, 2, true) for b in bs) for bs in lists]
    fit = fit_ring_totals(lists, totals, 2)
    assert fit.alpha_s == pytest.approx(true.alpha_s, rel=1e-9)
    assert fit.beta_s_per_byte == pytest.approx(true.beta_s_per_byte, rel=1e-9)
    fixed = fit_ring_totals(lists, totals, 2, alpha_s=true.alpha_s)  # only beta fitted
    assert fixed.beta_s_per_byte == pytest.approx(true.beta_s_per_byte, rel=1e-9)
    # More buckets taking less time: a negative alpha is non-physical, so the fit keeps one term.
    odd = fit_ring_totals([[1e6] * 10, [1e7]], [1e-3, 2e-3], 2)
    assert odd.alpha_s >= 0 and odd.beta_s_per_byte >= 0 and (odd.alpha_s == 0 or odd.beta_s_per_byte == 0)
    with pytest.raises(ValueError):
        fit_ring_totals([[1e6] * 2, [2e6] * 2], [1e-3, 2e-3], 2)  # one bucket count: alpha and beta not separable
