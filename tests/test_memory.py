"""Tests for lslm.metrics.memory: exact byte counts checked against hand counts."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lslm.data_parallel.buckets import plan_buckets
from lslm.metrics import (
    CATEGORIES,
    ActivationMemory,
    MemoryBreakdown,
    MemoryOwner,
    MemoryRegistry,
    MemoryReport,
    ModelStateBytes,
    format_bytes,
    memory_by_owner,
    memory_report,
    model_state_bytes,
    peak_rss_bytes,
    process_rss_bytes,
    reset_peak_memory,
    theory_model_state_bytes,
)
from tests.helpers import forbid_cuda_from_lslm

F32 = 4
PSI = 10 * 7 + 7  # nn.Linear(10, 7): weight + bias elements


def _linear(dtype: torch.dtype = torch.float32) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(10, 7).to(dtype)


def _backward(model: nn.Module, dtype: torch.dtype = torch.float32) -> None:
    model(torch.randn(3, 10, dtype=dtype)).sum().backward()


# ---------------------------------------------------------------- format_bytes


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 1024**2) == "3.00 MiB"
    assert format_bytes(5 * 1024**3) == "5.00 GiB"
    assert format_bytes(-2048) == "-2.00 KiB"


# ---------------------------------------------------------------- model states


def test_linear_params_then_grads_fp32() -> None:
    model = _linear()
    before = model_state_bytes(model)
    assert before == ModelStateBytes(
        params=PSI * F32, grads=0, optimizer_states=0, num_params=PSI, num_param_tensors=2
    )
    _backward(model)
    after = model_state_bytes(model)
    assert (after.params, after.grads, after.optimizer_states) == (308, 308, 0)
    assert after.total == 616


@pytest.mark.parametrize("opt_cls,name", [(torch.optim.Adam, "adam"), (torch.optim.AdamW, "adamw")])
def test_adam_states_exact(opt_cls: type[torch.optim.Optimizer], name: str) -> None:
    model = _linear()
    opt = opt_cls(model.parameters(), lr=1e-3)
    assert model_state_bytes(model, opt).optimizer_states == 0  # state is lazy: nothing before step
    _backward(model)
    opt.step()
    # What torch allocates per parameter: exp_avg and exp_avg_sq like the param, and a
    # 0-d float32 `step` tensor on the CPU (not capturable, not fused).
    for p in model.parameters():
        step = opt.state[p]["step"]
        assert (step.dtype, step.numel(), step.device.type) == (torch.float32, 1, "cpu")
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    measured = model_state_bytes(model, opt)
    assert measured.optimizer_states == 2 * PSI * F32 + 2 * 4 == 624
    assert measured.total == 308 + 308 + 624
    assert measured == theory_model_state_bytes(PSI, optimizer=name, num_param_tensors=2)


def test_sgd_plain_and_momentum() -> None:
    model = _linear()
    _backward(model)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    plain.step()
    assert model_state_bytes(model, plain).optimizer_states == 0  # no momentum: no state
    assert model_state_bytes(model, plain) == theory_model_state_bytes(
        PSI, optimizer="sgd", num_param_tensors=2
    )
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    momentum.step()
    measured = model_state_bytes(model, momentum)
    assert measured.optimizer_states == PSI * F32 == 308  # one momentum buffer per param
    assert measured == theory_model_state_bytes(PSI, optimizer="sgd_momentum", num_param_tensors=2)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # GPT-style weight tying


def test_tied_weights_count_once() -> None:
    model = _Tied()
    measured = model_state_bytes(model)
    assert measured.params == 11 * 6 * F32
    assert (measured.num_params, measured.num_param_tensors) == (66, 1)
    out = model.head(model.emb(torch.tensor([[1, 2, 3]])))
    out.sum().backward()
    assert model_state_bytes(model).grads == 11 * 6 * F32  # one accumulated grad


def test_views_of_one_flat_buffer_count_once() -> None:
    flat = torch.zeros(20)
    model = nn.Module()
    model.a = nn.Parameter(flat[:8])
    model.b = nn.Parameter(flat[8:])
    measured = model_state_bytes(model)
    assert measured.params == 20 * F32  # the whole storage, once
    assert measured.num_params == 20


def test_storage_shared_between_categories_counts_in_first() -> None:
    model = _linear()
    model.weight.grad = model.weight.detach()  # grad aliases the parameter's storage
    measured = model_state_bytes(model)
    assert (measured.params, measured.grads) == (308, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(dtype: torch.dtype) -> None:
    model = _linear(dtype)
    opt = torch.optim.Adam(model.parameters())
    _backward(model, dtype)
    opt.step()
    measured = model_state_bytes(model, opt)
    # 2-byte params/grads/moments; the step scalars stay float32.
    assert (measured.params, measured.grads) == (154, 154)
    assert measured.optimizer_states == 2 * PSI * 2 + 2 * 4 == 316
    assert measured == theory_model_state_bytes(PSI, dtype, "adam", num_param_tensors=2)


def test_fp32_master_weights_match_zero_k12() -> None:
    model = _linear(torch.float16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(masters)
    _backward(model, torch.float16)
    for master, p in zip(masters, model.parameters()):
        master.grad = p.grad.float()
    opt.step()
    for master in masters:
        master.grad = None  # master grads are transient, as ZeRO assumes
    measured = model_state_bytes(model, opt)
    # ZeRO: 2Ψ params + 2Ψ grads + 12Ψ (fp32 copy, momentum, variance), plus steps.
    assert (measured.params, measured.grads) == (2 * PSI, 2 * PSI)
    assert measured.optimizer_states == 12 * PSI + 2 * 4
    assert measured == theory_model_state_bytes(
        PSI, torch.float16, "adam", num_param_tensors=2, master_weights=True
    )


def test_buffers_reported_separately() -> None:
    bn = nn.BatchNorm1d(4)
    measured = model_state_bytes(bn)
    assert measured.params == 2 * 4 * F32  # weight, bias
    # running_mean, running_var (fp32) and num_batches_tracked (one int64)
    assert measured.buffers == 2 * 4 * F32 + 8
    assert measured.total == measured.params  # buffers are not model states
    assert measured.to_dict()["buffers"] == 40


def test_nested_optimizer_state_tensors_counted() -> None:
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.bias]["history"] = [torch.zeros(3), (torch.zeros(2), 5)]
    assert model_state_bytes(model, opt).optimizer_states == 5 * F32


def test_theory_formulas() -> None:
    psi = 1000
    adam = theory_model_state_bytes(psi)
    assert (adam.params, adam.grads, adam.optimizer_states) == (4 * psi, 4 * psi, 8 * psi)
    assert adam.total == 16 * psi
    assert theory_model_state_bytes(psi, grads=False).grads == 0
    assert theory_model_state_bytes(psi, optimizer=None).optimizer_states == 0
    mixed = theory_model_state_bytes(psi, torch.bfloat16, "adam", master_weights=True)
    assert mixed.total == 16 * psi and mixed.optimizer_states == 12 * psi
    with pytest.raises(ValueError, match="unknown optimizer"):
        theory_model_state_bytes(psi, optimizer="lion")


# ---------------------------------------------------------------- activations


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))


def test_activation_hand_count_mlp() -> None:
    model = _mlp()
    x = torch.randn(4, 10)  # no grad needed for x, so Linear 1 does not save its weight
    with ActivationMemory(model) as act:
        model(x).sum()
    # Saved: x by Linear 1 (4x10), ReLU's output (4x20) by ReLU and again by Linear 2,
    # and Linear 2's weight (a parameter: excluded). Unique storages: x and h.
    assert act.bytes == 4 * 10 * F32 + 4 * 20 * F32 == 480
    assert (act.num_tensors, act.num_storages) == (3, 2)
    with ActivationMemory() as act_all:  # no model: parameters are not excluded
        model(x).sum()
    assert act_all.bytes == 480 + 20 * 5 * F32
    assert act_all.num_tensors == 4


def test_activation_hooks_leave_gradients_unchanged() -> None:
    model, x = _mlp(), torch.randn(4, 10)
    model(x).pow(2).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with ActivationMemory(model) as act:
        loss = model(x).pow(2).sum()
    loss.backward()
    assert act.bytes > 0
    for p, g in zip(model.parameters(), reference):
        assert torch.equal(p.grad, g)


def _blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(2)]
    )


def test_checkpoint_saves_only_block_inputs_and_same_grads() -> None:
    model, x = _blocks(), torch.randn(8, 16)
    with ActivationMemory(model) as full:
        loss = model(x).sum()
    loss.backward()
    grads_full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    with ActivationMemory(model) as ckpt:
        h = x
        for block in model:
            h = checkpoint(block, h, use_reentrant=False)
        loss = h.sum()
    loss.backward()

    io, hidden = 8 * 16 * F32, 8 * 32 * F32
    # Per block: its input (Linear 1) and the ReLU output (ReLU + Linear 2).
    assert full.bytes == 2 * (io + hidden) == 3072
    # Checkpointing keeps only each block's input; the rest is recomputed in backward.
    assert ckpt.bytes == 2 * io == 1024
    for p, g in zip(model.parameters(), grads_full):
        assert torch.equal(p.grad, g)


def test_activation_passes_sum_and_shared_input_counts_once() -> None:
    model = _mlp()
    with ActivationMemory(model) as one:
        model(torch.randn(4, 10)).sum().backward()
    with ActivationMemory(model) as three:
        # Each pass frees its saved storages in backward; the allocator then reuses
        # their addresses (it does here by the third pass), which must count again.
        for _ in range(3):
            model(torch.randn(4, 10)).sum().backward()
    assert three.bytes == 3 * one.bytes
    assert three.num_storages == 3 * one.num_storages
    x = torch.randn(4, 10)
    with ActivationMemory(model) as alive:  # two graphs alive at once, same input
        a, b = model(x).sum(), model(x).sum()
    assert alive.bytes == 2 * one.bytes - 4 * 10 * F32
    (a + b).backward()


def test_reused_address_counts_again_only_after_free(monkeypatch: pytest.MonkeyPatch) -> None:
    # The allocator may or may not reuse an address on a given run; make every
    # storage report the same address so both branches run deterministically.
    import lslm.metrics.activations as activations

    real = activations.storage_of
    monkeypatch.setattr(activations, "storage_of", lambda t: (("same",), *real(t)[1:]))
    a, b = torch.zeros(10), torch.zeros(10)
    with ActivationMemory() as act:
        act._pack(a)
        act._pack(b)  # same "address", first storage alive: the same memory
        assert (act.bytes, act.num_storages) == (40, 1)
        del a, b  # both storages freed
        act._pack(torch.zeros(30))  # address reused by a new storage: counts
    assert (act.bytes, act.num_storages, act.num_tensors) == (40 + 120, 2, 3)


def test_activation_memory_cannot_nest_itself() -> None:
    act = ActivationMemory()
    with act:
        with pytest.raises(RuntimeError, match="already active"):
            act.__enter__()


# ---------------------------------------------------------------- process and report


def test_rss_helpers() -> None:
    rss = process_rss_bytes()
    assert rss > 10 * 1024**2  # a Python process with torch loaded
    peak = peak_rss_bytes()
    assert peak is not None and peak >= rss
    big = torch.ones(64 * 1024**2 // 4)  # 64 MiB, pages touched by the fill
    assert process_rss_bytes() - rss > 32 * 1024**2
    del big


def _forbid_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid_cuda_from_lslm(monkeypatch)  # tests/helpers.py: lslm's calls raise, torch's own probes go through


def test_forbid_cuda_catches_lslm_calls_and_lets_torch_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # The guard must fail an lslm call (here: the device chooser's CUDA probe, and the CUDA branch of
    # synchronize) and let the same function through when torch (or a test) calls it.
    from lslm.runtime.startup import choose_device_and_backend, synchronize

    available = torch.cuda.is_available()
    _forbid_cuda(monkeypatch)
    with pytest.raises(AssertionError, match=r"torch.cuda.is_available called from lslm.runtime.startup"):
        choose_device_and_backend(0, 1, environ={})
    with pytest.raises(AssertionError, match=r"torch.cuda.synchronize called from lslm.runtime.startup"):
        synchronize(torch.device("cuda", 0))
    assert torch.cuda.is_available() == available  # called from this test module: the real answer
    # A caller inside torch: exec'd with a torch module's globals, so its frame's module is torch's.
    from torch.optim import optimizer as torch_optimizer

    scope = {"__name__": torch_optimizer.__name__, "torch": torch}
    exec("result = torch.cuda.is_available()", scope)
    assert scope["result"] == available
    model = _linear()
    opt = torch.optim.Adam(model.parameters())
    _backward(model)
    opt.step()  # torch's own probes (on a GPU machine Adam asks is_available()) pass


def test_memory_report_cpu_never_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_cuda(monkeypatch)
    model = _linear()
    opt = torch.optim.Adam(model.parameters())
    _backward(model)
    opt.step()
    report = memory_report(torch.device("cpu"), model, opt)
    assert isinstance(report, MemoryReport)
    assert report.device == "cpu"
    assert (report.allocated, report.peak_allocated, report.reserved) == (None, None, None)
    assert report.rss > 0 and report.peak_rss >= report.rss
    assert report.model_state == model_state_bytes(model, opt)
    assert report.model_state.total == 1240
    data = json.loads(json.dumps(report.to_dict()))
    assert data["model_state"]["total"] == 1240 and data["allocated"] is None
    text = str(report)
    assert text.startswith("cpu") and "MiB" in text and "allocated" not in text
    assert memory_report("cpu").model_state is None
    reset_peak_memory("cpu")  # a no-op on CPU, and still no torch.cuda call


def test_memory_report_cuda_path_reads_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    # No GPU here: fake the allocator to check the CUDA branch's plumbing.
    calls: list[tuple[str, torch.device]] = []

    def fake(name: str, value: int):
        def fn(device: torch.device) -> int:
            calls.append((name, device))
            return value

        return fn

    monkeypatch.setattr(torch.cuda, "memory_allocated", fake("alloc", 3 * 1024**2))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake("peak", 5 * 1024**2))
    monkeypatch.setattr(torch.cuda, "memory_reserved", fake("reserved", 8 * 1024**2))
    report = memory_report("cuda:0")
    assert (report.allocated, report.peak_allocated, report.reserved) == (
        3 * 1024**2,
        5 * 1024**2,
        8 * 1024**2,
    )
    assert report.device == "cuda:0"
    assert [d for _, d in calls] == [torch.device("cuda:0")] * 3
    assert "allocated 3.0 MiB (peak 5.0 MiB), reserved 8.0 MiB" in str(report)


# ---------------------------------------------------------------- by owner x device, resident and logical


def _two_layers(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 3)).to(dtype)


PSI2 = (10 * 7 + 7) + (7 * 3 + 3)  # _two_layers: 101 elements in 4 tensors


def _cells(b: MemoryBreakdown, kind: str = "resident") -> dict[str, dict[str, int]]:
    """Non-empty rows only, for compact exact comparisons."""
    return {c: row for c, row in (b.resident if kind == "resident" else b.logical).items() if row}


class _BucketOwner:
    """Stands in for a bucketed DDP wrapper: one flat fp32 buffer per planned bucket."""

    def __init__(self, model: nn.Module, cap: int) -> None:
        params = list(model.parameters())
        self.plan = plan_buckets([p.numel() * 4 for p in params], cap)
        self.registry = MemoryRegistry()
        for b, idx in enumerate(self.plan):
            self.registry.register("comm_buffers", torch.zeros(sum(params[i].numel() for i in idx)), f"bucket {b}")

    def memory_owners(self) -> dict[str, list[torch.Tensor]]:
        return self.registry.memory_owners()


def test_by_owner_adamw_and_buckets_hand_count() -> None:
    model = _two_layers()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _backward(model)
    opt.step()
    owner = _BucketOwner(model, cap=30 * F32)  # reverse order: [bias1 3 + weight1 21 el.], [bias0 7], [weight0 70]
    assert owner.plan == [[3, 2], [1], [0]]
    b = memory_by_owner(model, opt, owners=[owner])
    psi = PSI2 * F32
    expected = {
        "parameters": {"cpu": psi},
        "gradients": {"cpu": psi},
        "optimizer_states": {"cpu": 2 * psi + 4 * 4},  # exp_avg, exp_avg_sq, one float32 step per tensor
        "comm_buffers": {"cpu": (3 + 21) * F32 + 7 * F32 + 70 * F32},  # = psi: the buckets cover every grad
    }
    assert _cells(b) == _cells(b, "logical") == expected
    assert b.get("comm_buffers") == psi and b.total() == 5 * psi + 16 and b.devices == ["cpu"]
    assert b.num_storages == 4 + 4 + 3 * 4 + 3  # params, grads, Adam's 3 tensors each, buckets
    ms = b.model_states()
    assert (ms.params, ms.grads, ms.optimizer_states) == (psi, psi, 2 * psi + 16)
    ref = model_state_bytes(model, opt)
    assert (ms.params, ms.grads, ms.optimizer_states, ms.buffers) == (ref.params, ref.grads, ref.optimizer_states, 0)


def test_freed_storage_is_zero_resident_full_logical() -> None:
    model = _two_layers()
    first = model[0].weight
    first.data.untyped_storage().resize_(0)  # what ZeRO-3 does to a parameter outside its layer's forward
    b = memory_by_owner(model)
    assert b.get("parameters") == (PSI2 - 70) * F32
    assert b.get("parameters", kind="logical") == PSI2 * F32
    # Views of one flat buffer, then the buffer freed: one storage, 0 resident, the views' bytes logical.
    flat = torch.zeros(30)
    reg = MemoryRegistry()
    reg.register_all("parameters", [flat[:10], flat[10:25]], "views")
    assert (memory_by_owner(owners=[reg]).get("parameters"), memory_by_owner(owners=[reg]).num_storages) == (120, 1)
    assert memory_by_owner(owners=[reg]).get("parameters", kind="logical") == 25 * F32  # padding: not addressed
    flat.untyped_storage().resize_(0)
    b = memory_by_owner(owners=[reg])
    assert (b.get("parameters"), b.get("parameters", kind="logical"), b.num_storages) == (0, 25 * F32, 1)


def test_views_and_repeats_of_one_storage_count_once() -> None:
    base = torch.zeros(10, 10)
    reg = MemoryRegistry()
    reg.register("other", base)
    reg.register("other", base)  # the same tensor twice
    reg.register("other", base.t())  # a transposed view: the same 100 elements
    reg.register("other", base[2:5])  # a slice inside it
    reg.register("other", base.view(-1)[50:])
    b = memory_by_owner(owners=[reg, reg])  # the same owner twice
    assert (b.get("other"), b.get("other", kind="logical"), b.num_storages) == (400, 400, 1)
    # Overlapping slices of a storage nobody registered whole: their union.
    other = torch.zeros(100)
    reg2 = MemoryRegistry()
    reg2.register_all("other", [other[0:30], other[20:50], other[70:80]])
    b = memory_by_owner(owners=[reg2])
    assert (b.get("other"), b.get("other", kind="logical")) == (400, 60 * F32)


def test_storage_under_two_categories_counts_in_the_first() -> None:
    model = _linear()
    _backward(model)
    # A grad also registered as a comm buffer, and a bucket whose views are the grads
    # (torch's gradient_as_bucket_view): gradients win, the bucket costs nothing extra.
    bucket = torch.zeros(PSI)
    model.weight.grad = bucket[:70].view(7, 10)
    model.bias.grad = bucket[70:]
    reg = MemoryRegistry()
    reg.register("comm_buffers", bucket, "bucket 0")
    reg.register("comm_buffers", model.bias.grad, "again")
    b = memory_by_owner(model, owners=[reg])
    assert _cells(b) == {"parameters": {"cpu": 308}, "gradients": {"cpu": 308}}
    assert b.get("comm_buffers") == 0
    reg2 = MemoryRegistry()
    reg2.register("other", model.weight)  # parameters come before other
    assert memory_by_owner(model, owners=[reg2]).get("other") == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_weights_and_main_grads_of_a_half_model(dtype: torch.dtype) -> None:
    model = _linear(dtype)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters)
    _backward(model, dtype)
    for master, p in zip(masters, model.parameters()):
        master.grad = p.grad.float()
    opt.step()
    b = memory_by_owner(model, opt)
    assert _cells(b) == {"parameters": {"cpu": 2 * PSI}, "gradients": {"cpu": 2 * PSI},
                         "master_weights": {"cpu": 4 * PSI}, "main_grads": {"cpu": 4 * PSI},
                         "optimizer_states": {"cpu": 8 * PSI + 2 * 4}}
    for master in masters:
        master.grad = None  # transient, as ZeRO assumes: 2 + 2 + 4 + 8 = 16 bytes per parameter
    b = memory_by_owner(model, opt)
    assert b.total() == 16 * PSI + 2 * 4 and b.get("main_grads") == 0
    theory = theory_model_state_bytes(PSI, dtype, "adam", num_param_tensors=2, master_weights=True)
    assert b.model_states().total == theory.total
    # Megatron style: an fp32 main_grad buffer on each parameter.
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    assert memory_by_owner(model).get("main_grads") == 4 * PSI
    # Without the model, the optimizer's parameters are simply parameters.
    assert memory_by_owner(optimizer=opt).get("parameters") == 4 * PSI


def test_module_buffers_meta_device_and_device_order() -> None:
    bn = nn.BatchNorm1d(4)
    assert _cells(memory_by_owner(bn)) == {"parameters": {"cpu": 32}, "module_buffers": {"cpu": 40}}
    meta = nn.Linear(10, 7, device="meta")
    b = memory_by_owner(meta)
    assert (b.get("parameters", "meta"), b.get("parameters", "meta", "logical")) == (0, 308)
    assert b.devices == ["meta"]
    fake = MemoryBreakdown.from_dict({"resident": {"parameters": {"cuda:1": 1, "cpu": 2, "cuda:0": 3}},
                                      "logical": {"parameters": {"cuda:10": 4}}})
    assert fake.devices == ["cpu", "cuda:0", "cuda:1", "cuda:10"]
    assert fake.get("parameters", "cuda:0") == 3 and fake.get("parameters", torch.device("cuda", 1)) == 1
    assert fake.total("cuda:10", "logical") == 4 and fake.total() == 6


def test_activations_row_by_device() -> None:
    model = _mlp()
    with ActivationMemory(model) as act:
        loss = model(torch.randn(4, 10)).sum()
    loss.backward()
    assert act.bytes_by_device == {"cpu": 480}
    b = memory_by_owner(model, activations=act)
    assert b.get("activations") == b.get("activations", kind="logical") == 480
    assert b.get("parameters") == (10 * 20 + 20 + 20 * 5 + 5) * F32


def test_registry_and_owner_errors() -> None:
    reg = MemoryRegistry()
    with pytest.raises(ValueError, match="unknown memory category 'grads'"):
        reg.register("grads", torch.zeros(1))
    with pytest.raises(TypeError, match="takes a tensor"):
        reg.register("other", [torch.zeros(1)])  # type: ignore[arg-type]
    t = reg.register("comm_buffers", torch.zeros(4), "a")
    reg.register("other", torch.zeros(2), "b")
    assert isinstance(t, torch.Tensor) and len(reg) == 2 and isinstance(reg, MemoryOwner)
    assert [e.label for e in reg.entries] == ["a", "b"]
    assert reg.remove("a") == 1 and set(reg.memory_owners()) == {"other"}
    reg.clear()
    assert memory_by_owner(owners=[reg]).total() == 0
    with pytest.raises(TypeError, match=r"owners\[0\] \(Linear\) has no memory_owners"):
        memory_by_owner(owners=[nn.Linear(2, 2)])

    class Bad:
        def memory_owners(self) -> dict[str, list[torch.Tensor]]:
            return {"bucket": [torch.zeros(1)]}

    with pytest.raises(ValueError, match=r"Bad.memory_owners\(\) reported unknown category 'bucket'"):
        memory_by_owner(owners=[Bad()])
    with pytest.raises(ValueError, match="kind must be one of"):
        memory_by_owner().get("parameters", kind="peak")
    assert set(CATEGORIES) >= {"parameters", "gradients", "master_weights", "main_grads", "optimizer_states",
                               "comm_buffers", "activations"}


def test_breakdown_table_and_json() -> None:
    model = _linear()
    _backward(model)
    model.weight.grad.untyped_storage().resize_(0)
    b = memory_by_owner(model)
    assert b.table("B").splitlines() == [
        "category (B)  cpu resident  cpu logical",
        "parameters             308          308",
        "gradients               28          308",
        "total                  336          616",
    ]
    text = str(b)
    assert text.startswith("category (MiB)") and "0.00" in text
    assert len(b.table(all_rows=True).splitlines()) == len(CATEGORIES) + 2
    data = json.loads(json.dumps(b.to_dict()))
    assert (data["total_resident"], data["total_logical"]) == (336, 616)
    assert MemoryBreakdown.from_dict(data) == b
    with pytest.raises(ValueError, match="unit must be one of"):
        b.table("MB")


def test_memory_report_by_owner_is_additive(monkeypatch: pytest.MonkeyPatch) -> None:
    _forbid_cuda(monkeypatch)
    model = _linear()
    _backward(model)
    reg = MemoryRegistry()
    reg.register("comm_buffers", torch.zeros(25), "bucket")
    report = memory_report("cpu", model, owners=[reg])
    assert report.model_state == model_state_bytes(model)  # the old fields, unchanged
    assert report.by_owner is not None and report.by_owner.get("comm_buffers") == 100
    assert report.allocated_untracked is None  # CPU: no allocator numbers to compare with
    data = json.loads(json.dumps(report.to_dict()))
    assert {"device", "allocated", "peak_allocated", "reserved", "rss", "peak_rss", "model_state"} <= set(data)
    assert data["by_owner"]["total_resident"] == 308 * 2 + 100
    assert memory_report("cpu").by_owner is None and memory_report("cpu").to_dict()["by_owner"] is None


def test_memory_report_cuda_untracked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 5000)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 6000)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 8000)
    reg = MemoryRegistry()
    reg.register("other", torch.zeros(10))  # on the CPU: not part of cuda:0's allocation
    report = memory_report("cuda:0", owners=[reg])
    assert report.allocated_untracked == 5000 and report.by_owner.get("other", "cpu") == 40
