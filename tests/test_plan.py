"""lslm.plan, the memory / communication / time calculator: published figures reproduced, lslm's own bytes
matched exactly, bad layouts refused.

Each test cites the figure it reproduces. Counts that a library can give us are measured here (lslm's GPT,
Hugging Face's Llama on the meta device, lslm's ZeRO optimizer in torch's fake process group), not typed in.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lslm.data_parallel.buckets import cap_bytes, flat_layout
from lslm.metrics.activation_theory import korthikanti_layer_bytes
from lslm.metrics.held import held_by_owner
from lslm.metrics.zero_estimates import deepspeed_zero2_estimate, deepspeed_zero3_estimate, lslm_bytes, paper_bytes
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.theory import activation_memory_theory, bubble_time_theory, busy_time
from lslm.plan import Layout, ModelSpec, estimate, hardware_presets, model_presets, search, sizing_answers
from lslm.plan.activations import in_flight_layers, layer_activation_bytes
from lslm.plan.params import gpt_tensor_numels, largest_tensor, megatron_params, param_parts, playbook_params
from lslm.plan.states import model_states
from lslm.plan.timing import model_flops, narayanan_flops
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.zero.layout import unit_layout
from lslm.zero.optimizer import ZeroOptimizer
from tests.helpers import fake_world

H100 = hardware_presets()["h100-sxm"]


def _states(psi: int, **layout: object) -> float:
    return model_states(psi, Layout(**layout)).device_bytes  # type: ignore[arg-type]


# -- model states: the ZeRO paper, Megatron, DeepSpeed ------------------------------------------------
def test_zero_paper_7_5b_on_64_devices() -> None:
    """Rajbhandari et al. 2020, Figure 1 and §5.4: Ψ = 7.5B, N_d = 64, mixed precision Adam (K = 12):
    120 / 31.4 / 16.6 / 1.9 GB per device for DDP and stages 1, 2, 3."""
    psi = 7_500_000_000
    got = [_states(psi, dp=64, zero=z, precision="fp16", grad_dtype="param") for z in (0, 1, 2, 3)]
    assert [round(b / 1e9, 1) for b in got] == [120.0, 31.4, 16.6, 1.9]
    assert got == [paper_bytes(z, psi, 64) for z in (0, 1, 2, 3)]  # lslm.metrics' formula, to the byte


@pytest.mark.parametrize("d", [2, 4, 8, 64])
def test_megatron_bytes_per_parameter(d: int) -> None:
    """Megatron-LM, docs "Distributed Optimizer": bytes per parameter with bf16 parameters and fp32 gradients are
    18 without the distributed optimizer and 6 + 12/d with it (d data-parallel ranks); fp32 parameters and
    gradients: 16 and 8 + 8/d."""
    psi = 3 * 2**20 * 64  # divisible by every d: no padding
    assert _states(psi, dp=d, zero=0, precision="bf16") == 18 * psi
    assert _states(psi, dp=d, zero=1, precision="bf16") == (6 + 12 / d) * psi
    assert _states(psi, dp=d, zero=0, precision="fp32") == 16 * psi
    assert _states(psi, dp=d, zero=1, precision="fp32") == (8 + 8 / d) * psi


@pytest.mark.parametrize("d", [2, 8])
def test_megatron_fp16_gradients_row_and_why_we_differ(d: int) -> None:
    """Megatron-LM's "float16 param, float16 grads" row: 20 and 4 + 16/d. Megatron's fp16 optimizer keeps an fp32
    copy of each gradient for the fp32 masters to step on (4 bytes, partitioned with the distributed optimizer);
    the ZeRO paper's accounting, and ours with ``grad_dtype="param"``, does not: 16 and 4 + 12/d."""
    psi = 3 * 2**20 * 64
    assert _states(psi, dp=d, zero=0, precision="fp16", grad_dtype="param") + 4 * psi == 20 * psi
    assert _states(psi, dp=d, zero=1, precision="fp16", grad_dtype="param") + 4 * psi / d == (4 + 16 / d) * psi


def test_deepspeed_estimator_rows_for_gpt2_small_on_8_devices() -> None:
    """DeepSpeed's estimate_zero2/zero3_model_states_mem_needs (re-derived in lslm.metrics.zero_estimates) for GPT-2
    small (124,439,808 parameters, tied head; the largest layer the 50,257 x 768 embedding) on one node of 8.

    Stage 3 without offload: DeepSpeed's ``4 · largest + 18Ψ/N``; ours partitions the same 2 + 4 + 4 + 8 = 18
    bytes and keeps its gathered layers as communication buffers, not the largest layer in fp32. Stage 2:
    DeepSpeed's ``2Ψ + 18Ψ/N`` counts a 2-byte fp16 gradient partition beside the fp32 one; lslm (and Megatron)
    reduce-scatter straight into the fp32 ``main_grad`` slice: ``2Ψ + 16Ψ/N``.
    """
    gpt2 = model_presets()["gpt2-small"]
    psi, n = param_parts(gpt2).total, 8
    assert psi == 124_439_808 and largest_tensor(gpt2) == 50_257 * 768
    z3 = deepspeed_zero3_estimate(psi, largest_tensor(gpt2), gpus_per_node=n)[4]
    ours3 = _states(psi, dp=n, zero=3)
    assert ours3 == 18 * psi / n and z3.gpu_bytes - ours3 == 4 * largest_tensor(gpt2)
    z2 = deepspeed_zero2_estimate(psi, gpus_per_node=n)[1]
    ours2 = _states(psi, dp=n, zero=2)
    assert ours2 == 2 * psi + 16 * psi / n and z2.gpu_bytes - ours2 == pytest.approx(2 * psi / n, abs=1)


def test_offload_moves_masters_and_optimizer_states_to_the_host() -> None:
    """ZeRO-Offload (Ren et al. 2021): with the optimizer on the host the device keeps 2Ψ + 4Ψ/N (stage 2, bf16,
    fp32 gradient slices) and the host 16Ψ/N (fp32 masters, Adam's moments, the fp32 gradient slice it steps
    with): DeepSpeed's stage-2 estimator counts the same 16 bytes per parameter on the CPU (``16Ψ`` per node
    with ``zero_init``, lslm.metrics.zero_estimates)."""
    psi, n = 8 * 2**20, 8
    s = model_states(psi, Layout(dp=n, zero=2, offload="cpu"))
    assert s.device_bytes == 2 * psi + 4 * psi / n
    assert sum(t.value for t in s.host.values()) == 16 * psi / n
    assert deepspeed_zero2_estimate(psi, gpus_per_node=n)[0].gpu_bytes == 2 * psi  # DeepSpeed keeps no grad slice


# -- lslm's own ZeRO, exactly -----------------------------------------------------------------------
def _held_by_lslm(stage: int, n: int, rank: int, dtype: torch.dtype, cap_mb: float) -> tuple[dict[str, int], int]:
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    with fake_world(rank, n):
        ctx = ParallelContext.create(RankGrid.build(n), rank=rank, local_rank=rank, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx, stage=stage, dtype=dtype,
                             bucket_cap_mb=cap_mb)
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        zero.zero_grad()
        zero.backward(model(x, x)[1])
        zero.step()
        return held_by_owner(model, zero), len(zero.layout.pieces)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_state_bytes_equal_lslm_zero_exactly(stage: int, n: int) -> None:
    """The calculator, given the buckets lslm's layout functions make (flat_layout: reverse order, 0.25 MiB cap;
    unit_layout: a bucket per block and one for the rest), predicts every owner's bytes of a real
    ZeroOptimizer after a step, on every rank, padding included (Adam's 4-byte step per piece aside)."""
    spec = ModelSpec.from_gpt_config(GPTConfig.tiny())
    numels = gpt_tensor_numels(spec)
    assert numels == [p.numel() for p in GPT(GPTConfig.tiny()).parameters()]
    cap = 0.25
    if stage < 3:
        _, buckets, _ = flat_layout(numels, 4, cap_bytes(cap), n)
    else:
        per_block = len(numels[2:-3]) // spec.n_layer  # wte, wpe | blocks | ln_f weight, bias, lm_head
        blocks = [list(range(2 + i * per_block, 2 + (i + 1) * per_block)) for i in range(spec.n_layer)]
        root = [i for i in range(len(numels)) if not any(i in b for b in blocks)]
        _, buckets, _ = unit_layout([*blocks, root], numels, n)
    sizes = [end - start - pad for start, end, _, pad in buckets]
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for rank in range(n):
            held, pieces = _held_by_lslm(stage, n, rank, dtype, cap)
            predicted = model_states(sum(numels), Layout(dp=n, zero=stage, precision=precision),
                                     buckets=sizes, rank=rank).device
            got = {k: v.value for k, v in predicted.items()}
            assert {**got, "optimizer_states": got["optimizer_states"] + 4 * pieces} == held, (precision, rank)
    # and the totals agree with lslm.metrics' exact formula (rank 0, padded numel, owned elements)
    padded = sum(end - start for start, end, _, _ in buckets)
    owned = model_states(sum(numels), Layout(dp=n, zero=stage), buckets=sizes).device["optimizer_states"].value / 8
    total = model_states(sum(numels), Layout(dp=n, zero=stage), buckets=sizes).device_bytes
    assert total == lslm_bytes(stage, padded, int(owned), n)


@pytest.mark.parametrize("n", [64, 512])
def test_model_state_bytes_at_large_data_parallel_sizes(n: int) -> None:
    """At 64 and 512 ranks (torch's fake process group: real sharding, no peers) the first and last ranks' bytes,
    padding included, equal the calculator's (stage 3: the block buckets are padded to n, the root too)."""
    spec = ModelSpec.from_gpt_config(GPTConfig.tiny())
    numels = gpt_tensor_numels(spec)
    for stage in (1, 3):
        if stage == 1:
            _, buckets, _ = flat_layout(numels, 4, cap_bytes(25.0), n)
        else:
            per_block = len(numels[2:-3]) // spec.n_layer
            blocks = [list(range(2 + i * per_block, 2 + (i + 1) * per_block)) for i in range(spec.n_layer)]
            root = [i for i in range(len(numels)) if not any(i in b for b in blocks)]
            _, buckets, _ = unit_layout([*blocks, root], numels, n)
        sizes = [end - start - pad for start, end, _, pad in buckets]
        for rank in (0, n - 1):
            held, pieces = _held_by_lslm(stage, n, rank, torch.bfloat16, 25.0)
            got = {k: v.value for k, v in model_states(sum(numels), Layout(dp=n, zero=stage), buckets=sizes,
                                                       rank=rank).device.items()}
            assert {**got, "optimizer_states": got["optimizer_states"] + 4 * pieces} == held, (stage, rank)


def test_plain_data_parallel_bytes_equal_lslm_s_measured_model_states() -> None:
    """Stage 0 in fp32: 16 bytes per parameter, what lslm.metrics.model_state_bytes measures on a GPT after one
    AdamW step, less AdamW's 4-byte step scalar per tensor."""
    from lslm.metrics.model_state import model_state_bytes

    cfg = GPTConfig.tiny(tie_weights=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    measured = model_state_bytes(model, opt)
    spec = ModelSpec.from_gpt_config(cfg)
    predicted = model_states(param_parts(spec).total, Layout(precision="fp32")).device_bytes
    assert predicted == measured.total - 4 * measured.num_param_tensors


# -- activations: Korthikanti et al. 2022, Table 2 ----------------------------------------------------
@pytest.mark.parametrize("t", [1, 2, 8])
def test_korthikanti_table_2_per_layer(t: int) -> None:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer (2-byte activations, 1-byte masks)."""
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer, micro-batch 1
    spec = ModelSpec(96, h, a, 51200, s)

    def acts(**kw: object) -> float:
        return layer_activation_bytes(spec, Layout(tp=t, **kw))  # type: ignore[arg-type]

    sbh = s * b * h
    if t == 1:
        assert acts() == pytest.approx(sbh * (34 + 5 * a * s / h))  # no parallelism
        assert acts(recompute="selective") == pytest.approx(34 * sbh)
    else:
        assert acts() == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))  # tensor parallel
        assert acts(sequence_parallel=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))  # + sequence parallel
        assert acts(recompute="selective") == pytest.approx(sbh * (10 + 24 / t))  # + selective recompute
        assert acts(sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / t)
        assert acts(sequence_parallel=True, recompute="full") == pytest.approx(2 * sbh / t)
    assert acts(recompute="full") == pytest.approx(2 * sbh)  # full recompute: the layer's input only
    assert acts(flash_attention=True) == acts(recompute="selective")  # no s^2 tensors either way
    assert acts() == korthikanti_layer_bytes(s, b, h, a, t)  # lslm.metrics' implementation of the same table


def test_korthikanti_total_activation_memory_on_the_first_stage() -> None:
    """Korthikanti et al. 2022, §4.2.3 / eq. 5: with 1F1B the first stage holds p micro-batches of L/p layers, so
    ``sbhL/t (34 + 5as/h)`` with TP + SP whatever p, times ``1 + (p - 1)/(p v)`` interleaved."""
    s, b, h, a, L, p, t = 2048, 1, 12288, 96, 96, 8, 8
    spec = ModelSpec(L, h, a, 51200, s, micro_batch=b, global_batch=64)
    per_layer = s * b * h / t * (34 + 5 * a * s / h)
    for v in (1, 2, 4):
        layout = Layout(dp=1, tp=t, pp=p, v=v, sequence_parallel=True)
        total = in_flight_layers(spec, layout, 64) * layer_activation_bytes(spec, layout)
        assert total == pytest.approx(per_layer * L * (1 + (p - 1) / (p * v) if v > 1 else 1))


def test_in_flight_and_bubble_agree_with_lslm_pipeline_theory() -> None:
    """The same counts as lslm.pipeline.theory (a layer above lslm.plan, so the plan states them itself)."""
    spec = ModelSpec(48, 256, 8, 1000, 64, global_batch=32)
    for p, v, m in [(2, 1, 8), (4, 1, 2), (4, 2, 8), (8, 3, 16)]:
        spec = dataclasses.replace(spec, n_layer=p * v * 2)
        layout = Layout(pp=p, v=v)
        for rank in range(p):
            chunks = activation_memory_theory("interleaved" if v > 1 else "1f1b", p, m, v, rank)
            assert in_flight_layers(spec, layout, m, rank) == chunks * spec.n_layer / (p * v)
        name = "interleaved" if v > 1 else "1f1b"
        assert bubble_time_theory(name, p, m, v) / busy_time(name, p, m, v) == pytest.approx((p - 1) / (v * m))


# -- parameter counts -------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [{}, {"tie_weights": True}, {"bias": False}, {"n_layer": 3, "n_embd": 96,
                                                                                  "n_head": 3, "tie_weights": True}])
def test_exact_count_equals_lslm_gpt(overrides: dict) -> None:
    """param_parts(spec).total == sum(p.numel() for p in GPT(cfg).parameters()), tied or not, bias or not."""
    cfg = GPTConfig.tiny(**overrides)
    spec = ModelSpec.from_gpt_config(cfg)
    assert param_parts(spec).total == sum(p.numel() for p in GPT(cfg).parameters())


def test_playbook_formula() -> None:
    """The Ultra-Scale Playbook's N = h v + L(12 h^2 + 13 h) + 2 h is lslm's tied GPT without the position
    embedding; GPT-2 small: 124,439,808 with its 1024 x 768 positions (Hugging Face's published count)."""
    for L, h, v in [(2, 64, 1024), (3, 192, 777)]:  # small enough to build
        cfg = GPTConfig(vocab_size=v, block_size=128, n_layer=L, n_head=h // 64, n_embd=h, tie_weights=True)
        assert playbook_params(h, v, L) == sum(p.numel() for p in GPT(cfg).parameters()) - 128 * h
    for L, h, v in [(12, 768, 50257), (24, 1024, 50257), (96, 12288, 50257)]:
        spec = ModelSpec(L, h, h // 64, v, 1024, tied=True)
        assert playbook_params(h, v, L) == param_parts(spec).total - 1024 * h
    assert param_parts(model_presets()["gpt2-small"]).total == 124_439_808


def test_gpt3_175b_parameter_count() -> None:
    """Brown et al. 2020, Table 2.1: 96 layers, h = 12288, vocabulary 50,257, context 2048: 175.0B parameters."""
    n = param_parts(model_presets()["gpt3-175b"]).total
    assert n / 1e9 == pytest.approx(175.0, rel=0.003)  # 174.6B: the paper rounds
    assert playbook_params(12288, 50257, 96) / 1e9 == pytest.approx(174.6, abs=0.05)


@pytest.mark.parametrize(("billions", "a", "h", "L"), [
    (1.7, 24, 2304, 24), (3.6, 32, 3072, 30), (7.5, 32, 4096, 36), (18.4, 48, 6144, 40), (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60), (145.6, 96, 12288, 80), (310.1, 128, 16384, 96), (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128)])
def test_megatron_table_1_parameter_counts(billions: float, a: int, h: int, L: int) -> None:
    """Narayanan et al. 2021, Table 1 (vocabulary 51,200, sequence 2048): the reported parameter counts, from
    their §5.1 formula and from our exact count of the same GPT (tied head; plus the final LayerNorm's 2h)."""
    assert round(megatron_params(h, 51200, L, 2048) / 1e9, 1) == billions
    spec = ModelSpec(L, h, a, 51200, 2048, tied=True)
    assert param_parts(spec).total == round(megatron_params(h, 51200, L, 2048)) + 2 * h


@pytest.mark.parametrize("name", ["llama3-8b", "llama2-70b"])
def test_llama_counts_equal_hugging_face(name: str) -> None:
    """GQA + SwiGLU counts against Hugging Face's LlamaForCausalLM built on the meta device (no memory)."""
    transformers = pytest.importorskip("transformers")
    spec = model_presets()[name]
    config = transformers.LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
                                      num_hidden_layers=spec.n_layer, num_attention_heads=spec.n_head,
                                      num_key_value_heads=spec.kv_heads, tie_word_embeddings=spec.tied)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert param_parts(spec).total == sum(p.numel() for p in model.parameters())


# -- flops, time, search ----------------------------------------------------------------------------
def test_flops_equal_narayanan_equation() -> None:
    """Narayanan et al. 2021, §5.1: 72 B s L h^2 (1 + s/(6h) + V/(12hL)) per step, 96 B s L h^2 (1 + s/(6h) +
    V/(16hL)) with full recomputation."""
    spec = model_presets()["gpt3-175b"]
    assert model_flops(spec) == pytest.approx(narayanan_flops(spec))
    assert model_flops(spec, "full") == pytest.approx(narayanan_flops(spec, full_recompute=True))


def test_estimate_traces_every_number_and_finds_the_bound_axes() -> None:
    gpt3 = model_presets()["gpt3-175b"]
    est = estimate(gpt3, Layout(dp=16, tp=8, pp=8, zero=1, sequence_parallel=True, recompute="selective"), H100,
                   1024)
    assert est.fits and est.microbatches == 96
    assert all(formula for _, _, _, formula in est.table())
    assert {v.axis for v in est.verdicts} == {"dp", "tp", "pp"} and est.comm["cp"].collectives == ()
    # The same layout with tensor parallelism across nodes (tp = 16 > 8 devices per node): its rings hold 8 ranks of
    # each node, so they run through 8 adapters (400 GB/s, near NVLink's 450) and the layer's traffic more than
    # doubles against less compute per rank; through one adapter per node it is tp-bound.
    wide_layout = Layout(dp=8, tp=16, pp=8, zero=1, sequence_parallel=True, recompute="selective")
    wide = estimate(gpt3, wide_layout, H100, 1024)
    assert wide.comm["tp"].link.bandwidth_Bps == 8 * H100.inter.bandwidth_Bps and est.comm["tp"].link == H100.intra
    assert wide.comm["tp"].time_s > 2 * est.comm["tp"].time_s
    one_adapter = estimate(gpt3, wide_layout, dataclasses.replace(H100, adapter_per_device=False), 1024)
    assert next(v for v in one_adapter.verdicts if v.axis == "tp").comm_bound
    # Bubble: (p - 1)/(v m) of the compute.
    assert est.times["bubble"].value == pytest.approx(est.times["compute"].value * 7 / 96)


@pytest.mark.parametrize(("name", "devices"), [("llama3-8b", 8), ("llama2-70b", 64)])
def test_search_ranks_fitting_layouts_by_step_time(name: str, devices: int) -> None:
    found = search(model_presets()[name], H100, devices, micro_batches=(1, 2), virtual_stages=(1, 2), top=5)
    assert found and all(e.fits and e.layout.world == devices and e.layout.tp <= 8 for e in found)
    assert [e.step_s for e in found] == sorted(e.step_s for e in found)


@pytest.mark.parametrize(("layout", "devices", "message"), [
    (Layout(dp=2, tp=2), 8, "dp x tp x pp x cp = 2 x 2 x 1 x 1 = 4 devices, but 8"),
    (Layout(tp=5), None, "heads must split evenly over tp=5"),
    (Layout(pp=5), None, "n_layer=96 must be divisible by pp x v"),
    (Layout(dp=7), None, "global_batch=1536 must be a multiple of dp x micro_batch"),
    (Layout(dp=1, pp=8, v=2, tp=1), None, None),  # 1536 micro-batches: a multiple of 8, runs
])
def test_bad_layouts_are_refused_with_what_to_change(layout: Layout, devices: int | None, message: str | None) -> None:
    gpt3 = model_presets()["gpt3-175b"]
    if message is None:
        estimate(gpt3, layout, H100, devices)
        return
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        estimate(gpt3, layout, H100, devices)


def test_layout_and_hardware_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="needs zero >= 1"):
        Layout(offload="cpu")
    with pytest.raises(ValueError, match="needs tp > 1"):
        Layout(sequence_parallel=True)
    with pytest.raises(ValueError, match="need a pipeline"):
        Layout(v=2)
    with pytest.raises(ValueError, match="interleaved schedule needs the micro-batches"):
        estimate(ModelSpec(8, 64, 4, 100, 16, global_batch=6), Layout(pp=4, v=2), H100)
    with pytest.raises(ValueError, match="no compute rate for bf16"):
        estimate(ModelSpec(8, 64, 4, 100, 16), Layout(), hardware_presets()["cpu-box"])


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_data_parallel_bytes_equal_lslm_s_ledger(stage: int, n: int) -> None:
    """The dp axis's bytes per step (two micro-batches) against what lslm's communication ledger records for a real
    ZeroOptimizer step in the fake process group: equal once the layout's padding (which travels too) is added:
    stage 1 reduce-scatters and all-gathers once per step, stage 2 reduce-scatters every micro-batch, stage 3
    gathers each block twice per micro-batch, the rest once, and reduce-scatters all of it every micro-batch."""
    cfg, m = GPTConfig.tiny(), 2
    torch.manual_seed(0)
    model = GPT(cfg)
    with fake_world(1, n):
        ctx = ParallelContext.create(RankGrid.build(n), rank=1, local_rank=1, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), ctx, stage=stage,
                             dtype=torch.bfloat16, bucket_cap_mb=0.25)
        x = torch.randint(0, cfg.vocab_size, (2, 16))
        zero.zero_grad()
        for _ in range(m):
            zero.backward(model(x, x)[1])
        zero.step()
        ledger = sum(r.nbytes for r in ctx.comm.ledger.records if r.op in ("reduce_scatter", "all_gather"))
        pads = [pad for _, _, _, pad in zero.buckets]
    spec = ModelSpec.from_gpt_config(cfg, micro_batch=2, global_batch=2 * m * n)
    est = estimate(spec, Layout(dp=n, zero=stage, bucket_mb=0.25), H100)
    assert est.microbatches == m
    predicted = sum(c.payload * c.count for c in est.comm["dp"].collectives)
    g, p = 4, 2  # fp32 main_grad slices, bf16 parameters
    per_pad = {1: g + p, 2: m * g + p, 3: None}[stage]
    if stage < 3:
        padding = sum(pads) * per_pad
    else:  # buckets are the blocks (gathered twice per micro-batch), then the root (once)
        padding = sum(pad * (2 * m * p + m * g) for pad in pads[:-1]) + pads[-1] * (m * p + m * g)
    assert ledger == pytest.approx(predicted + padding, abs=1e-6)
    assert padding or n == 4  # n = 3 exercises the padding, n = 4 needs none for this model


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_bytes_equal_lslm_s_ledger(sp: bool) -> None:
    """The tp axis's calls and bytes for one micro-batch against lslm's ledger for a forward + backward of
    apply_tensor_parallel(GPT) with the vocabulary-parallel loss, at t = 2 in the fake process group: without
    SP 2 + 2 all-reduces per layer, the embedding's and the head's, the loss's two; with SP 6 all-gathers and
    4 reduce-scatters per layer (the backward re-gathers the saved shards), the same at the ends, and the sum of
    the replicated parameters' gradients."""
    from lslm.tensor_parallel.apply import apply_tensor_parallel
    from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

    cfg, t, b, s = GPTConfig.tiny(), 2, 2, 16
    with fake_world(0, t):
        ctx = ParallelContext.create(RankGrid.build(t, tp=t), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        torch.manual_seed(0)
        model = apply_tensor_parallel(GPT(cfg), ctx, sequence_parallel=sp)
        xy = torch.randint(0, cfg.vocab_size, (b, s + 1))
        vocab_parallel_cross_entropy(model(xy[:, :-1])[0], xy[:, 1:], ctx, vocab_size=cfg.vocab_size).backward()
        sync_tensor_parallel_grads(model, ctx)  # with SP: the replicated parameters' gradients summed over t
        records = list(ctx.comm.ledger.records)
    spec = ModelSpec.from_gpt_config(cfg, seq_len=s, micro_batch=b, global_batch=b)
    tp = estimate(spec, Layout(tp=t, sequence_parallel=sp, precision="fp32"), H100).comm["tp"]
    by_op: dict[str, list[float]] = {}
    for c in tp.collectives:
        op = c.algorithm.removesuffix("_ring")
        by_op.setdefault(op, [0, 0])
        by_op[op][0] += c.count
        by_op[op][1] += c.count * c.payload
    measured: dict[str, list[float]] = {}
    for r in records:
        measured.setdefault(r.op, [0, 0])
        measured[r.op][0] += 1
        measured[r.op][1] += r.nbytes
    assert by_op == measured


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_sends_equal_lslm_s_ledger(schedule: str, v: int) -> None:
    """Sends per step and their bytes on every pipeline rank (p = 4, m = 4) against lslm's executor's ledger in the
    fake process group: 2vm in the middle, (2v - 1)m at the ends, each e·sbh."""
    from lslm.pipeline.apply import PipelinePlan, apply_pipeline
    from lslm.plan.comm import communication

    cfg, p, m, b, s = GPTConfig.tiny(n_layer=8), 4, 4, 2, 16
    spec = ModelSpec.from_gpt_config(cfg, seq_len=s, micro_batch=b, global_batch=b * m)
    layout = Layout(pp=p, v=v, precision="fp32")
    for rank in range(p):
        with fake_world(rank, p):
            ctx = ParallelContext.create(RankGrid.build(p, pp=p), rank=rank, local_rank=rank, node_rank=0,
                                         device=torch.device("cpu"), backend="fake", timeout_s=5)
            torch.manual_seed(0)
            model = apply_pipeline(GPT(cfg), ctx, PipelinePlan(schedule=schedule, microbatches=m, virtual_stages=v))
            xy = torch.randint(0, cfg.vocab_size, (b * m, s + 1))
            model.step(xy[:, :-1], xy[:, 1:])
            sends = [r.nbytes for r in ctx.comm.ledger.records if r.op == "send"]
        (predicted,) = communication(spec, layout, H100, m, rank)["pp"].collectives
        assert (len(sends), sum(sends)) == (predicted.count, predicted.count * predicted.payload), rank


@pytest.mark.parametrize(("cfg", "b", "s"), [(GPTConfig.tiny(dropout=0.1), 2, 64),
                                             (GPTConfig.small(dropout=0.1), 4, 128)])
def test_activation_bytes_within_5_percent_of_lslm_s_measurement(cfg: GPTConfig, b: int, s: int) -> None:
    """The whole GPT's forward on this CPU (fp32, dropout's float noise: the cpu-box preset's 4-byte masks),
    measured with saved-tensor hooks, against the calculator's one-stage activations: the layers by Korthikanti's
    list of tensors, the embedding's dropout mask, the final norm's and the head's inputs and the fp32 logits.
    What is left is accounted for exactly below."""
    from lslm.metrics.activations import ActivationMemory
    from lslm.plan.memory import stage_memory

    torch.manual_seed(0)
    model = GPT(cfg).train()
    x = torch.randint(0, cfg.vocab_size, (b, s))
    with ActivationMemory(model) as act:
        loss = model(x, x)[1]
    loss.backward()
    spec = ModelSpec.from_gpt_config(cfg, seq_len=s, micro_batch=b, global_batch=b)
    cpu = hardware_presets()["cpu-box"]
    predicted = stage_memory(spec, Layout(precision="fp32"), 1, 0, mask_bytes=cpu.dropout_mask_bytes).activations
    assert predicted.value == pytest.approx(act.bytes, rel=0.05)
    # The rest, none of it in the paper's accounting: LayerNorm's fp32 mean and 1/std (two per layer, one pair for
    # ln_f), the int64 token ids (also the targets here: one storage) and positions the embeddings keep, and one
    # fp32 scalar of the loss.
    assert act.bytes - predicted.value == 16 * s * b * cfg.n_layer + 8 * s * b + 8 * s * b + 8 * s + 4


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_parameters_per_rank_equal_lslm_s_tensor_and_pipeline_shards(tied: bool, bias: bool) -> None:
    """Parameters one rank holds after apply_tensor_parallel (t = 2: matrices and the vocabulary split, LayerNorms
    and row-parallel biases replicated) and after apply_pipeline (p = 2: embedding first, head last, a tied
    embedding copied onto the last stage), in the fake process group, equal the calculator's."""
    from lslm.pipeline.apply import PipelinePlan, apply_pipeline
    from lslm.plan.memory import stage_params
    from lslm.tensor_parallel.apply import apply_tensor_parallel

    cfg = GPTConfig.tiny(n_layer=4, tie_weights=tied, bias=bias)
    spec = ModelSpec.from_gpt_config(cfg)
    with fake_world(0, 2):
        ctx = ParallelContext.create(RankGrid.build(2, tp=2), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        model = apply_tensor_parallel(GPT(cfg), ctx)
        assert sum(p.numel() for p in model.parameters()) == stage_params(spec, Layout(tp=2), 0)
    for rank in range(2):
        with fake_world(rank, 2):
            ctx = ParallelContext.create(RankGrid.build(2, pp=2), rank=rank, local_rank=rank, node_rank=0,
                                         device=torch.device("cpu"), backend="fake", timeout_s=5)
            stage = apply_pipeline(GPT(cfg), ctx, PipelinePlan(schedule="1f1b", microbatches=2))
            assert sum(p.numel() for p in stage.parameters()) == stage_params(spec, Layout(pp=2), rank), rank


def test_sizing_answers_fit_and_run_somewhere() -> None:
    """The course's sizing questions (GPT-3 175B on 1024, Llama-2 70B on 64, Llama-3 8B on 8 x H100 80 GB): every
    answer fits, uses the devices asked, and is a combination a framework runs (no ZeRO-2/3 with a pipeline)."""
    from lslm.plan.search import SIZING_QUESTIONS

    answers = sizing_answers(H100, top=2, micro_batches=(1, 2), virtual_stages=(1, 2))
    assert set(answers) == set(SIZING_QUESTIONS)
    for name, found in answers.items():
        assert found, name
        for e in found:
            assert e.fits and e.layout.world == SIZING_QUESTIONS[name]
            assert not (e.layout.zero >= 2 and e.layout.pp > 1)
            assert e.layout.flash_attention == (e.model.arch == "llama")


def test_tensor_parallel_traffic_equals_the_committed_bench_ledger() -> None:
    """bench/results/tp.json (``lslm bench tp``, committed): the collectives and bytes lslm's ledger counted per step
    at t = 2 and 4, with and without sequence parallelism, equal the calculator's tp axis for that model."""
    import json
    from pathlib import Path

    results = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "tp.json").read_text())
    checked = 0
    for run in results.values():
        cfg = GPTConfig(**run["model"])
        spec = ModelSpec.from_gpt_config(cfg, seq_len=run["seq"], micro_batch=run["batch"], global_batch=run["batch"])
        for row in run["rows"]:
            if row["variant"] != "lslm":
                continue
            layout = Layout(tp=run["tp"], sequence_parallel=row["sequence_parallel"], precision="fp32")
            tp = estimate(spec, layout, H100).comm["tp"]
            assert sum(c.count for c in tp.collectives) == row["collectives_per_step"], (run["tp"], row)
            assert tp.payload_bytes == row["comm_bytes_per_step"], (run["tp"], row)
            checked += 1
    assert checked == 4  # t = 2, 4 x SP off, on


def test_zero_bytes_equal_the_committed_bench() -> None:
    """bench/results/zero.json (``lslm bench zero``, committed, fp32 at 2 and 4 ranks): each ZeRO entry's bytes per
    owner (offload's host copies included) and its reduce-scatter / all-gather bytes per step equal the
    calculator's; optimizer states differ only by Adam's 4-byte ``step`` per parameter piece."""
    import json
    from pathlib import Path

    results = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "zero.json").read_text())
    checked = 0
    for run in results.values():
        n = run["world"]
        spec = ModelSpec.from_gpt_config(GPTConfig(**run["model"]), micro_batch=run["rows_per_rank"],
                                         global_batch=run["rows_per_rank"] * n)
        psi = param_parts(spec).total
        assert psi == run["num_parameters"]
        for row in run["rows"]:
            if row["entry"] not in ("zero1", "zero2", "zero3", "zero3-offload"):
                continue
            layout = Layout(dp=n, zero=int(row["entry"][4]), precision="fp32",
                            offload="cpu" if "offload" in row["entry"] else "none")
            states = model_states(psi, layout)
            held = {k: states.device[k].value + (states.host[k].value if k in states.host else 0)
                    for k in states.device}
            assert [held[k] for k in ("parameters", "gradients", "master_weights")] == \
                [row[k] for k in ("params_bytes", "grads_bytes", "masters_bytes")], (n, row["entry"])
            steps = row["optimizer_bytes"] - held["optimizer_states"]
            assert steps % 4 == 0 and 0 <= steps <= 4 * 2 * len(gpt_tensor_numels(spec)), (n, row["entry"])
            dp = estimate(spec, layout, H100).comm["dp"]
            assert sum(c.payload * c.count for c in dp.collectives if "gather" in c.label) == row["ag_bytes"]
            assert sum(c.payload * c.count for c in dp.collectives if "gather" not in c.label) == row["rs_bytes"]
            checked += 1
    assert checked == 8


def test_pipeline_traffic_equals_the_committed_bench() -> None:
    """bench/results/pipeline.json (``lslm bench pipeline``, committed, p = 2 and 4): rank 0's p2p calls and bytes
    per step for GPipe, 1F1B and interleaved 1F1B are twice the calculator's sends of rank 0 (each send has a
    matching receive of the same size: ``(2v - 1)m`` each way), at the calculator's message size ``e·sbh``."""
    import json
    from pathlib import Path

    from lslm.plan.comm import communication

    results = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "pipeline.json").read_text())
    checked = 0
    for run in results.values():
        cfg = GPTConfig(**run["model"])
        for row in run["rows"]:
            if row["lslm_schedule"] not in ("gpipe", "1f1b", "interleaved"):
                continue  # zero-bubble and DualPipeV schedules are not modelled here
            m, v = row["m"], row["v"]
            spec = ModelSpec.from_gpt_config(cfg, micro_batch=run["batch"] // m, global_batch=run["batch"])
            (sends,) = communication(spec, Layout(pp=run["p"], v=v, precision="fp32"), H100, m, 0)["pp"].collectives
            assert sends.payload == row["message_bytes"]
            assert (2 * sends.count, 2 * sends.count * sends.payload) == \
                (row["pp_comm_calls_rank0"], row["pp_comm_bytes_rank0"]), (run["p"], row["lslm_schedule"], m)
            checked += 1
    assert checked == 12


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize(("sp", "regather"), [(False, True), (True, True), (True, False)])
def test_tensor_parallel_activation_bytes_within_5_percent_of_lslm(t: int, sp: bool, regather: bool) -> None:
    """One rank of apply_tensor_parallel(GPT) (8 heads, dropout, fp32) in the fake process group: the bytes autograd
    saves for backward, measured with saved-tensor hooks, against the calculator's per-rank activations (Table 2's
    tensor-parallel and sequence-parallel rows at this CPU's widths, the ends vocabulary-parallel). With a single
    head per rank lslm keeps more (its ``v`` view holds the whole qkv output alive,
    lslm.metrics.activation_theory): the calculator follows the paper there, so heads/t >= 2 here. Without
    re-gathering (``regather=False``) the column-parallel layers keep their gathered inputs whole."""
    from lslm.metrics.activations import ActivationMemory
    from lslm.plan.memory import stage_memory
    from lslm.tensor_parallel.apply import apply_tensor_parallel
    from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    cfg, b, s = GPTConfig.tiny(dropout=0.1, n_embd=128, n_head=8), 2, 64
    with fake_world(0, t):
        ctx = ParallelContext.create(RankGrid.build(t, tp=t), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        torch.manual_seed(0)
        model = apply_tensor_parallel(GPT(cfg), ctx, sequence_parallel=sp, regather_input=regather).train()
        xy = torch.randint(0, cfg.vocab_size, (b, s + 1))
        with ActivationMemory(model) as act:
            loss = vocab_parallel_cross_entropy(model(xy[:, :-1])[0], xy[:, 1:], ctx, vocab_size=cfg.vocab_size)
        loss.backward()
    spec = ModelSpec.from_gpt_config(cfg, seq_len=s, micro_batch=b, global_batch=b)
    layout = Layout(tp=t, sequence_parallel=sp, regather=regather, precision="fp32")
    predicted = stage_memory(spec, layout, 1, 0, mask_bytes=hardware_presets()["cpu-box"].dropout_mask_bytes)
    assert predicted.activations.value == pytest.approx(act.bytes, rel=0.05)
    assert predicted.activations.value < act.bytes  # what is left: LayerNorm statistics, ids, small scalars


@pytest.mark.parametrize(("t", "kv", "sp"), [(2, 2, False), (4, 2, False), (4, 2, True)])
def test_llama_tensor_parallel_shards_and_traffic_equal_lslm(t: int, kv: int, sp: bool) -> None:
    """Hugging Face Llama (GQA, SwiGLU, RMSNorm) under lslm's apply_tensor_parallel in the fake process group: the
    parameters one rank holds, and its calls and bytes for one micro-batch and the gradient syncs, equal the
    calculator's, including the sum of the replicated key/value heads' gradients when t > kv. lslm's plan for
    Hugging Face models keeps the gathered inputs (``regather=False``) and all-reduces the embedding's output
    before scattering it (one all-reduce where Megatron, and lslm's own GPT, reduce-scatter: same bytes)."""
    from lslm.models.hf import build_hf_llama
    from lslm.plan.memory import stage_params
    from lslm.tensor_parallel.apply import apply_tensor_parallel
    from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

    with fake_world(0, t):
        ctx = ParallelContext.create(RankGrid.build(t, tp=t), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake", timeout_s=5)
        model = apply_tensor_parallel(build_hf_llama(1024, 64, 2, 4, 128, 256, kv), ctx, sequence_parallel=sp)
        held = sum(p.numel() for p in model.parameters())
        xy = torch.randint(0, 1024, (2, 17))
        vocab_parallel_cross_entropy(model(xy[:, :-1]).logits, xy[:, 1:], ctx, vocab_size=1024).backward()
        sync_tensor_parallel_grads(model, ctx)
        records = list(ctx.comm.ledger.records)
    spec = ModelSpec(2, 128, 4, 1024, 16, micro_batch=2, global_batch=2, n_kv_head=kv, ffn_hidden=256, arch="llama",
                     dropout=False)
    layout = Layout(tp=t, sequence_parallel=sp, regather=False, precision="fp32")
    assert held == stage_params(spec, layout, 0)
    expected: dict[str, list[float]] = {}
    for c in estimate(spec, layout, H100).comm["tp"].collectives:
        op = "all_reduce" if c.label == "embedding reduce-scatter" else c.algorithm.removesuffix("_ring")
        expected.setdefault(op, [0, 0])
        expected[op][0] += c.count
        expected[op][1] += c.count * c.payload
    measured: dict[str, list[float]] = {}
    for r in records:
        measured.setdefault(r.op, [0, 0])
        measured[r.op][0] += 1
        measured[r.op][1] += r.nbytes
    assert expected == measured


def test_step_time_by_hand() -> None:
    """The time model on numbers small enough to follow by hand: 1 Gflop/s, links of 1 GB/s and no latency.

    dp = 2, m = 2: compute = m x one micro-batch's flops / rate; the gradient all-reduce (one bucket of 4Ψ bytes,
    ``2(n-1)/n S`` on the wire = S) hides behind the last micro-batch's backward (2/3 of its flops) and the rest
    shows. pp = 2 adds the bubble (p - 1)/v x T_mb and the sends, 1 + 1 per micro-batch on the last stage."""
    from dataclasses import replace

    from lslm.plan import Hardware, Link

    hw = Hardware("by hand", {"fp32": 1e9}, hbm_bytes=2**40, intra=Link(0.0, 1e9), inter=Link(0.0, 1e9))
    spec = ModelSpec(2, 64, 4, 100, 16, micro_batch=1, global_batch=4, bias=False, dropout=False)
    est = estimate(spec, Layout(dp=2, precision="fp32"), hw)
    t_mb = model_flops(spec, sequences=1) / 1e9
    t_bwd = 2 / 3 * t_mb
    all_reduce = 4 * param_parts(spec).total / 1e9
    assert est.microbatches == 2
    assert est.times["compute"].value == pytest.approx(2 * t_mb)
    assert est.times["dp"].value == pytest.approx(max(0.0, all_reduce - t_bwd))
    assert est.step_s == pytest.approx(2 * t_mb + max(0.0, all_reduce - t_bwd))
    piped = estimate(replace(spec, global_batch=4), Layout(pp=2, precision="fp32"), hw)
    stage_mb = (model_flops(spec, sequences=1) - 3 * 2 * 16 * 64 * 100) / 2 / 1e9 + 3 * 2 * 16 * 64 * 100 / 1e9
    assert piped.microbatches == 4
    assert piped.times["bubble"].value == pytest.approx(stage_mb)  # (p - 1)/v = 1 micro-batch of the last stage
    assert piped.times["pp"].value == pytest.approx(4 * 4 * 16 * 64 / 1e9)  # (2v - 1)m = 4 sends of e·sbh bytes


@pytest.mark.parametrize("options", [dict(flash_attention=True), dict(cp=2)])
def test_selective_recompute_saves_nothing_where_the_core_keeps_no_scores(options: dict[str, object]) -> None:
    # A flash kernel (and the context-parallel cores) keep no s^2 scores: selective recomputation has nothing to
    # drop (the H200 measured 26.87 -> 26.85 GB), so it keeps exactly none's bytes and still pays the core again.
    from lslm.plan.activations import core_keeps_scores, layer_formula

    model = model_presets()["gpt3-175b"]
    hw = hardware_presets()["h100-sxm"]
    dp = 8 // options.get("cp", 1)
    none, sel = (estimate(model, Layout(dp=dp, tp=8, pp=16, zero=1, sequence_parallel=True, recompute=rc,
                                        **options), hw, 1024) for rc in ("none", "selective"))
    assert not core_keeps_scores(sel.layout) and not core_keeps_scores(none.layout)
    assert sel.memory.activations.value == none.memory.activations.value
    assert sel.peak_bytes == none.peak_bytes
    assert sel.step_s > none.step_s  # the core's forward again, for nothing
    assert model_flops(model, "selective") > model_flops(model, "none")
    assert "drops nothing" in layer_formula(model, sel.layout)
    assert "recomputed during its backward" not in sel.memory.activations.formula
    # without flash attention it still drops the 5as^2b term
    plain = Layout(dp=8, tp=8, pp=16, zero=1, sequence_parallel=True, recompute="selective")
    assert core_keeps_scores(dataclasses.replace(plain, recompute="none"))
    assert "drops nothing" not in layer_formula(model, plain)
    found = search(model.with_batch(1, 64), hw, 64, flash_attention=True, fitting_only=False, top=10_000,
                   micro_batches=(1,), virtual_stages=(1,))
    assert found and all(e.layout.recompute != "selective" for e in found)  # dominated: not tried


def test_ring_collectives_across_nodes_use_every_adapter_of_a_node() -> None:
    """A ring collective whose group holds k devices of each node runs k rings, one per network adapter (NCCL's
    channels): k x one adapter's bandwidth, capped by NVLink; a group with one device per node gets one adapter,
    and the cpu-box's measured inter-node fit is taken as it is."""
    hw = hardware_presets()
    a100 = hw["a100-80gb"]
    assert a100.link(8) == a100.intra  # one node
    assert a100.link(64, 8).bandwidth_Bps == 8 * 25e9 and a100.link(64, 1) == a100.inter
    assert (a100.link(64, 8).adapters, a100.inter.adapters, a100.intra.adapters) == (8, 1, 1)
    assert hw["h100-sxm"].link(64, 8).bandwidth_Bps == 400e9  # 8 x 50 GB/s
    narrow = dataclasses.replace(a100, intra=dataclasses.replace(a100.intra, bandwidth_Bps=150e9))
    assert narrow.link(64, 8).bandwidth_Bps == 150e9  # capped by the intra-node link the rings also cross
    assert hw["cpu-box"].link(4, 2) == hw["cpu-box"].inter
    assert (a100.ranks_per_node(64, 1), a100.ranks_per_node(32, 8), a100.ranks_per_node(8, 2),
            a100.ranks_per_node(2, 1)) == (8, 1, 4, 2)
    model = model_presets()["llama3-8b"]
    fsdp = estimate(model, Layout(dp=64, zero=3, flash_attention=True, precision="bf16"), a100)
    assert fsdp.comm["dp"].link.bandwidth_Bps == 200e9
    dp_across_tp = estimate(model, Layout(dp=8, tp=8, sequence_parallel=True, precision="bf16"), a100)
    assert dp_across_tp.comm["dp"].link.bandwidth_Bps == 25e9  # one rank of each dp group per node
    one_adapter = dataclasses.replace(a100, adapter_per_device=False)
    slow = estimate(model, Layout(dp=64, zero=3, flash_attention=True, precision="bf16"), one_adapter)
    assert slow.comm["dp"].time_s > 6 * fsdp.comm["dp"].time_s  # 8x the bandwidth term, the same latencies
