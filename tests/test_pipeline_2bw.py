"""PipeDream-2BW (Narayanan et al. 2021, section 3): the version rule, its two buffers, the delayed update.

Pure checks (no processes): the version rule is the paper's formula, 2BW's order is 1F1B over the
whole micro-batch stream, two weight versions suffice and are needed, the serial simulation's
delay-0 rule is torch's SGD and its delay-1 rule is ``W(t+1) = W(t) - lr * grad f(W(t-1))`` term
by term. On processes (one launch per pipeline size): 2BW's parameters after N batches equal the
serial delay-1 simulation within ``TOL`` and differ from PipeDream-Flush's (delay 0) by far more.

Tolerance. Each rank runs the same fp32 ops in the same order as the serial GPT (a GPTStage chain is
``GPT.forward`` op for op); the one difference is that a stage's output gradient arrives as a tensor
instead of being summed inside one autograd graph, which can change the order of a few additions.
An fp32 ulp at the parameters' scale (|w| <= ~1: LayerNorm gains) is 1.2e-7, so after 4 SGD steps
with lr 0.5 we allow TOL = 1e-6 (about 8 ulps); measured: 0 (bitwise equal) on gloo. The delay
itself moves the parameters by 0.06 to 0.11 (max per stage) after 4 steps here, and the test asks for > 1000 x TOL.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from lslm.models.gpt import GPT
from lslm.pipeline.pipedream_2bw import (
    simulate_delayed_sgd,
    stash_versions,
    two_bw_schedule,
    version_of,
    version_plan,
)
from lslm.pipeline.schedules import build_schedule
from tests.helpers import nproc_backends, run_workers
from tests.pipeline_2bw_workers import LR, SEED, T, batches, config

TOL = 1e-6
N_BATCHES = 4


def test_version_rule_is_the_papers_formula() -> None:
    for m in range(1, 6):
        for k in range(1, 40):  # the paper counts micro-batches from 1
            assert version_of(k - 1, m) == max((k - 1) // m - 1, 0)
    assert [version_of(j, 2) for j in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]


def test_2bw_order_is_1f1b_over_the_whole_stream_without_flush() -> None:
    p, m, n = 4, 4, 3
    sched = two_bw_schedule(p, m, n)
    assert sched.compute == build_schedule("1f1b", p, m * n).compute
    acts = [str(a) for a in sched.actions(1)]
    # Steady state: after F(j + w) one batch SEND_F(j + w); RECV_B(j), after B(j) one batch SEND_B(j); RECV_F(...).
    i = acts.index("1F6")
    assert acts[i - 1:i + 7] == ["1RECV_F6", "1F6", "1SEND_F6", "1RECV_B4", "1B4", "1SEND_B4", "1RECV_F7", "1F7"]
    with pytest.raises(ValueError, match="num_batches"):
        two_bw_schedule(2, 2, 0)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_two_weight_versions_suffice_and_are_needed(p: int) -> None:
    n = 4
    for m in (p, p + 1, 2 * p):
        for r in range(p):
            plan = version_plan(p, m, n, r)
            assert [s.version for s in plan] == [version_of(s.action.mb, m) for s in plan]
            assert max(len(s.held) for s in plan) == 2 == stash_versions(p, r, "2bw")
            assert [(s.action.mb, s.creates) for s in plan if s.creates] == [(b * m + m - 1, b + 1) for b in range(n)]
            # Stash needed: F(b*m) of batch b >= 1 runs while W(b-1) still has backwards of batch b to serve...
            # ...and on rank r the first p-1-r forwards of batch b run before W(b) exists (the 1F1B offset).
            order = [str(s.action) for s in plan]
            for b in range(1, n):
                made = next(i for i, s in enumerate(plan) if s.creates == b)
                early = [j for j in range(b * m, b * m + m) if order.index(f"{r}F{j}") < made]
                assert len(early) == p - 1 - r
        # PipeDream's weight stashing would keep one version per micro-batch in flight on the stage.
        assert [stash_versions(p, r, "pipedream") for r in range(p)] == list(range(p, 0, -1))


def test_version_plan_refuses_too_few_microbatches() -> None:
    # The paper asks m >= p; with forward-first 1F1B m = p - 1 still fits in two versions, m = p - 2 does not.
    assert max(len(s.held) for r in range(4) for s in version_plan(4, 3, 4, r)) == 2
    with pytest.raises(ValueError, match="micro-batches per batch"):
        version_plan(4, 2, 4, 0)
    with pytest.raises(ValueError, match="'2bw' or 'pipedream'"):
        stash_versions(4, 0, "gpipe")


def _grad(model: GPT, x: torch.Tensor, y: torch.Tensor, m: int) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for xm, ym in zip(x.chunk(m), y.chunk(m)):
        (model(xm, ym)[1] * (1.0 / m)).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_serial_simulation_is_sgd_for_delay_0_and_the_papers_rule_for_delay_1() -> None:
    m, data = 2, batches(3, 4)
    torch.manual_seed(SEED)
    start = GPT(config())
    flush = simulate_delayed_sgd(copy.deepcopy(start), data, lr=LR, microbatches=m, delay=0)
    two_bw = simulate_delayed_sgd(copy.deepcopy(start), data, lr=LR, microbatches=m, delay=1)
    # delay 0 = torch.optim.SGD with gradient accumulation, bit for bit.
    sgd_model = copy.deepcopy(start)
    opt = torch.optim.SGD(sgd_model.parameters(), lr=LR)
    for t, (x, y) in enumerate(data):
        _grad(sgd_model, x, y, m)
        opt.step()
        assert all(torch.equal(p, flush.states[t][k]) for k, p in sgd_model.named_parameters())
    # delay 1: W1 = W0 - lr g0(W0) (nothing to delay yet), W2 = W1 - lr g1(W0), W3 = W2 - lr g2(W1).
    w0 = dict(start.named_parameters())
    assert all(torch.equal(two_bw.states[0][k], flush.states[0][k]) for k in w0)
    g1 = _grad(copy.deepcopy(start), *data[1], m)
    w1 = copy.deepcopy(start)
    w1.load_state_dict(two_bw.states[0])
    g2 = _grad(w1, *data[2], m)
    for k in w0:
        assert torch.equal(two_bw.states[1][k], torch.add(two_bw.states[0][k], g1[k], alpha=-LR))
        assert torch.equal(two_bw.states[2][k], torch.add(two_bw.states[1][k], g2[k], alpha=-LR))
    assert max((two_bw.states[1][k] - flush.states[1][k]).abs().max().item() for k in w0) > 1000 * TOL


@pytest.fixture(scope="module", params=[pytest.param(tuple(q.values), marks=q.marks, id=q.id)
                                        for q in nproc_backends(2, 4)])
def run(request: pytest.FixtureRequest) -> tuple[int, int, int, list[dict[str, Any]]]:
    """One launch per pipeline size: p=2 with m=3 (m > p), p=4 with m=4 (m = p)."""
    p, backend = request.param
    m = {2: 3, 4: 4}[p]
    rows = 2 * m
    return p, m, rows, run_workers("tests.pipeline_2bw_workers:suite", p, backend=backend, timeout=240,
                                   microbatches=m, num_batches=N_BATCHES, rows=rows)


def test_2bw_equals_the_delayed_rule_and_not_the_flush(run: tuple[int, int, int, list[dict[str, Any]]]) -> None:
    p, m, _, results = run
    assert [r["stage"] for r in results] == list(range(p))
    for r in results:
        assert r["moved"] > 1000 * TOL
        assert r["diff_2bw"] <= TOL, (r["rank"], r["diff_2bw"])
        assert r["diff_flush"] > 1000 * TOL, (r["rank"], r["diff_flush"])
        assert r["losses"] == results[0]["losses"]
        assert r["losses"] == pytest.approx(r["sim_losses"], abs=1e-5)
    # Batches 0 and 1 both see W(0) under 2BW; from batch 1 on, PipeDream-Flush sees newer weights.
    losses, flush = results[0]["losses"], results[0]["flush_losses"]
    assert losses[0] == pytest.approx(flush[0], abs=1e-5)
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses[1:], flush[1:]))


def test_each_microbatch_uses_its_version_and_each_batch_makes_one(
        run: tuple[int, int, int, list[dict[str, Any]]]) -> None:
    p, m, _, results = run
    for r in results:
        trace = [tuple(t) for t in r["trace"]]
        assert sorted(trace) == sorted((k, j, version_of(j, m)) for k in "FB" for j in range(N_BATCHES * m))
        assert [tuple(u) for u in r["updates"]] == [(b * m + m - 1, b + 1) for b in range(N_BATCHES)]


def test_weight_versions_take_two_stage_copies(run: tuple[int, int, int, list[dict[str, Any]]]) -> None:
    p, _, _, results = run
    for r in results:
        one = 4 * r["stage_numel"]  # fp32
        assert r["stage_bytes"] == one and r["grad_bytes"] == one
        assert r["version_bytes"] == 2 * one
        assert r["pipedream_stash_bytes"] == (p - r["rank"]) * one


def test_p2p_is_one_message_per_microbatch_and_direction(run: tuple[int, int, int, list[dict[str, Any]]]) -> None:
    p, m, rows, results = run
    hidden = rows // m * T * config().n_embd * 4
    total = N_BATCHES * m
    for r in results:
        rank, msgs = r["rank"], [tuple(x) for x in r["p2p"] if x[0] in ("send", "recv")]
        expect = []
        if rank < p - 1:
            expect += [("send", f"pp F s{rank} mb{j}", hidden, rank + 1) for j in range(total)]
            expect += [("recv", f"pp B s{rank} mb{j}", hidden, rank + 1) for j in range(total)]
        if rank > 0:
            expect += [("recv", f"pp F s{rank} mb{j}", hidden, rank - 1) for j in range(total)]
            expect += [("send", f"pp B s{rank} mb{j}", hidden, rank - 1) for j in range(total)]
        assert sorted(msgs) == sorted(expect)
        assert [x[0] for x in r["p2p"] if x[0] not in ("send", "recv")] == ["broadcast"]  # the losses
