"""Every replay in lslm runs under the autocast its forward ran under (lslm.runtime.replay), CPU bf16 and fp16.

A recomputation differentiates its replay, so the replay must compute what the forward computed. Run outside the
forward's ``torch.autocast`` (the backward is called outside it, as torch's AMP recipe does), its matmuls were
fp32: the course GPT's gradients with full recomputation differed from those without by up to 0.7 % (bf16) and
0.15 % (fp16). Here: the gradients with each recompute mode equal those without, bit for bit (the replay runs
the same operations on the same inputs), for the plain GPT, under tensor parallelism (with and without sequence
parallelism) with dropout, and through the pipeline's ``remat``; ZeRO-R's partitioned checkpoints are checked
in tests/test_zero_r.py. Probe tests record the autocast state each replay sees and fail when it is not the
forward's (either way: a replay under an autocast the forward did not run under is as wrong).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lslm.context_parallel import ring
from lslm.context_parallel.group import CPGroup
from lslm.demos.recompute_check import AUTOCAST_DTYPES, autocast_rows
from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.partition import split_gpt
from lslm.pipeline.stage import StageRuntime
from lslm.runtime.replay import capture_forward_state, replaying
from lslm.tensor_parallel.random import RNGStatesTracker
from lslm.tensor_parallel.recompute import RECOMPUTE_MODES, recompute
from lslm.zero.activations import checkpoint_partitioned
from tests.helpers import run_workers

PRECISIONS = list(AUTOCAST_DTYPES)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_serial_gpt_gradients_are_bit_identical_under_autocast(precision: str) -> None:
    rows = {r["mode"]: r for r in autocast_rows((precision,), dropout=0.1)}
    assert set(rows) == {"selective", "full", "torch checkpoint", "full, fp32 replay"}
    for mode in ("selective", "full", "torch checkpoint"):
        assert rows[mode]["identical"] and rows[mode]["max_abs_diff"] == 0.0, rows[mode]
    # The negative control, a replay outside the forward's autocast (lslm's before): other gradients.
    assert not rows["full, fp32 replay"]["identical"] and rows["full, fp32 replay"]["max_rel_diff"] > 1e-4


@functools.cache
def _tp() -> dict[str, Any]:
    return run_workers("tests.recompute_workers:autocast_suite", 2, timeout=300)[0]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_gradients_are_bit_identical_under_autocast(precision: str, sp: bool) -> None:
    # tp = 2, dropout 0.1 (the tracker's streams replayed too). With sequence parallelism the column-parallel
    # linear's hand-written backward re-enters the forward's autocast as well (before, it mixed a half gradient
    # with fp32 saved tensors and raised).
    for mode in RECOMPUTE_MODES:
        got = _tp()[f"{precision}_{mode}_sp{sp}"]
        assert got["loss_equal"] and got["identical"], (mode, got)


# -- the pipeline's rematerialisation ----------------------------------------------------------------------------
def _pipeline_grads(remat: bool, dtype: torch.dtype, probe: list[Any] | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=2, block_size=16, vocab_size=96, n_embd=32, n_head=2, dropout=0.1)).train()
    if probe is not None:
        _record_autocast(model.blocks[0], probe)
    stages = split_gpt(model, 2)
    rt = [StageRuntime(s, torch.device("cpu"), remat=remat) for s in stages]
    tok = torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(11)  # dropout masks
    with torch.autocast("cpu", dtype=dtype):  # every F under autocast; every B (and remat's re-run) outside
        for mb in range(2):
            rows = slice(2 * mb, 2 * mb + 2)
            out = rt[0].forward(mb, tok[rows, :-1])
            rt[1].forward(mb, out.detach().clone(), tok[rows, 1:], 0.5)
    for mb in range(2):
        rt[0].backward(mb, rt[1].backward(mb))
    for r in rt:
        r.finish()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_pipeline_remat_gradients_are_bit_identical_under_autocast(precision: str) -> None:
    base = _pipeline_grads(False, AUTOCAST_DTYPES[precision])
    got = _pipeline_grads(True, AUTOCAST_DTYPES[precision])
    for name in base:
        assert torch.equal(got[name], base[name]), name
    assert all(g.abs().max() > 0 for g in base.values())


# -- probes: what autocast each replay sees -------------------------------------------------------------------------
def _state() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")


def _record_autocast(module: torch.nn.Module, seen: list[Any]) -> None:
    inner = module.forward

    def forward(*args: Any) -> Any:
        seen.append(_state())
        return inner(*args)

    module.forward = forward


def _replays(kind: str, dtype: torch.dtype, *, forward_autocast: bool) -> list[tuple[bool, torch.dtype]]:
    """The autocast state of each call of a block's forward: the forward's, then the replay's. The forward runs
    under ``dtype`` autocast (``forward_autocast``) and the backward outside, or the other way round."""
    seen: list[tuple[bool, torch.dtype]] = []
    lin = torch.nn.Linear(8, 8)

    def block(x: torch.Tensor) -> torch.Tensor:
        seen.append(_state())
        return torch.nn.functional.gelu(lin(x))

    x = torch.randn(2, 8, requires_grad=True)
    forward_ctx = torch.autocast("cpu", dtype=dtype, enabled=forward_autocast)
    backward_ctx = torch.autocast("cpu", dtype=dtype, enabled=not forward_autocast)
    if kind == "recompute":
        with forward_ctx:
            y = recompute(block, x, tracker=RNGStatesTracker())
    elif kind == "zero-r":  # one tensor-parallel rank: the "all-gather" is the rank's own slice
        comm = SimpleNamespace(all_gather_into_tensor=lambda out, piece, group, label: out.copy_(piece))
        pctx = SimpleNamespace(tp_size=1, tp_rank=0, tp_group=None, rng=None, comm=comm)
        with forward_ctx:
            y = checkpoint_partitioned(block, x, pctx)  # type: ignore[arg-type]
    else:
        raise ValueError(kind)
    with backward_ctx:
        y.float().sum().backward()
    return seen


@pytest.mark.parametrize("kind", ["recompute", "zero-r"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("forward_autocast", [True, False])
def test_a_replay_runs_under_the_forwards_autocast(kind: str, precision: str, forward_autocast: bool) -> None:
    dtype = AUTOCAST_DTYPES[precision]
    seen = _replays(kind, dtype, forward_autocast=forward_autocast)
    assert len(seen) == 2  # the forward, then its replay in the backward
    assert seen[0][0] is forward_autocast
    assert seen[1] == seen[0]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_pipeline_remat_reruns_under_the_forwards_autocast(precision: str) -> None:
    seen: list[Any] = []
    _pipeline_grads(True, AUTOCAST_DTYPES[precision], probe=seen)
    assert seen == [(True, AUTOCAST_DTYPES[precision])] * 4  # 2 forwards, 2 re-runs (in the backward)


def test_ring_attention_backward_recomputes_under_the_forwards_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autocast, ring attention casts its inputs to bf16 (as autocast casts attention's) and runs its core
    with autocast off (an fp32 score matmul under autocast would come back rounded to bf16); the backward re-enters
    that state, so even a backward run inside an autocast recomputes the forward's fp32 scores: the gradients are
    those of ring attention on bf16-cast inputs without autocast."""
    seen: list[Any] = []
    scores = ring._scores

    def probe(*args: Any) -> torch.Tensor:
        s = scores(*args)
        seen.append((_state()[0], args[0].dtype, s.dtype))
        return s

    monkeypatch.setattr(ring, "_scores", probe)
    group = CPGroup(comm=None, group=None, ranks=(0,), index=0)  # one rank: no messages
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring.ring_attention(q, k, v, group)
        assert out.dtype == torch.bfloat16  # as autocast's attention returns
        out.float().sum().backward()  # inside the autocast this time: the replay must not run under it
    assert seen == [(False, torch.float32, torch.float32)] * 2  # the forward's scores, then the backward's
    half = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    again = ring.ring_attention(*half, group)
    again.float().sum().backward()
    assert torch.equal(again, out)
    for mine, ref in zip((q, k, v), half):
        assert mine.grad.dtype == torch.float32 and torch.equal(mine.grad, ref.grad.float())


def test_replaying_restores_the_streams_and_leaves_them_as_they_were() -> None:
    tracker = RNGStatesTracker()
    tracker.add("s", 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        state = capture_forward_state("cpu", tracker)
    first = torch.rand(3)
    with tracker.fork("s"):
        first_s = torch.rand(3)
    after = torch.get_rng_state(), tracker.get_states()
    with replaying(state, tracker):
        assert _state() == (True, torch.bfloat16) and torch.is_grad_enabled()
        assert torch.equal(torch.rand(3), first)
        with tracker.fork("s"):
            assert torch.equal(torch.rand(3), first_s)
    assert torch.equal(torch.get_rng_state(), after[0])
    assert all(torch.equal(a, b) for a, b in zip(tracker.get_states().values(), after[1].values()))
    assert _state()[0] is False
