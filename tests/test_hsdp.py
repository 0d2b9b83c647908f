"""HSDP: the data axis split into dp_replicate x dp_shard (grid, context, ZeRO stages 1-3, the calculator).

One 4-process launch (2 replicas x 2 shards, tests/hsdp_workers.py) runs every multi-rank case: lslm's ZeRO in
HSDP mode against one process, DDP on the same ranks and torch's own HSDP (FSDP2 on a 2-D mesh), its ledger
bytes per group and its model-state bytes against the calculator. The byte checks at other sizes (dp = 8 as
2 x 4, dp = 6 as 2 x 3) run in this process in torch's fake process group (real sharding, no peers).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lslm.metrics.held import held_by_owner
from lslm.metrics.tolerance import adamw_param_atol
from lslm.models.gpt import GPT, GPTConfig
from lslm.plan import Layout, ModelSpec, estimate, hardware_presets
from lslm.plan.states import model_states
from lslm.recipes import zero as R
from lslm.recipes.train import TrainConfig, train
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.runtime.layout import format_layout, rank_layout
from lslm.zero.optimizer import GATHER_LABEL, REDUCE_SCATTER_LABEL, REPLICATE_LABEL, ZeroOptimizer
from tests.helpers import fake_world, run_workers
from tests.hsdp_workers import BUCKET_MB
from tests.zero_workers import CONFIG, ROWS

#: fp32, 3 AdamW steps (lr 1e-3) at dp = 4: the shard group's reduce-scatter and the replicas' all-reduce sum in
#: another order than one process's autograd, and AdamW runs over slices (other kernel lanes); AdamW turns those
#: roundings into a share of lr (lslm.metrics.tolerance). Measured 5.0e-7 on the parameters (AVX-512), 4.9e-6 with
#: gradient accumulation under ATEN_CPU_CAPABILITY=default, 2.4e-7 on the losses. A missing replica sum (a mean
#: over 2 instead of 4 ranks) or a wrong slice moves them by >= 1e-3.
ATOL = adamw_param_atol(steps=3, lr=1e-3)
#: The losses (~7) aggregate every element, so AdamW's per-element amplification averages out: a few fp32 ulps of
#: 7 (4.8e-7 each) from sums in another order. Measured <= 4.8e-7 on every capability tried.
LOSS_ATOL = 1e-5
H100 = hardware_presets()["h100-sxm"]


#: lslm.recipes.zero's settings for its --dp-shard run (tests/test_recipe_zero.py's, 3 steps).
RECIPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=1024, block_size=64, steps=3, log_every=100, batch_size=8)
#: The recipe against the serial recipe (lslm.recipes.train): tests/test_recipe_zero.py's tolerance.
RECIPE_RTOL = 1e-5


@pytest.fixture(scope="module")
def baseline(lslm_cache: Any) -> list[float]:
    """The serial recipe's losses (and a warm tokenizer / token cache for the ranks)."""
    return train(TrainConfig(**RECIPE))["losses"]


@pytest.fixture(scope="module")
def ranks(baseline: list[float]) -> list[dict[str, Any]]:
    return list(run_workers("tests.hsdp_workers:suite", 4, timeout=300, recipe=RECIPE))


# -- the grid and its tables (pure) ------------------------------------------------------------------
def test_grid_splits_dp_with_the_shard_axis_innermost() -> None:
    grid = RankGrid.build(8, tp=2, dp_shard=2)  # dp = 4 = 2 replicas x 2 shards
    assert (grid.dp, grid.dp_shard, grid.dp_replicate, grid.hsdp) == (4, 2, 2, True)
    # A shard group is consecutive along dp (dp ranks 0,1 | 2,3), tp still innermost in the global numbering.
    assert grid.groups("dp_shard") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert grid.groups("dp_replicate") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert grid.group_of(6, "dp_shard") == [4, 6] and grid.group_of(6, "dp_replicate") == [2, 6]
    assert [grid.dp_coords(r) for r in (0, 2, 4, 6)] == [
        {"dp_replicate": 0, "dp_shard": 0}, {"dp_replicate": 0, "dp_shard": 1},
        {"dp_replicate": 1, "dp_shard": 0}, {"dp_replicate": 1, "dp_shard": 1}]
    assert grid.table()[6] == {"rank": 6, "pp": 0, "dp": 3, "cp": 0, "tp": 0, "dp_replicate": 1, "dp_shard": 1}
    row = rank_layout(grid)[6]
    assert (row["dp_shard group"], row["dp_replicate group"], row["dp group"]) == ([4, 6], [2, 6], [0, 2, 4, 6])
    assert "dp_replicate=2 x dp_shard=2" in format_layout(grid)
    # Default: dp_shard = dp, nothing changes in the tables; the grid compares equal to the one built without it.
    plain = RankGrid.build(8, tp=2)
    assert plain.dp_shard == 4 and not plain.hsdp and plain == RankGrid.build(8, tp=2, dp_shard=4)
    assert set(plain.table()[0]) == {"rank", "pp", "dp", "cp", "tp"} and "dp_shard group" not in rank_layout(plain)[0]
    assert plain != grid
    with pytest.raises(ValueError, match=r"dp_shard=3 does not divide dp=4.*\[1, 2, 4\]"):
        RankGrid.build(8, tp=2, dp_shard=3)
    with pytest.raises(ValueError, match="positive integer"):
        RankGrid.build(4, dp_shard=0)
    with pytest.raises(ValueError, match="alone"):
        grid.groups("dp_shard", "tp")


def test_context_groups_and_ledger_names_in_a_fake_world() -> None:
    """Every rank's view: the two sub-groups exist, are registered in the ledger as "dp_shard" / "dp_replicate",
    and without HSDP they are the dp group and the single-rank group."""
    with fake_world(5, 8):
        ctx = ParallelContext.create(RankGrid.build(8, dp_shard=4), rank=5, local_rank=5, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        assert ctx.group_ranks("dp_shard") == [4, 5, 6, 7] and ctx.group_ranks("dp_replicate") == [1, 5]
        assert (ctx.dp_shard_rank, ctx.dp_replicate_rank, ctx.dp_shard_size, ctx.dp_replicate_size) == (1, 1, 4, 2)
        names = {ctx.comm.group_name(ctx.group(a)) for a in ("dp_shard", "dp_replicate")}
        assert names == {"dp_shard", "dp_replicate"}
        assert ctx.dp_mesh.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert ctx.describe()["dp_shard"] == 1
        plain = ctx.with_grid(tp=2)  # dp_shard defaults to dp: the sub-axes alias dp and self
        assert plain.group("dp_shard") is plain.group("dp")
        assert plain.comm.group_name(plain.group("dp_replicate")) == "self"
        assert ctx.with_grid(dp_shard=4) is ctx


# -- four processes: 2 replicas x 2 shards --------------------------------------------------------------
def test_hsdp_equals_one_process_ddp_and_torch_hsdp(ranks: list[dict[str, Any]]) -> None:
    r0 = ranks[0]
    assert [r["shard_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["replicate_group"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for r in ranks:
        for stage in (1, 2, 3):
            run = r[f"stage{stage}"]
            assert (run["shard_world"], run["replicas"]) == (2, 2)
            assert run["vs_serial"] <= ATOL and run["vs_ddp"] <= ATOL and run["loss_vs_serial"] <= LOSS_ATOL, stage
            assert r[f"stage{stage}_loss_vs_torch"] <= LOSS_ATOL
        assert r["stage2_clip_vs_ddp"] <= ATOL and r["stage3_accum2_vs_ddp"] <= ATOL
        # torch's HSDP (fully_shard on the 2-D mesh) runs on CPU/gloo and lands on the same parameters.
        assert r["torch_mesh"] == {"dims": ["dp_replicate", "dp_shard"], "mesh": [[0, 1], [2, 3]]}
        assert r["torch_vs_serial"] <= ATOL and r["torch_loss_vs_serial"] <= LOSS_ATOL
        assert max(r[f"stage{s}_params_vs_torch"] for s in (1, 2, 3)) <= ATOL
        assert r["torch_shard_numel"] * 2 >= r0["num_params"]  # FSDP2 holds a half too (its dim-0 chunks)
    # The replicas hold the same shards: every rank's losses are the same numbers.
    assert len({tuple(r["stage3"]["losses"]) for r in ranks}) == 1


def _by_group(traffic: dict[str, int]) -> dict[str, int]:
    out = {}
    for label, short in ((REDUCE_SCATTER_LABEL, "rs"), (GATHER_LABEL, "ag"), (REPLICATE_LABEL, "ar")):
        found = {k: v for k, v in traffic.items() if k.endswith("|" + label)}
        assert len(found) == 1, (label, traffic)
        ((key, value),) = found.items()
        out[f"{key.split('|')[0]} {short}"] = value
    return out


def test_ledger_bytes_per_group_equal_the_formula_and_the_calculator(ranks: list[dict[str, Any]]) -> None:
    """fp32 (4 bytes per element), padded buckets of the shard group: per step the shard group reduce-scatters and
    all-gathers the whole padded buffer (stage 3: each block gathered twice, the root once, per micro-batch), and
    the replicas all-reduce only the slice, 1/dp_shard of DDP's all-reduce of the buffer."""
    for r in ranks:
        for stage in (1, 2, 3):
            run = r[f"stage{stage}"]
            numel, units = sum(run["bucket_numels"]), run["bucket_numels"][:-1]
            gathered = 4 * (numel if stage < 3 else 2 * sum(units) + run["bucket_numels"][-1])
            assert _by_group(run["traffic"]) == {"dp_shard rs": 4 * numel, "dp_shard ag": gathered,
                                                 "dp_replicate ar": 4 * numel // 2}
            assert numel == r["num_params"]  # no padding at 2 shards for this model: DDP moves 4 x this
        acc = _by_group(r["stage3_accum2_traffic"])  # two micro-batches: twice inside, still once across
        assert acc["dp_replicate ar"] == 4 * r["num_params"] // 2 and acc["dp_shard rs"] == 2 * 4 * r["num_params"]
    spec = ModelSpec.from_gpt_config(GPTConfig(**CONFIG), micro_batch=ROWS // 4, global_batch=ROWS)
    for stage in (1, 2, 3):
        est = estimate(spec, Layout(dp=4, dp_shard=2, zero=stage, precision="fp32", bucket_mb=BUCKET_MB), H100)
        assert est.microbatches == 1
        predicted: dict[str, float] = {}
        for c in est.comm["dp"].collectives:
            predicted[c.axis] = predicted.get(c.axis, 0.0) + c.payload * c.count
        got = _by_group(ranks[0][f"stage{stage}"]["traffic"])
        assert predicted == pytest.approx({"dp_shard": got["dp_shard rs"] + got["dp_shard ag"],
                                           "dp_replicate": got["dp_replicate ar"]}, abs=1e-6), stage


def test_model_state_bytes_follow_dp_shard_as_the_calculator_says(ranks: list[dict[str, Any]]) -> None:
    """Every rank's bytes by owner after a step equal the calculator's for Layout(dp=4, dp_shard=2) at its shard rank
    (Adam's 4-byte step per piece aside), which are those of plain ZeRO at dp = 2, not 4."""
    for r in ranks:
        for stage in (1, 2, 3):
            run = r[f"stage{stage}"]
            psi = sum(run["bucket_params"])
            kw = dict(buckets=run["bucket_params"], rank=r["shard_rank"])
            got = {k: v.value for k, v in model_states(psi, Layout(dp=4, dp_shard=2, zero=stage, precision="fp32"),
                                                       **kw).device.items()}
            assert {**got, "optimizer_states": got["optimizer_states"] + 4 * run["pieces"]} == run["held"], stage
            as_dp2 = model_states(psi, Layout(dp=2, zero=stage, precision="fp32"), **kw).device
            assert got == {k: v.value for k, v in as_dp2.items()}
            as_dp4 = model_states(psi, Layout(dp=4, zero=stage, precision="fp32"), **kw).device_bytes
            assert sum(got.values()) > as_dp4


def test_recipe_dp_shard_reproduces_the_serial_run(ranks: list[dict[str, Any]], baseline: list[float]) -> None:
    for stage in (3,):
        recs = [r[f"recipe_stage{stage}"] for r in ranks]
        assert all(rec["losses"] == recs[0]["losses"] for rec in recs)
        assert recs[0]["losses"] == pytest.approx(baseline, rel=RECIPE_RTOL)
        for rec in recs:
            numel = rec["padded_numel"]
            assert (rec["dp_shard"], rec["dp_replicate"]) == (2, 2)
            assert rec["rs_bytes"] == [4 * numel] * RECIPE["steps"]
            assert rec["replicate_bytes"] == [4 * numel // 2] * RECIPE["steps"]
    with pytest.raises(ValueError, match=r"dp_shard=3 does not divide dp=4"):
        R.check_config(R.ZeroConfig(dp_shard=3), 4)
    with pytest.raises(ValueError, match="not written under HSDP"):
        R.check_config(R.ZeroConfig(dp_shard=2, checkpoint_dir="x", save_every=1), 4)


# -- the calculator at a larger size, against lslm in the fake process group --------------------------------
@pytest.mark.parametrize(("n", "dp_shard"), [(8, 4), (6, 3)])
def test_calculator_bytes_equal_lslm_in_the_fake_world(n: int, dp_shard: int) -> None:
    """dp = 8 as 2 x 4 and dp = 6 as 2 x 3 (padded buckets), bf16 with fp32 main_grad, two micro-batches: the
    ledger's bytes per group (a real ZeroOptimizer step on one rank) equal the calculator's per-axis payloads plus
    the layout's padding, and the rank's model states equal its model_states."""
    cfg, m, rank = GPTConfig.tiny(), 2, 5
    spec = ModelSpec.from_gpt_config(cfg, micro_batch=2, global_batch=2 * m * n)
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = GPT(cfg)
        with fake_world(rank, n):
            ctx = ParallelContext.create(RankGrid.build(n, dp_shard=dp_shard), rank=rank, local_rank=rank,
                                         node_rank=0, device=torch.device("cpu"), backend="fake", timeout_s=5)
            zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx, stage=stage,
                                 dtype=torch.bfloat16, bucket_cap_mb=0.25)
            x = torch.randint(0, cfg.vocab_size, (2, 16))
            zero.zero_grad()
            for _ in range(m):
                zero.backward(model(x, x)[1])
            zero.step()
            records = [r for r in ctx.comm.ledger.records if r.op in ("reduce_scatter", "all_gather", "all_reduce")
                       and r.label != "zero grad norm"]
            held, pieces = held_by_owner(model, zero), len(zero.layout.pieces)
            buckets = [(z - a, pad) for a, z, _, pad in zero.buckets]
            shard_rank = ctx.dp_shard_rank
        ledger = {axis: sum(r.nbytes for r in records if r.axis == axis) for axis in ("dp_shard", "dp_replicate")}
        assert ledger["dp_shard"] + ledger["dp_replicate"] == sum(r.nbytes for r in records)
        layout = Layout(dp=n, dp_shard=dp_shard, zero=stage, bucket_mb=0.25)
        est = estimate(spec, layout, H100)
        assert est.microbatches == m
        predicted = {axis: sum(c.payload * c.count for c in est.comm["dp"].collectives if c.axis == axis)
                     for axis in ledger}
        g, p, pads = 4, 2, [pad for _, pad in buckets]
        if stage < 3:
            pad_shard = sum(pads) * ({1: g, 2: m * g}[stage] + p)
        else:
            pad_shard = sum(pad * (2 * m * p + m * g) for pad in pads[:-1]) + pads[-1] * (m * p + m * g)
        assert ledger["dp_shard"] == pytest.approx(predicted["dp_shard"] + pad_shard, abs=1e-6), stage
        assert any(pads) or n == 8  # 3 shards pad this model's buckets, 4 do not
        assert ledger["dp_replicate"] == pytest.approx(predicted["dp_replicate"] + g * sum(pads) / dp_shard,
                                                       abs=1e-6), stage
        sizes = [size - pad for size, pad in buckets]
        got = {k: v.value for k, v in model_states(sum(sizes), layout, buckets=sizes, rank=shard_rank).device.items()}
        assert {**got, "optimizer_states": got["optimizer_states"] + 4 * pieces} == held, stage


def test_bad_hsdp_input_is_refused() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        Layout(dp=4, dp_shard=3, zero=1)
    with pytest.raises(ValueError, match="zero >= 1"):
        Layout(dp=4, dp_shard=2)
    assert Layout(dp=4, dp_shard=4, zero=1).dp_replicate == 1
    with fake_world(0, 4):
        ctx = ParallelContext.create(RankGrid.build(4, tp=2, dp_shard=1), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        model = GPT(GPTConfig.tiny())
        with pytest.raises(ValueError, match="pure data parallelism"):
            ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), ctx, stage=1)


def test_demo_refuses_splits_that_do_not_divide() -> None:
    from lslm.demos.hsdp_demo import hsdp_table

    with pytest.raises(ValueError, match=r"dp_shard=3 does not divide nproc=4; choose among \[1, 2, 4\]"):
        hsdp_table(4, (4, 3))


def test_lslm_plan_takes_dp_shard(capsys: pytest.CaptureFixture[str]) -> None:
    from lslm.cli import main

    argv = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000", "--seq", "128",
            "--global-batch", "16", "--devices", "8", "--zero", "3"]
    assert main([*argv, "--dp-shard", "4"]) == 0
    out = capsys.readouterr().out
    assert "dp 8 (replicate 2 x shard 4)" in out and "all-reduce across replicas" in out
    with pytest.raises(SystemExit):
        main([*argv, "--dp-shard", "3"])
    assert "dp_shard=3 does not divide dp=8" in capsys.readouterr().err
