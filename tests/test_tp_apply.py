"""apply_tensor_parallel in one process: plans, bad sizes rejected before anything changes, what it builds.

A fake process group (``tests.helpers.fake_world``) stands in for rank r of a larger
world: sharding is real, collectives are no-ops, so shapes and errors can be checked
at any tensor-parallel size without launching processes.
"""

from __future__ import annotations

import pytest
import torch

from lslm.models.gpt import GPT, GPTConfig
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.tensor_parallel.apply import apply_tensor_parallel
from lslm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from lslm.tensor_parallel.random import TENSOR_PARALLEL_RNG, stream_seeds
from tests.helpers import fake_world


def _ctx(world: int, rank: int, tp: int) -> ParallelContext:
    return ParallelContext.create(RankGrid.build(world, tp=tp), rank=rank, local_rank=rank, node_rank=0,
                                  device=torch.device("cpu"), backend="fake", timeout_s=5)


def test_heads_that_do_not_divide_are_rejected_before_any_module_changes() -> None:
    with fake_world(0, 3):
        model = GPT(GPTConfig.tiny())
        before = {n: type(m) for n, m in model.named_modules()}
        with pytest.raises(ValueError, match="n_head=4 attention heads cannot be split over tp=3"):
            apply_tensor_parallel(model, _ctx(3, 0, 3))
        assert {n: type(m) for n, m in model.named_modules()} == before
        assert getattr(model, "tensor_parallel", None) is None


def test_the_error_names_the_heads_and_the_tp_size() -> None:
    # In the GPT every width is a multiple of the head count, so heads are what fails to divide
    # (Llama's intermediate_size can fail on its own: tests/test_tp_hf.py).
    with fake_world(1, 4):
        model = GPT(GPTConfig.tiny(n_head=6, n_embd=60))
        with pytest.raises(ValueError, match="n_head=6 attention heads cannot be split over tp=4"):
            apply_tensor_parallel(model, _ctx(4, 1, 4))


def test_the_plan_builds_megatron_layers_with_this_ranks_slices() -> None:
    with fake_world(1, 4):
        torch.manual_seed(0)
        serial = GPT(GPTConfig.tiny(vocab_size=250))
        torch.manual_seed(0)
        model = apply_tensor_parallel(GPT(GPTConfig.tiny(vocab_size=250)), _ctx(4, 1, 4))
        assert model.tensor_parallel.padded_vocab_size == 252
        block = model.blocks[0]
        assert isinstance(block.attn.c_attn, ColumnParallelLinear) and block.attn.c_attn.weight.shape == (48, 64)
        assert isinstance(block.attn.c_proj, RowParallelLinear) and block.attn.c_proj.weight.shape == (64, 16)
        assert isinstance(block.mlp.c_fc, ColumnParallelLinear) and block.mlp.c_fc.weight.shape == (64, 64)
        assert isinstance(model.wte, VocabParallelEmbedding) and model.wte.weight.shape == (63, 64)
        assert isinstance(model.lm_head, ColumnParallelLinear) and model.lm_head.weight.shape == (63, 64)
        # rank 1 of 4 holds head 1 of q, k and v: rows 16..31 of each
        full = serial.blocks[0].attn.c_attn.weight
        assert torch.equal(block.attn.c_attn.weight, torch.cat([full[16:32], full[80:96], full[144:160]]))
        assert torch.equal(block.attn.c_proj.weight, serial.blocks[0].attn.c_proj.weight[:, 16:32])
        assert torch.equal(model.wte.weight, serial.wte.weight[63:126])
        # replicated parameters are marked as such; LayerNorms are not sequence-parallel without SP
        assert not block.ln_1.weight.tensor_model_parallel and not block.ln_1.weight.sequence_parallel
        assert block.attn.c_attn.weight.tensor_model_parallel and block.attn.c_attn.weight.partition_dim == 0
        assert block.attn.c_proj.weight.partition_dim == 1
        with pytest.raises(ValueError, match="already tensor-parallel"):
            apply_tensor_parallel(model, _ctx(4, 1, 4))


def test_sequence_parallel_marks_the_replicated_parameters_with_partial_gradients() -> None:
    with fake_world(0, 2):
        model = apply_tensor_parallel(GPT(GPTConfig.tiny()), _ctx(2, 0, 2), sequence_parallel=True)
        marked = sorted(n for n, p in model.named_parameters() if p.sequence_parallel)
        assert marked == sorted(["wpe.weight", "ln_f.weight", "ln_f.bias"] +
                                [f"blocks.{i}.{m}" for i in range(2) for m in (
                                    "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                                    "attn.c_proj.bias", "mlp.c_proj.bias")])


def test_sequence_parallel_runs_the_gpt_sequence_first() -> None:
    with fake_world(0, 2):
        assert not apply_tensor_parallel(GPT(GPTConfig.tiny()), _ctx(2, 0, 2)).sequence_first
        model = apply_tensor_parallel(GPT(GPTConfig.tiny()), _ctx(2, 0, 2), sequence_parallel=True)
        assert model.sequence_first and all(block.attn.sequence_first for block in model.blocks)
        layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear,
                                                               VocabParallelEmbedding))]
        assert layers and all(m.sequence_dim == 0 for m in layers)  # the leading dimension: no rearrangement


def test_tied_weights_stay_tied() -> None:
    with fake_world(0, 2):
        model = apply_tensor_parallel(GPT(GPTConfig.tiny(tie_weights=True)), _ctx(2, 0, 2))
        assert model.lm_head.weight is model.wte.weight and model.wte.weight.shape == (512, 64)


def test_the_notebook_demos_show_what_they_claim() -> None:
    from lslm.demos import tensor_parallel_demo as demo

    assert all(err < 1e-5 for err in demo.split_matmul(t=4).values())
    orders = demo.mlp_orders(t=2)
    assert orders["column_then_row_error"] < 1e-5 and orders["row_then_column_with_reduce_error"] < 1e-5
    assert orders["row_then_column_without_reduce_error"] > 0.1  # GeLU of partial sums is not GeLU of the sum
    trap = demo.qkv_trap(t=2)
    assert trap["per_head_rows"] < 1e-5 and trap["plain_split"] > 0.1  # a plain chunk of the fused qkv is wrong


def test_the_models_own_loss_refuses_vocabulary_sharded_logits() -> None:
    # After apply_tensor_parallel the head gives this rank's slice of the padded vocabulary
    # (250 -> 252 over tp=4: 63 columns); GPT.forward(x, targets) says so instead of indexing past it.
    with fake_world(1, 4):
        model = apply_tensor_parallel(GPT(GPTConfig.tiny(vocab_size=250)), _ctx(4, 1, 4))
        x = torch.randint(0, 250, (2, 8))
        with pytest.raises(ValueError, match="63 logits per position but the vocabulary has 250 tokens"):
            model(x, x)


def test_apply_leaves_the_global_generator_alone_and_seeds_the_tensor_parallel_stream() -> None:
    # The default (replicated-dropout) stream is the caller's: apply_tensor_parallel must not
    # re-seed it; the per-rank tensor-parallel stream still starts from Megatron's seed.
    with fake_world(1, 2):
        ctx = _ctx(2, 1, 2)
        torch.manual_seed(5)
        model = GPT(GPTConfig.tiny(dropout=0.1))
        torch.rand(3)  # the caller's stream is somewhere of its own
        before = torch.get_rng_state()
        apply_tensor_parallel(model, ctx, rng_seed=7)
        assert torch.equal(torch.get_rng_state(), before)
        tp_seed = stream_seeds(7, tp_rank=1, pp_rank=0)[TENSOR_PARALLEL_RNG]
        assert torch.equal(ctx.rng.get_states()[TENSOR_PARALLEL_RNG],
                           torch.Generator().manual_seed(tp_seed).get_state())
        with ctx.rng.fork():  # the tensor-parallel stream draws what its seed gives
            drawn = torch.rand(4)
        assert torch.equal(drawn, torch.rand(4, generator=torch.Generator().manual_seed(tp_seed)))
        assert torch.equal(torch.get_rng_state(), before)  # forking left the caller's stream where it was
