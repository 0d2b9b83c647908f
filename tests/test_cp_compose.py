"""Context parallelism composed with tensor parallelism and gradient buffers; the expert-parallel MoE on buffers.

Multi-process: one 4-process launch (:mod:`tests.cp_compose_workers`) trains the GPT three SGD steps at
tp = 2 × cp = 2 (ring / zig-zag and Ulysses, with and without sequence parallelism, the latter on
gradient buffers), at dp = 2 × cp = 2 on gradient buffers, and the MoE GPT at ep = dp = 2 on
gradient buffers, each against the serial run on the same rank (losses and parameters); the ledger's
gradient all-reduces are counted against the buffers' buckets. Single-process: the refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch

from lslm.context_parallel import CPPlan, apply_context_parallel, check_context_parallel, reduce_context_parallel_grads
from lslm.data_parallel.ddp import make_ddp
from lslm.data_parallel.grad_sync import attach_grad_buffers, grad_kind, reduce_buffers
from lslm.expert_parallel import apply_expert_parallel, apply_moe, expert_parameters
from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.zero.optimizer import ZeroOptimizer
from tests.helpers import fake_world, nproc_backends, run_workers

TOL = 1e-5  # fp32; measured at most 4.8e-7 on the losses (~7) and 1.2e-7 on the parameters


def _fake_ctx(world: int, **sizes: int) -> ParallelContext:
    return ParallelContext.create(RankGrid.build(world, **sizes), rank=0, local_rank=0, node_rank=0,
                                  device=torch.device("cpu"), backend="fake")


# -- refusals ------------------------------------------------------------------------------------
def test_cp_x_tp_refuses_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match=r"n_head / tp = 4 / 2 = 2 is not divisible by cp = 4"):
        check_context_parallel(32, 4, 4, CPPlan("ulysses", "zigzag"), tp=2)
    check_context_parallel(32, 4, 4, CPPlan("ring", "zigzag"), tp=2)  # the ring splits no heads
    check_context_parallel(32, 2, 4, CPPlan("ulysses", "zigzag"), tp=2)
    with pytest.raises(ValueError, match=r"each cp rank's 10 tokens .* over tp = 4"):
        check_context_parallel(20, 2, 4, CPPlan("ring", "contiguous"), tp=4, sequence_parallel=True)
    with fake_world(0, 8):
        ctx = _fake_ctx(8, tp=2, cp=4)
        tp_model = apply_tensor_parallel(GPT(GPTConfig.tiny()), ctx, sequence_parallel=True)
        with pytest.raises(ValueError, match=r"n_head / tp = 4 / 2 = 2 is not divisible by cp = 4"):
            apply_context_parallel(tp_model, ctx, CPPlan("ulysses"))
        model = apply_context_parallel(tp_model, ctx, CPPlan("ring"))
        assert model.context_parallel.sequence_parallel and model.context_parallel.tp == 2
        assert isinstance(model.wpe, torch.nn.Embedding)  # positions by a pre-hook: names and TP's hook kept
        with pytest.raises(ValueError, match="call apply_tensor_parallel first"):
            apply_tensor_parallel(apply_context_parallel(GPT(GPTConfig.tiny()), ctx), ctx)


def test_experts_get_a_buffer_of_their_own_and_no_all_reduce() -> None:
    with fake_world(0, 2):
        ctx = _fake_ctx(2, dp=2)
        model = apply_expert_parallel(apply_moe(GPT(GPTConfig.tiny()), 4, 2), ctx)
        experts = {id(p) for p in expert_parameters(model)}
        assert {grad_kind(p) for p in model.parameters() if id(p) in experts} == {"ep"}
        assert {grad_kind(p) for p in model.parameters() if id(p) not in experts} == {"dp"}
        with pytest.raises(ValueError, match="expert-parallel MoE.*one_kind cannot hold it"):
            attach_grad_buffers(model, one_kind="dp")
        with pytest.raises(ValueError, match="experts are divided by ep, not averaged over dp"):
            ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), ctx)
        buffers = attach_grad_buffers(model)
        with pytest.raises(ValueError, match="'ep' gradient buffer"):
            make_ddp(model, ctx, broadcast_params=False)  # DDP would average the experts over dp
        assert sorted(b.kind for b in buffers) == ["dp", "ep"]
        with pytest.raises(ValueError, match="'ep' gradient buffer"):
            reduce_buffers(buffers, ctx, ctx.group("dp"), label="x")
        with pytest.raises(ValueError, match="expert-parallel MoE under context parallelism is not composed"):
            reduce_context_parallel_grads(model, ctx)


# -- across ranks --------------------------------------------------------------------------------
@functools.cache
def _suite(nproc: int, backend: str) -> tuple[dict, ...]:
    return tuple(run_workers("tests.cp_compose_workers:suite", nproc, backend=backend, timeout=300))


@pytest.mark.parametrize("nproc,backend", nproc_backends(4))
def test_cp_with_tp_and_buffers_trains_equal_to_serial(nproc: int, backend: str) -> None:
    """tp2 × cp2 ring and Ulysses (± sequence parallelism), dp2 × cp2 on buffers: losses and parameters."""
    for r in _suite(nproc, backend):
        runs = r["cp"]
        assert [(run["dp"], run["cp"], run["tp"], run["sp"], run["buffers"]) for run in runs] == [
            (1, 2, 2, False, False), (1, 2, 2, False, False), (1, 2, 2, True, True), (1, 2, 2, True, True),
            (2, 2, 1, False, True)]
        for run in runs:
            assert run["same_keys"] and run["loss_diff"] <= TOL and run["param_diff"] <= TOL, run
            assert run["losses"][-1] < run["losses"][0], run  # it trained
            assert run["kinds"] == (["dp", "sp"] if run["sp"] else ["dp"] if run["buffers"] else []), run


@pytest.mark.parametrize("nproc,backend", nproc_backends(4))
def test_cp_gradients_are_one_all_reduce_per_bucket_over_dp_x_cp(nproc: int, backend: str) -> None:
    for r in _suite(nproc, backend):
        for run in r["cp"]:
            ledger = run["ledger"]
            cp, sp = ledger["cp"], ledger["sp"]
            assert ledger["elements"] == ledger["local_numel"], run  # every local gradient summed once
            assert cp["group_sizes"] == [run["dp"] * run["cp"]], run
            assert cp["bytes"] == 4 * ledger["local_numel"], run  # fp32, unpadded: this rank's parameters once
            if run["buffers"]:  # one all-reduce per bucket, in place: the buffers' bytes exactly
                assert cp["count"] == cp["want_count"] > 1 and cp["bytes"] == cp["want_bytes"], run
            else:  # one flat all-reduce of the .grad tensors
                assert cp["count"] == 1 and cp["bytes"] == 4 * ledger["local_numel"], run
            if run["sp"]:  # the sequence-parallel buffer summed over tp first, bucket by bucket
                assert sp["count"] == sp["want_count"] >= 1 and sp["bytes"] == sp["want_bytes"] > 0, run
                assert sp["group_sizes"] == [run["tp"]], run
                # LayerNorms (2C each, two a block and ln_f), the row-parallel biases (C, two a block), wpe (T x C)
                C, L, T = 64, 2, 32
                assert sp["bytes"] == 4 * (L * (2 * 2 * C + 2 * C) + 2 * C + T * C), run
            else:
                assert sp["count"] == 0, run


@pytest.mark.parametrize("nproc,backend", nproc_backends(4))
def test_expert_parallel_on_buffers_equals_serial(nproc: int, backend: str) -> None:
    """ep = dp = 2: the experts' buffer divided (no collective), the dense ones averaged; layer and GPT training."""
    for r in _suite(nproc, backend):
        layer, moe = r["moe_layer"], r["moe"]
        assert layer["ep"] == moe["ep"] == 2 and layer["kinds"] == moe["kinds"] == ["dp", "ep"]
        assert layer["grad_experts"] <= 1e-6 and layer["grad_router"] <= 1e-6, layer
        # without the expert rule the gradients are wrong: unreduced (ep times too large) or averaged over dp like
        # a dense parameter (another rank's experts added in)
        assert layer["grad_experts_unreduced"] > 100 * TOL and layer["grad_experts_averaged_as_dense"] > 100 * TOL
        led = layer["ledger"]
        assert led["count"] == led["want_count"] and led["bytes"] == led["want_bytes"] and led["group_sizes"] == [2]
        assert led["bytes"] == 4 * 8 * 16  # the dense part is the router's gate: experts x width, fp32
        assert layer["other_ops"] == [] and layer["ep_buckets"] > 1, layer  # the experts' buckets never all-reduced
        assert moe["loss_diff"] <= TOL and moe["param_diff"] <= 1e-6, moe
