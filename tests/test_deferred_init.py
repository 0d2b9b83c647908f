"""Meta-device construction (lslm.models.deferred_init): the serial weights, exactly, and only a rank's part in memory.

Single-process checks use torch's fake process group (no communication happens while a model
is split); one 2-rank gloo launch runs the start-up memory bench (lslm.bench.init_memory) on a tiny model.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lslm.bench.init_memory import leaf_bytes, main, table
from lslm.metrics.allocations import track_live_bytes
from lslm.models.deferred_init import is_meta, materialize_, serial_leaves
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.apply import PipelinePlan, apply_pipeline
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.tensor_parallel.apply import apply_tensor_parallel
from tests.helpers import fake_world

CONFIGS = {"plain": {}, "tied": {"tie_weights": True}, "no-bias": {"bias": False},
           "padded-vocab": {"vocab_size": 250, "n_layer": 3}}


def _meta(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def _serial(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def _ctx(world: int, rank: int, **sizes: int) -> ParallelContext:
    return ParallelContext.create(RankGrid.build(world, **sizes), rank=rank, local_rank=rank, node_rank=0,
                                  device=torch.device("cpu"), backend="fake", timeout_s=5)


def _same_params(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
        for attr in ("tensor_model_parallel", "partition_dim", "sequence_parallel", "replicated_heads"):
            assert getattr(pa[name], attr, None) == getattr(pb[name], attr, None), (name, attr)


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_replay_gives_the_serial_weights_and_generator_bit_for_bit(overrides: dict) -> None:
    cfg = GPTConfig.tiny(**overrides)
    serial = _serial(cfg, 7)
    after_serial = torch.get_rng_state()
    meta = _meta(cfg)
    names = []
    for name, leaf in serial_leaves(meta, 7):
        names.append(name)
        for attr, p in leaf.named_parameters(recurse=False):
            assert p.device.type == "cpu" and torch.equal(p, serial.get_submodule(name).get_parameter(attr))
    # Every leaf once (tied: the embedding and the head both), and the generator where the serial build left it.
    assert sorted(names) == sorted(n for n, m in serial.named_modules() if next(m.parameters(False), None) is not None)
    assert torch.equal(torch.get_rng_state(), after_serial)
    assert is_meta(meta)  # serial_leaves leaves the model alone
    materialize_(meta, "cpu", seed=7)
    assert not is_meta(meta)
    _same_params(meta, serial)
    assert (meta.lm_head.weight is meta.wte.weight) == cfg.tie_weights


def test_only_the_kept_leaves_get_memory_and_ties_survive() -> None:
    cfg = GPTConfig.tiny(tie_weights=True)
    serial = _serial(cfg, 0)
    model = materialize_(_meta(cfg), "cpu", seed=0, keep=lambda name: name.startswith("blocks.1") or name == "lm_head")
    for name, p in model.named_parameters():
        kept = name.startswith("blocks.1") or name == "wte.weight"  # wte.weight is the head's (tied) weight
        assert p.is_meta != kept, name
        if kept:
            assert torch.equal(p, serial.get_parameter(name))
    assert model.lm_head.weight is model.wte.weight


def test_start_memory_is_the_kept_part_plus_about_one_layer() -> None:
    cfg = GPTConfig.small()
    sizes = leaf_bytes(cfg)
    with track_live_bytes() as live:
        _serial(cfg, 0)
    assert live.peak["cpu"] == sizes["model_bytes"]  # the serial build allocates exactly the parameters
    with track_live_bytes() as live:
        model = materialize_(_meta(cfg), "cpu", seed=0, keep=lambda name: name.startswith("blocks.0."))
    held = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert live.current["cpu"] == held
    # One full-size scratch layer at a time, plus the kept block's c_proj biases that wait for their weights'
    # last draw (the residual scaling, at the very end).
    assert held < live.peak["cpu"] <= held + sizes["largest_leaf_bytes"] + 2 * cfg.n_embd * 4


@pytest.mark.parametrize("overrides,sp", [({}, False), ({"vocab_size": 250}, True), ({"tie_weights": True}, True),
                                          ({"bias": False, "n_head": 8}, False)],
                         ids=["plain", "padded-sp", "tied-sp", "no-bias"])
def test_tensor_parallel_shards_from_the_meta_device_equal_the_sharded_serial_model(overrides: dict, sp: bool) -> None:
    cfg = GPTConfig.tiny(**overrides)
    for rank in range(4):
        with fake_world(rank, 4):
            ctx = _ctx(4, rank, tp=4)
            expected = apply_tensor_parallel(_serial(cfg, 3), ctx, sequence_parallel=sp)
            after_serial = torch.get_rng_state()
            with track_live_bytes() as live:
                model = apply_tensor_parallel(_meta(cfg), ctx, sequence_parallel=sp, init_seed=3)
            assert torch.equal(torch.get_rng_state(), after_serial)
            _same_params(model, expected)
            assert (model.lm_head.weight is model.wte.weight) == cfg.tie_weights
            shards = sum(p.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
            assert live.current["cpu"] == shards
            # the shards, one full-size layer (tied: plus the head's own shard until it is re-tied), the c_proj
            # biases waiting for their weights' last draw
            layer, biases = leaf_bytes(cfg)["largest_leaf_bytes"], 2 * cfg.n_layer * cfg.n_embd * 4
            assert live.peak["cpu"] <= shards + layer * (1 + 1 / 4) + biases


def test_pipeline_stages_from_the_meta_device_equal_the_serial_stages() -> None:
    cfg = GPTConfig.tiny(n_layer=4)
    for rank in range(2):
        with fake_world(rank, 2):
            ctx = _ctx(2, rank, pp=2)
            plan = PipelinePlan(schedule="1f1b", microbatches=2)
            expected = apply_pipeline(_serial(cfg, 1), ctx, plan)
            pipe = apply_pipeline(_meta(cfg), ctx, plan, init_seed=1)
            got, want = dict(pipe.named_parameters()), dict(expected.named_parameters())
            assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
            # the other rank's stage never left the meta device
            other = [p for n, p in pipe.model.named_parameters() if n not in got]
            assert other and all(p.is_meta for p in other)


def test_tied_embedding_stages_from_the_meta_device_hold_the_serial_tied_values() -> None:
    """pp=2, GPT-2's tie: the first rank holds wte, the last its own head copy, both the serial tied tensor; the
    last rank's unused embedding stays a meta tensor (no memory, no copy)."""
    cfg = GPTConfig.tiny(n_layer=4, tie_weights=True)
    serial = _serial(cfg, 1)
    for rank in range(2):
        with fake_world(rank, 2):
            pipe = apply_pipeline(_meta(cfg), _ctx(2, rank, pp=2), PipelinePlan(schedule="1f1b", microbatches=2),
                                  init_seed=1)
            mine = "wte.weight" if rank == 0 else "lm_head.weight"
            got = dict(pipe.named_parameters())
            assert torch.equal(got[mine], serial.wte.weight) and pipe.tied_param is got[mine]
            assert pipe.tied_peer == 1 - rank
            if rank == 1:
                assert "wte.weight" not in got and pipe.model.wte.weight.is_meta
                assert pipe.model.lm_head.weight is not pipe.model.wte.weight


def test_bad_uses_are_refused_with_a_reason() -> None:
    cfg = GPTConfig.tiny()
    with pytest.raises(ValueError, match="meta device"):
        next(serial_leaves(GPT(cfg), 0))
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(2, 2))
        odd = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="init_steps"):
        next(serial_leaves(plain, 0))
    odd.init_steps = lambda: []
    odd[0].reset_parameters = None
    with pytest.raises(ValueError, match="reset_parameters"):
        next(serial_leaves(odd, 0))
    with fake_world(0, 2):
        ctx = _ctx(2, 0, tp=2)
        with pytest.raises(ValueError, match="init_seed"):
            apply_tensor_parallel(_meta(cfg), ctx)
        with pytest.raises(ValueError, match="already holds weights"):
            apply_tensor_parallel(GPT(cfg), ctx, init_seed=0)
        pctx = _ctx(2, 0, pp=2)
        with pytest.raises(ValueError, match="init_seed"):
            apply_pipeline(_meta(cfg), pctx, PipelinePlan(microbatches=2))
        with pytest.raises(ValueError, match="partition='time'"):
            apply_pipeline(_meta(cfg), pctx, PipelinePlan(microbatches=2, partition="time"), init_seed=0)


def test_the_start_memory_bench_on_two_gloo_ranks(tmp_path) -> None:
    records = main(["--quick", "--sizes", "2", "--out", str(tmp_path / "init_memory")])
    assert {(r["technique"], r["rank"]) for r in records} == {("tp", 0), ("tp", 1), ("pp", 0), ("pp", 1)}
    for r in records:
        assert r["equal"], r
        assert r["meta"]["held_bytes"] == r["meta"]["local_param_bytes"]
        assert r["meta"]["peak_bytes"] < r["full"]["peak_bytes"]
        assert r["full"]["peak_bytes"] >= r["model_bytes"]
        if r["technique"] == "pp":  # the pipeline keeps the GPT it was cut from: the whole model, built whole
            assert r["full"]["held_bytes"] == r["model_bytes"]
    assert (tmp_path / "init_memory.txt").read_text().strip() == table(records)
    assert json.loads((tmp_path / "init_memory.json").read_text())["records"] == records
