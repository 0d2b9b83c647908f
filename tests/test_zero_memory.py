"""ZeRO's frees checked by the allocator (glibc's mallinfo2), 2 and 4 gloo ranks, the GPT of lslm.bench.zero_memory.

One launch per world size measures stages 2, 3, 3 kept gathered (``reshard_after_forward=False``) and 3 without
prefetch (``prefetch=0``) in the same processes (the module-scoped fixture). What :mod:`lslm.metrics.zero3_window`
predicts from the unit sizes:

* without prefetch, the step's peak lies lower at stage 3 than kept by exactly the units freed: every unit but the
  one whose backward runs first. Nothing is gathered ahead, so no gloo copy of a unit in flight blurs it: within
  10 % of the formula (measured 0.998x at 2 and 4 ranks), and stage 3's peak lies below stage 2's too;
* with the default prefetch of one unit, the step's peak lies lower at stage 3 than kept, by every unit except the
  window (root, the unit whose backward runs first and the one prefetched behind it). gloo's all-gather fills a new
  flat tensor in its own thread while the transfer runs and copies it out: whether stage 3's sampled peak catches
  that copy of the prefetched unit depends on the threads' timing, so the gap lies between the prediction with the
  copy and without it, within 10 % of each (the bench's GPT measured 0.97x-1.16x of the first over four runs; this
  one 0.997x-1.05x at 2 and 4 ranks);
* stage 3's peak, states included, lies below stage 2's where the parameters predict it
  (:func:`~lslm.metrics.zero3_window.zero3_saving_vs_stage2` > 0: at 4 ranks, stage 3 keeps a quarter of the
  parameters and its window, a third of them; at 2 ranks, half of them and the window with gloo's copy of the
  prefetched unit come to about stage 2's whole parameters, and the test leaves the order alone);
* after each unit's forward, stage 3 holds on top of stage 2 (which gathers nothing; the activations are the same)
  at most the window: root + current unit + prefetch; kept gathered, it holds every unit so far (the check bites).

Slack for glibc's own reading (chunk headers, Python objects, gloo's buffers): 1 % plus 64 KiB.
"""

from __future__ import annotations

from typing import Any

import pytest

from lslm.bench.zero_memory import MODEL
from lslm.metrics.malloc import malloc_in_use_bytes
from tests.helpers import run_workers

pytestmark = pytest.mark.skipif(malloc_in_use_bytes() is None, reason="glibc's mallinfo2 reads the allocator")
SLACK = 64 * 1024
WORLDS = (2, 4)
#: The bench's GPT at width 192 and 6 rows a rank: cheaper, and the activations still put every peak at the start of
#: backward (each block 1.8 MB, the root a fifth of one).
TEST_MODEL, TEST_ROWS = {**MODEL, "n_embd": 192}, 6


@pytest.fixture(scope="module")
def measured() -> dict[int, dict[str, Any]]:
    """Rank 0's record per world size (every rank measures; rank 0 stands for them: the layouts differ by padding)."""
    variants = ["zero2", "zero3", "zero3-keep", "zero3-prefetch0"]
    return {n: run_workers("lslm.bench.zero_memory:worker", n, timeout=300, model=TEST_MODEL, rows=TEST_ROWS,
                           variants=variants, categories=False, counted=False)[0]
            for n in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
def test_without_prefetch_stage_3_peaks_below_keep_by_the_formulas_freed_units(measured: dict[int, Any],
                                                                                 world: int) -> None:
    r = measured[world]
    v, p = r["variants"], r["predicted"]
    p0, keep = v["zero3-prefetch0"], v["zero3-keep"]
    freed, predicted = keep["total"] - p0["total"], p["keep_minus_zero3_prefetch0"]
    assert predicted == sum(p["units"][:-1]) > 0  # every unit but the forward's last, whose backward runs first
    assert abs(freed - predicted) <= 0.1 * predicted, (freed, predicted)
    assert p0["total"] < v["zero2"]["total"], (p0["total"], v["zero2"]["total"])
    for k, (a, b) in enumerate(zip(v["zero2"]["after_unit_forward"], p0["after_unit_forward"], strict=True)):
        assert b - a <= p["root"] * 1.01 + SLACK, (k, b - a, p["root"])  # each unit freed: the root alone


@pytest.mark.parametrize("world", WORLDS)
def test_stage_3_peaks_below_keep_by_the_freed_units_and_below_stage_2(measured: dict[int, Any], world: int) -> None:
    r = measured[world]
    v, p = r["variants"], r["predicted"]
    assert len(p["units"]) == TEST_MODEL["n_layer"] >= 4 and p["gather_copy"]
    freed = v["zero3-keep"]["total"] - v["zero3"]["total"]
    lo, hi = p["keep_minus_zero3_with_copy"], p["keep_minus_zero3"]
    assert 0 < lo < hi and 0.9 * lo <= freed <= 1.1 * hi, (freed, lo, hi)
    if p["zero2_minus_zero3"] > 0:
        assert v["zero3"]["total"] < v["zero2"]["total"], (v["zero3"]["total"], v["zero2"]["total"])
    else:
        assert world == 2


@pytest.mark.parametrize("world", WORLDS)
def test_after_each_units_forward_stage_3_holds_at_most_its_window(measured: dict[int, Any], world: int) -> None:
    r = measured[world]
    v, p = r["variants"], r["predicted"]
    z2, z3, keep = (v[k]["after_unit_forward"] for k in ("zero2", "zero3", "zero3-keep"))
    assert len(z3) == len(p["units"])
    for k, (a, b, c) in enumerate(zip(z2, z3, keep, strict=True)):
        assert b - a <= p["window"] * 1.01 + SLACK, (k, b - a, p["window"])
        assert c - a >= p["root"] + sum(p["units"][:k + 1]) - SLACK, (k, c - a)  # kept: every unit so far
