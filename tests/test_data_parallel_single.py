"""Single-process DataParallel (scatter, replicate, parallel_apply, gather) against the plain module.

Tolerance: outputs and gradients are compared with ``atol=1e-6, rtol=1e-5`` in fp32.
The forward of each replica runs the same kernels on fewer rows, but the loss
and the gradients are summed in a different order (per replica, then across
replicas), so bit equality is not guaranteed; observed differences are ~1e-8.
Byte counts are compared exactly. No test asserts a timing.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lslm.data_parallel.single_process import DataParallel, gpt_token_loss
from lslm.data_parallel.single_process.apply import ReplicaError, parallel_apply
from lslm.data_parallel.single_process.comm import chunk_sizes
from lslm.data_parallel.single_process.ledger import TransferLedger
from lslm.data_parallel.single_process.measure import (
    PythonLoopForward,
    busiest_device_bytes,
    gil_benchmark,
    measure_step,
    replicate_cost,
    theory_step_bytes,
)
from lslm.data_parallel.single_process.replicate import replicate
from lslm.models.gpt import GPT, GPTConfig

TOL = dict(atol=1e-6, rtol=1e-5)
V, T = 1024, 16


def _model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**overrides))


def _batch(b: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (b, T), generator=g), torch.randint(0, V, (b, T), generator=g)


def _reference(model: nn.Module, idx: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach(), grads


def _assert_grads(model: nn.Module, ref: dict) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("n, batch", [(2, 4), (2, 5), (3, 7), (3, 3)])
def test_outputs_and_grads_equal_plain_module(n: int, batch: int) -> None:
    model = _model()
    idx, y = _batch(batch)
    ref_logits, ref_loss, ref_grads = _reference(model, idx, y)
    dp = DataParallel(model, ["cpu"] * n)
    logits, loss = dp(idx)
    assert loss is None and logits.shape == (batch, T, V)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    loss = gpt_token_loss(logits, y)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    _assert_grads(model, ref_grads)


@pytest.mark.parametrize("n, batch", [(2, 6), (3, 7)])
def test_parallel_criterion_same_loss_and_grads(n: int, batch: int) -> None:
    model = _model()
    idx, y = _batch(batch)
    _, ref_loss, ref_grads = _reference(model, idx, y)
    dp = DataParallel(model, ["cpu"] * n, parallel_criterion=gpt_token_loss)
    loss = dp(idx, target=y)
    assert loss.dim() == 0
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    _assert_grads(model, ref_grads)


def test_tied_weights_and_threads_off() -> None:
    model = _model(tie_weights=True)
    idx, y = _batch(5)
    _, ref_loss, ref_grads = _reference(model, idx, y)
    for threads in (True, False):
        loss = DataParallel(model, ["cpu", "cpu"], parallel_criterion=gpt_token_loss, threads=threads)(idx, target=y)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        loss.backward()
        _assert_grads(model, ref_grads)
        model.zero_grad(set_to_none=True)


def test_training_steps_match_serial() -> None:
    """Three SGD-momentum steps through DataParallel follow the serial run (losses and final weights).

    Not Adam: the key bias of attention has an exactly-zero gradient in theory (softmax ignores a
    constant shift), so both runs see ~1e-10 rounding noise there, which Adam's per-element
    normalisation turns into full-size steps of random sign. SGD keeps differences at rounding level.
    """
    serial, parallel = _model(), _model()
    dp = DataParallel(parallel, ["cpu"] * 3, parallel_criterion=gpt_token_loss)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9, foreach=False) for m in (serial, dp)]
    for step in range(3):
        idx, y = _batch(6, seed=10 + step)
        losses = [serial(idx, y)[1], dp(idx, target=y)]
        for opt, loss in zip(opts, losses):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(serial.named_parameters(), parallel.parameters()):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_float_input_gradient_flows_back_through_scatter() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(6, 3)
    x = torch.randn(5, 6, requires_grad=True)
    lin(x).square().sum().backward()
    ref_x, ref_w = x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    ledger = TransferLedger()
    DataParallel(lin, ["cpu", "cpu"], ledger=ledger)(x).square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x, **TOL)
    torch.testing.assert_close(lin.weight.grad, ref_w, **TOL)
    # Rows 3..4 went to replica 1 and their input gradient came back: 2 rows x 6 x 4 bytes each way.
    assert ledger.total("scatter", "forward") == ledger.total("gather", "backward") == 2 * 6 * 4


def test_no_grad_inference_matches() -> None:
    model = _model().eval()
    idx, _ = _batch(4)
    with torch.no_grad():
        ref, _ = model(idx)
        out, _ = DataParallel(model, ["cpu", "cpu"])(idx)
    assert not out.requires_grad
    torch.testing.assert_close(out, ref, **TOL)


# --- building blocks ---------------------------------------------------------------------


def test_chunk_sizes() -> None:
    assert chunk_sizes(5, 2) == [3, 2]
    assert chunk_sizes(7, 3) == [3, 2, 2]
    assert chunk_sizes(5, 4) == [2, 1, 1, 1]  # Tensor.chunk would give 3 chunks: 2, 2, 1
    assert chunk_sizes(3, 3) == [1, 1, 1]


def test_replicate_shares_replica0_and_reduces_grads() -> None:
    lin = nn.Linear(4, 2)
    ledger = TransferLedger()
    r0, r1 = replicate(lin, [torch.device("cpu")] * 2, ledger=ledger)
    assert list(r0.parameters()) == [] and list(r1.parameters()) == []  # copies are not Parameters
    assert r0.weight.data_ptr() == lin.weight.data_ptr()  # replica 0: the original storage, no copy
    assert r1.weight.data_ptr() != lin.weight.data_ptr()  # replica 1: a real copy
    assert not r1.weight.is_leaf and r1.weight.requires_grad
    assert ledger.total("broadcast", "forward") == (4 * 2 + 2) * 4
    x = torch.randn(3, 4)
    (r0(x).sum() + 2 * r1(x).sum()).backward()
    torch.testing.assert_close(lin.weight.grad, 3 * x.sum(0).expand(2, 4))
    assert ledger.total("reduce", "backward") == (4 * 2 + 2) * 4


def test_parallel_apply_order_and_grad_mode() -> None:
    mods = [nn.Identity() for _ in range(3)]
    xs = [(torch.full((2,), float(i), requires_grad=True),) for i in range(3)]
    out = parallel_apply(mods, xs, devices=["cpu"] * 3)
    assert [o[0].item() for o in out] == [0.0, 1.0, 2.0]
    with torch.no_grad():  # grad mode is thread-local: it must reach the worker threads
        out = parallel_apply([lambda t: t * 2] * 3, xs)
    assert not any(o.requires_grad for o in out)
    assert all(o.requires_grad for o in parallel_apply([lambda t: t * 2] * 3, xs))


# --- exact byte counts --------------------------------------------------------------------


@pytest.mark.parametrize("n, batch", [(2, 5), (3, 8)])
@pytest.mark.parametrize("parallel_loss", [False, True])
def test_byte_counts_exact(n: int, batch: int, parallel_loss: bool) -> None:
    model = _model()
    idx, y = _batch(batch)
    res = measure_step(model, idx, y, ["cpu"] * n, parallel_loss=parallel_loss)
    param_bytes = 4 * model.num_parameters()
    b0 = chunk_sizes(batch, n)[0]
    expected = theory_step_bytes(param_bytes=param_bytes, batch=batch, n=n, input_row_bytes=T * 8,
                                 target_row_bytes=T * 8, output_row_bytes=T * V * 4, parallel_loss=parallel_loss)
    assert res["bytes"] == expected
    # The hand formulas, written out once more without the helper:
    assert res["bytes"][("forward", "broadcast")] == res["bytes"][("backward", "reduce")] == (n - 1) * param_bytes
    if parallel_loss:
        assert res["gathered_bytes"] == n * 4
        assert res["bytes"][("forward", "scatter")] == (batch - b0) * T * 16  # ids and targets, int64
    else:
        assert res["gathered_bytes"] == batch * T * V * 4  # B x T x V fp32 logits on the output device
        assert res["bytes"][("backward", "scatter")] == (batch - b0) * T * V * 4
    assert res["peak_bytes"] == {}  # CPU: no CUDA statistics, and torch.cuda is never called


def test_ledger_places() -> None:
    model = _model()
    idx, _ = _batch(4)
    dp = DataParallel(model, ["cpu"] * 2)
    logits, _ = dp(idx)
    logits.sum().backward()
    received, sent = dp.ledger.received(), dp.ledger.sent()
    p = 4 * model.num_parameters()
    logit_half = 2 * T * V * 4
    assert received[1] == 2 * T * 8 + p + logit_half  # its input chunk, the parameters, its output gradient
    assert sent[1] == logit_half + p  # its logits, its parameter gradients
    assert received[0] == logit_half + p  # replica 1's logits, its gradients
    assert "broadcast" in dp.ledger.table()


def test_transfer_ledger_speaks_the_comm_ledger_vocabulary() -> None:
    """One vocabulary: TransferLedger is a CommLedger, a Transfer a CommRecord with ops torch.distributed names."""
    from lslm.runtime.ledger import CommLedger, CommRecord, bus_factor

    model = _model()
    idx, y = _batch(5)
    dp = DataParallel(model, ["cpu"] * 2, parallel_criterion=gpt_token_loss)
    dp(idx, target=y).backward()
    led = dp.ledger
    assert isinstance(led, CommLedger) and all(isinstance(r, CommRecord) for r in led.records)
    assert {r.op for r in led.records} == {"scatter", "broadcast", "gather", "reduce"}
    assert {r.label for r in led.records} == {"forward", "backward"}
    for op in ("scatter", "broadcast", "gather", "reduce"):
        bus_factor(op, 2)  # every op is one the multi-process ledger knows
    p = 4 * model.num_parameters()
    # The CommLedger queries give the same numbers as the place-aware ones.
    assert led.total_bytes("broadcast", "forward") == led.total("broadcast", "forward") == p
    assert led.total_bytes("reduce", "backward") == p and led.calls("reduce") == len(list(model.parameters()))
    assert led.total_bus_bytes() == led.total_bytes()  # one copy moves its bytes once
    assert led.summary()["gather"]["bytes"] == 2 * 4  # the two replicas' losses, fp32
    rec = led.select("scatter", "forward")[0]
    assert (rec.src, rec.dst, rec.phase, rec.dtype) == (0, 1, "forward", "int64")
    assert rec.completion_s is not None and rec.completion_s >= rec.issue_s  # CPU copies finish when they return
    led.clear()
    assert led.records == []


def test_replicate_cost_and_busiest_device() -> None:
    model = _model()
    idx, y = _batch(4)
    res = replicate_cost(model, idx, y, ["cpu"] * 3, repeats=1)
    assert res["broadcast_bytes"] == 2 * res["param_bytes"] == 2 * 4 * model.num_parameters()
    b = busiest_device_bytes(100, 4)
    assert b == {"data_parallel": 600.0, "ring_all_reduce": 300.0}
    assert busiest_device_bytes(100, 2)["data_parallel"] == busiest_device_bytes(100, 2)["ring_all_reduce"]


def test_gil_benchmark_runs() -> None:
    rows = gil_benchmark({"py": (PythonLoopForward(iters=100), torch.ones(2))}, replicas=(1, 2), repeats=1)
    assert [(r["workload"], r["replicas"]) for r in rows] == [("py", 1), ("py", 2)]
    assert all(r["serial_ms"] > 0 and r["threaded_ms"] > 0 for r in rows)


# --- bad input ----------------------------------------------------------------------------


def test_bad_input() -> None:
    model = _model()
    idx, y = _batch(2)
    for bad in ([], (), "cpu", None):
        with pytest.raises(ValueError, match="non-empty list"):
            DataParallel(model, bad)
    with pytest.raises(ValueError, match="cannot be split over 3 devices"):
        DataParallel(model, ["cpu"] * 3)(idx)
    with pytest.raises(ValueError, match="target="):
        DataParallel(model, ["cpu"] * 2, parallel_criterion=gpt_token_loss)(idx)
    with pytest.raises(ValueError, match="batch size 2"):
        DataParallel(model, ["cpu"] * 2)(idx, y[:1])
    with pytest.raises(ValueError, match="combine"):
        DataParallel(model, ["cpu"], combine="avg")
    with pytest.raises(ValueError, match="module must live on devices"):
        replicate(model, [torch.device("meta")])


class _FailOnSecondChunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 0:  # only replica 1's chunk starts with a positive value
            raise KeyError("boom")
        return self.lin(x)


def test_replica_exception_names_the_replica() -> None:
    x = torch.tensor([[-1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]])
    with pytest.raises(ReplicaError, match=r"replica 1 on device cpu raised KeyError: 'boom'") as info:
        DataParallel(_FailOnSecondChunk(), ["cpu", "cpu"])(x)
    assert info.value.replica == 1 and isinstance(info.value.__cause__, KeyError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_devices_match_and_report_peak_memory() -> None:
    """On GPUs (the same one twice when there is only one, and GPU + CPU): same numbers, per-device peaks."""
    model = _model().to("cuda:0")
    idx, y = (t.to("cuda:0") for t in _batch(5))
    _, ref_loss, ref_grads = _reference(model, idx, y)
    second = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    for devices in (["cuda:0", second], ["cuda:0", "cpu"]):
        res = measure_step(model, idx, y, devices, parallel_loss=False)
        assert abs(res["loss"] - ref_loss.item()) < 1e-5
        _assert_grads(model, ref_grads)
        assert "cuda:0" in res["peak_bytes"] and res["peak_bytes"]["cuda:0"] > 0
        assert res["gathered_bytes"] == 5 * T * V * 4


def test_demo_recipe_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from lslm.demos.data_parallel_demo import main

    record = main(["--devices", "cpu,cpu,cpu", "--batch", "4", "--seq", "16", "--repeats", "1"])
    assert max(record["check"].values()) <= 1e-6
    assert record["imbalance"]["gathered logits"]["gathered_bytes"] == 4 * 16 * V * 4
    assert record["imbalance"]["parallel loss"]["gathered_bytes"] == 3 * 4
    assert "gathered onto output device" in capsys.readouterr().out
