"""3D parallelism (lslm.three_d): TP (+SP) inside pipeline stages, DP or ZeRO-1 across, against one process.

One launch of 8 gloo processes runs every 8-rank check in sequence (tests/three_d_workers.py), so
the processes start once (on 2 cores, starting 8 ranks costs about as much as a case's training):

* lslm's cases: each trains a tiny GPT for 3 AdamW steps with a clip that bites, on its grid, and
  is compared with the serial run: losses, the global gradient norm each step, every parameter shard;
* the same GPT with torch's own pieces (DTensor TP + ``torch.distributed.pipelining`` + FSDP2 on
  ``ctx.mesh``, :mod:`lslm.demos.three_d_torch`) against its serial run;
* the 3D recipe (:mod:`lslm.recipes.three_d`) at dp = tp = pp = 2 against the serial baseline
  recipe, with the stage-to-stage bytes of its schedule (its command line is run by
  tests/test_readme_commands.py, its settings checks by tests/test_recipe_three_d.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from lslm.metrics.tolerance import adamw_param_atol
from lslm.pipeline.apply import PipelinePlan
from lslm.recipes.train import TrainConfig, train
from lslm.runtime.grid import AXES, RankGrid
from lslm.runtime.layout import format_layout, rank_layout
from lslm.three_d import ThreeDPlan, check_3d
from tests.helpers import run_workers

pytestmark = pytest.mark.usefixtures("lslm_cache")  # conftest.py: the recipe's corpus in a per-session cache

#: fp32, 3 steps of AdamW (lr 1e-3) against one process. The losses (~4.6) aggregate every element: a few ulps from
#: micro-batch means summed in another order, measured <= 4.8e-7 on every CPU capability tried. The parameters carry
#: AdamW's amplified rounding (lslm.metrics.tolerance): measured 2.3e-6 on AVX-512 (3.8e-6 on a 4-rank tp x pp grid),
#: 1.2e-5 on an AVX2 EPYC, 2.3e-5 with ATEN_CPU_CAPABILITY=default; torch's own composition 4.1e-5 (default).
#: The relative gradient norm is a sum of squares over every element: <= 2.9e-7 everywhere.
#: A missing sequence-parallel sum moves them to 3e-3 / 6e-3 / 0.2, a tied copy counted twice in the norm to
#: 4e-6 / 4e-5 / 0.12 (measured by removing each: the norm and the loss checks catch what the parameter bound
#: alone would not).
LOSS_ATOL, PARAM_ATOL, NORM_RTOL = 1e-5, adamw_param_atol(steps=3, lr=1e-3), 1e-5

#: Every schedule family on dp = tp = pp = 2, with and without ZeRO-1 (ZeRO-1 with SP too), SP and tied embeddings;
#: and more shapes of 8 ranks (a 4-stage pipeline of tp pairs; 4 replicas of a tp pair, no pipeline, with ZeRO-1,
#: and with ZeRO-2 under SP: the sequence-parallel sum then runs on its gradient slices).
CASES: list[dict[str, Any]] = [
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b", "zero": 0, "tied": True},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b", "zero": 1, "tied": True},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "gpipe", "zero": 0, "sp": True},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "interleaved", "zero": 0, "sp": True, "tied": True},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "interleaved", "zero": 1, "sp": True},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "zb-h1", "zero": 0, "sp": True},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "zb-h1", "zero": 1, "sp": True, "tied": True},
    {"dp": 1, "tp": 2, "pp": 4, "schedule": "1f1b", "zero": 0, "sp": True, "tied": True, "m": 4},
    {"dp": 4, "tp": 2, "pp": 1, "schedule": "1f1b", "zero": 1, "tied": True},
    {"dp": 4, "tp": 2, "pp": 1, "schedule": "1f1b", "zero": 2, "sp": True, "tied": True},
]


def _name(case: dict[str, Any]) -> str:
    flags = [f for f in ("sp", "tied") if case.get(f)]
    return (f"dp{case['dp']}-tp{case['tp']}-pp{case['pp']}-{case['schedule']}-zero{case['zero']}"
            + "".join(f"-{f}" for f in flags))


#: torch's composition at dp = tp = pp = 2 (FSDP2 over dp): 1F1B, interleaved 1F1B, and 1F1B with sequence
#: parallelism.
TORCH_CASES: list[dict[str, Any]] = [
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b"},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "interleaved"},
    {"dp": 2, "tp": 2, "pp": 2, "schedule": "1f1b", "sp": True},
]

#: The recipe: fp32, ``rel=1e-5`` per step on the loss, as for the DDP, TP and pipeline recipes (the same numbers
#: added in another order: micro-batch means, tp partial sums, the dp average). Measured: 7.0e-8 relative at most
#: over both runs; a dropped micro-batch or a missing reduction moves the loss by far more.
RECIPE_RTOL = 1e-5
RECIPE_STEPS, L, C, T, B = 3, 4, 32, 32, 8
SMALL = dict(n_layer=L, n_head=2, n_embd=C, vocab_size=1024, block_size=T, batch_size=B, steps=RECIPE_STEPS,
             log_every=100)
GRID = dict(dp=2, tp=2, pp=2)
#: ZeRO-1 with sequence parallelism under 1F1B, and interleaved 1F1B with SP (activations cross as sequence shards);
#: each with a recomputation mode too (which must change no loss).
RECIPE_RUNS = ({"schedule": "1f1b", "microbatches": 2, "zero": 1, "sequence_parallel": True, "recompute": "selective"},
               {"schedule": "interleaved", "microbatches": 2, "sequence_parallel": True, "recompute": "full"})


@pytest.fixture(scope="module")
def baseline() -> list[float]:
    """The serial recipe's losses (run before the launch: it fills the corpus cache the 8 ranks then read)."""
    return train(TrainConfig(**SMALL))["losses"]


@pytest.fixture(scope="module")
def results(baseline: list[float]) -> list[dict[str, Any]]:
    """Every rank's results of the one 8-process launch (lslm's cases, torch's, the recipe's runs)."""
    return run_workers("tests.three_d_workers:suite", 8, timeout=300, cases=CASES, torch_native=TORCH_CASES,
                       recipe_runs=list(RECIPE_RUNS), recipe_common={**SMALL, **GRID})


@pytest.mark.parametrize("i", range(len(CASES)), ids=[_name(c) for c in CASES])
def test_3d_training_equals_the_serial_run(results: list[dict[str, Any]], i: int) -> None:
    per_rank = [r["cases"][i] for r in results]
    worst = {k: max(r[k] for r in per_rank) for k in ("dloss", "dparam", "dnorm")}
    assert worst["dloss"] <= LOSS_ATOL, worst
    assert worst["dnorm"] <= NORM_RTOL, worst
    assert worst["dparam"] <= PARAM_ATOL, worst
    for r in per_rank:
        # Each parameter has the serial shard's shape (no broadcasting hid a wrong slice) ...
        assert all(tuple(a) == tuple(b) for a, b in r["shapes"].values()), r["shapes"]
        # ... and the meta-device build gave storage to this rank's stages only.
        assert r["outside"] == [], r["outside"]


def test_every_rank_holds_its_stages_and_the_pipeline_covers_the_model(results: list[dict[str, Any]]) -> None:
    case = CASES[0]  # dp = tp = pp = 2, tied: the first stage holds the embedding, the last the head's copy
    per_rank = [r["cases"][0] for r in results]
    by_pp: dict[int, set[str]] = {}
    for r in per_rank:
        by_pp.setdefault(r["coords"]["pp"], set()).add(frozenset(r["names"]))
    assert all(len(v) == 1 for v in by_pp.values())  # every tp and dp rank of a stage holds the same names
    first, last = (next(iter(by_pp[p])) for p in (0, case["pp"] - 1))
    assert "wte.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "wte.weight" not in last
    assert not first & last  # disjoint layers


def test_layout_puts_tp_innermost_and_every_group_is_the_grids() -> None:
    for world, sizes in ((8, {"tp": 2, "pp": 2}), (16, {"tp": 4, "pp": 2}), (16, {"tp": 2, "pp": 2, "cp": 2})):
        grid = RankGrid.build(world, **sizes)
        rows = rank_layout(grid)
        assert [r["rank"] for r in rows] == list(range(world))
        for r in rows:
            assert grid.rank_of(**{a: r[a] for a in AXES}) == r["rank"]
            for a in AXES:
                if grid.sizes[a] > 1:
                    assert r[f"{a} group"] in grid.groups(a)
                    assert r["rank"] in r[f"{a} group"]
        # tp groups are runs of consecutive ranks (one node's fastest links); pp groups stride by everything inside.
        inner = grid.tp
        assert all(r["tp group"] == list(range(r["rank"] - r["tp"], r["rank"] - r["tp"] + inner)) for r in rows)
        stride = world // grid.pp
        assert all(r["pp group"] == [r["rank"] % stride + k * stride for k in range(grid.pp)] for r in rows)
        text = format_layout(grid)
        assert len(text.splitlines()) == world + 2 and "tp group" in text


def test_layout_of_eight_ranks_reads_as_the_formula() -> None:
    grid = RankGrid.build(8, tp=2, pp=2)
    row = rank_layout(grid)[5]  # 5 = (pp 1 * dp 2 + dp 0) * tp 2 + tp 1
    assert row == {"rank": 5, "pp": 1, "dp": 0, "cp": 0, "tp": 1, "tp group": [4, 5], "dp group": [5, 7],
                   "pp group": [1, 5]}


@pytest.mark.parametrize(("change", "match"), [
    ({"zero": 2}, "zero=2 with pp=2"),
    ({"zero": 3}, "ZeRO stages"),
    ({"partition": "params"}, "equal blocks"),
])
def test_check_3d_refuses_what_does_not_compose(change: dict[str, Any], match: str) -> None:
    pipeline = PipelinePlan("1f1b", microbatches=2, partition=change.pop("partition", "layers"))
    plan = ThreeDPlan(pipeline, **change)
    with pytest.raises(ValueError, match=match):
        check_3d(plan, tp=2, pp=2, dp=2, n_layer=4, n_head=2, n_embd=32, block_size=16, batch_size=8,
                 vocab_size=96)


def test_check_3d_names_sizes_that_do_not_divide() -> None:
    plan = ThreeDPlan(PipelinePlan("1f1b", microbatches=2), sequence_parallel=True)
    with pytest.raises(ValueError, match="3 attention heads"):
        check_3d(plan, tp=2, pp=2, dp=2, n_layer=4, n_head=3, n_embd=36, block_size=16, batch_size=8, vocab_size=96)
    with pytest.raises(ValueError, match="block_size"):
        check_3d(plan, tp=2, pp=2, dp=2, n_layer=4, n_head=2, n_embd=32, block_size=15, batch_size=8, vocab_size=96)
    with pytest.raises(ValueError, match="dp=2"):
        check_3d(plan, tp=2, pp=2, dp=2, n_layer=4, n_head=2, n_embd=32, block_size=16, batch_size=7, vocab_size=96)


def test_torch_native_3d_equals_the_serial_run(results: list[dict[str, Any]]) -> None:
    """DTensor TP on ``ctx.mesh["tp"]`` + ``torch.distributed.pipelining`` (1F1B, interleaved) over pp + FSDP2's
    ``fully_shard`` over ``ctx.mesh["dp"]``, at dp = tp = pp = 2 on CPU: 3 AdamW steps equal the serial run.

    Measured: |Δloss| = 0.0, parameters within 1.6e-6 on AVX-512, 4.1e-5 under ATEN_CPU_CAPABILITY=default (the
    tolerances above). Where it stops is lslm's side,
    not torch's: the DTensor reference and ``TorchPipeline`` refuse tied embeddings (checked here: the
    messages come back from the ranks), and without FSDP the replicas' DTensor gradients would need a
    DTensor-aware dp average (lslm's flat one concatenates plain tensors), so plain dp runs only at dp = 1.
    """
    for r in results:
        torch_side = r["torch"]
        for case, got in zip(TORCH_CASES, torch_side["cases"], strict=True):
            assert got["fsdp"], case  # dp = 2: FSDP2 averages the replicas
            assert len(got["losses"]) == len(got["ref_losses"]) == 3
            assert got["dloss"] <= LOSS_ATOL and got["dparam"] <= PARAM_ATOL, (case, got)
            assert got["dparam_all"] == max(x["torch"]["cases"][TORCH_CASES.index(case)]["dparam"]
                                            for x in results)
        refusals = torch_side["tied_refusals"]
        assert "tie_weights=False" in refusals["parallelize_gpt"] and "tie_weights=False" in refusals["TorchPipeline"]


def _stage_to_rank(p: int, v: int) -> list[int]:
    return [s % p for s in range(p * v)]


def test_the_3d_recipe_reproduces_the_serial_run(results: list[dict[str, Any]], baseline: list[float]) -> None:
    """lslm.recipes.three_d at dp = tp = pp = 2: the losses are the serial baseline recipe's and the
    stage-to-stage bytes are exactly the schedule's (one micro-batch's activation and its gradient per crossing)."""
    for i, run in enumerate(RECIPE_RUNS):
        records = [r["recipe"][i] for r in sorted(results, key=lambda r: r["rank"])]
        assert records[0]["losses"] == pytest.approx(baseline, rel=RECIPE_RTOL), run
        print(run, "max relative loss difference", max(abs(a - b) / b for a, b in zip(records[0]["losses"],
                                                                                    baseline)))
        m, v = run["microbatches"], records[0]["virtual_stages"]
        s2r = _stage_to_rank(2, v)
        shards = GRID["tp"] if run.get("sequence_parallel") else 1
        msg = (B // GRID["dp"] // m) * T * C * 4 // shards  # one micro-batch's activation (or its gradient), fp32
        for r in records:
            assert r["losses"] == records[0]["losses"]
            assert (r["dp_size"], r["tp_size"], r["pp_size"]) == (2, 2, 2)
            assert r["recompute"] == run["recompute"]
            pp_rank = r["coords"]["pp"]
            assert r["stages"] == [s for s, rank in enumerate(s2r) if rank == pp_rank]
            crossings = sum((s > 0 and s2r[s - 1] != pp_rank) + (s < len(s2r) - 1 and s2r[s + 1] != pp_rank)
                            for s in r["stages"])
            assert r["pp_comm_bytes"] == [2 * m * crossings * msg] * RECIPE_STEPS, run
