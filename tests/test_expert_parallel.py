"""lslm.expert_parallel: routing, capacity and the MoE layer, then experts sharded over ranks, against serial.

Single-process references: a per-token loop over the router's choices (the MoE's definition),
the dense MLP (one expert, top-1, renormalised gates: the same function), a brute-force capacity
queue, the auxiliary losses at a uniform router. Multi-process: one launch per world size (2 and
4) runs every case of :mod:`tests.expert_parallel_workers`: the expert-parallel layer against the
serial MoE on each rank's shard (outputs, input / router / expert gradients, drop counts) and the
ledger's bytes against :func:`~lslm.expert_parallel.traffic.ep_traffic`.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

from lslm.expert_parallel import (
    EPGroup,
    ExpertParallelMoE,
    MoE,
    TopKRouter,
    apply_expert_parallel,
    apply_moe,
    assign,
    check_moe,
    ep_traffic,
    expert_capacity,
    load_balancing_loss,
    moe_aux_loss,
    router_z_loss,
    rows_per_rank,
)
from lslm.models.gpt import GPT, MLP, GPTConfig
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.runtime.ledger import Comm
from tests.helpers import fake_world, nproc_backends, run_workers

TOL = 1e-6  # fp32; measured at most 2.4e-7 (expert gradients), outputs and router gradients within 3e-8


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- routing and the auxiliary losses ------------------------------------------------------------
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_picks_the_top_k_and_gates_by_its_convention(renormalize: bool) -> None:
    torch.manual_seed(0)
    router = TopKRouter(8, 6, 2, renormalize)
    r = router(_x(10, 8))
    probs = torch.softmax(_x(10, 8) @ router.gate.weight.t(), -1)
    torch.testing.assert_close(r.probs, probs)
    assert torch.equal(r.experts, probs.topk(2, -1).indices)
    chosen = probs.gather(1, r.experts)
    want = chosen / chosen.sum(-1, keepdim=True) if renormalize else chosen
    torch.testing.assert_close(r.gates, want)


def test_auxiliary_losses_at_a_uniform_router_and_against_their_formulas() -> None:
    router = TopKRouter(8, 4, 2)
    torch.nn.init.zeros_(router.gate.weight)
    r = router(_x(12, 8))
    assert load_balancing_loss(r).item() == pytest.approx(1.0)  # f sums to 1, every P_i = 1/N
    assert router_z_loss(r).item() == pytest.approx(math.log(4) ** 2)
    torch.manual_seed(1)
    r = TopKRouter(8, 4, 2)(_x(12, 8) * 3)
    f = [sum(int(e == i) for e in r.experts.flatten().tolist()) / 24 for i in range(4)]
    p = r.probs.mean(0).tolist()
    assert load_balancing_loss(r).item() == pytest.approx(4 * sum(a * b for a, b in zip(f, p)), rel=1e-6)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in r.logits.tolist()) / 12
    assert router_z_loss(r).item() == pytest.approx(z, rel=1e-5)


# -- capacity ------------------------------------------------------------------------------------
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, None])
def test_capacity_keeps_first_choices_first_and_counts_the_drops(capacity_factor: float | None) -> None:
    T, E, k = 20, 4, 2
    experts = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)])
    gates = torch.rand(T, k, generator=torch.Generator().manual_seed(99))
    cap = expert_capacity(T, E, k, capacity_factor)
    a = assign(experts, gates, E, cap)
    # brute force: queues filled choice by choice, token by token
    queues: dict[int, list[tuple[int, float]]] = {e: [] for e in range(E)}
    dropped = 0
    for j in range(k):
        for t in range(T):
            e = int(experts[t, j])
            if cap is None or len(queues[e]) < cap:
                queues[e].append((t, float(gates[t, j])))
            else:
                dropped += 1
    assert a.dropped == dropped and (cap is not None or dropped == 0)
    assert a.per_expert.tolist() == [len(queues[e]) for e in range(E)]
    assert a.routed.tolist() == torch.bincount(experts.flatten(), minlength=E).tolist()
    assert [(int(t), float(g)) for t, g in zip(a.tokens, a.gates)] == [x for e in range(E) for x in queues[e]]
    if capacity_factor == 0.5:
        assert cap == 5 and dropped > 0


# -- the layer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("top_k,capacity_factor", [(1, 1.0), (2, 1.0), (2, None)])
def test_moe_equals_its_per_token_definition(top_k: int, capacity_factor: float | None) -> None:
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, top_k, capacity_factor)
    x = _x(3, 5, 8)
    y = moe(x)
    flat = x.reshape(-1, 8)
    routing = moe.router(flat)
    kept = assign(routing.experts, routing.gates, 4, expert_capacity(15, 4, top_k, capacity_factor))
    want = torch.zeros_like(flat)
    for t, e, g in zip(kept.tokens.tolist(), kept.experts.tolist(), kept.gates):
        want[t] += g * moe.experts[e](flat[t:t + 1])[0]
    torch.testing.assert_close(y.reshape(-1, 8), want)
    assert moe.stats["dropped"] == kept.dropped and sum(moe.stats["per_expert"]) == 15 * top_k - kept.dropped


def test_one_expert_top_1_is_the_dense_mlp_outputs_and_gradients() -> None:
    cfg = GPTConfig.tiny(n_embd=8)
    torch.manual_seed(0)
    mlp = MLP(cfg)
    moe = MoE(8, 32, num_experts=1, top_k=1, capacity_factor=None, renormalize=True)
    moe.experts[0].load_state_dict({k: v for k, v in mlp.state_dict().items()})
    x1, x2 = _x(2, 6, 8).requires_grad_(), _x(2, 6, 8).requires_grad_()
    y1, y2 = mlp(x1), moe(x2)
    torch.testing.assert_close(y2, y1, rtol=0, atol=1e-7)
    dy = _x(2, 6, 8, seed=1)
    y1.backward(dy)
    y2.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=1e-7)
    for (name, p), q in zip(mlp.named_parameters(), moe.experts[0].parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


def test_expert_parallel_on_one_rank_is_the_serial_layer_and_sends_nothing() -> None:
    torch.manual_seed(0)
    serial = MoE(8, 16, 4, 2, 1.0)
    g = EPGroup(comm=Comm(), group=None, ranks=(0,), index=0)
    layer = ExpertParallelMoE(copy.deepcopy(serial), g)
    x = _x(2, 5, 8)
    torch.testing.assert_close(layer(x), serial(x), rtol=0, atol=0)
    assert layer.stats == serial.stats and g.comm.ledger.records == []
    assert ep_traffic(10, 10, 8, 4, 1)["forward"] == 0


def test_apply_moe_on_the_gpt_trains_with_the_auxiliary_loss() -> None:
    torch.manual_seed(0)
    model = apply_moe(GPT(GPTConfig.tiny(n_layer=1)), num_experts=4, top_k=2)
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        _, loss = model(idx, idx)
        (loss + moe_aux_loss(model)).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert model.blocks[0].mlp.router.gate.weight.grad.abs().sum() > 0


# -- refusals ------------------------------------------------------------------------------------
def test_bad_inputs_are_refused_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="num_experts = 6 is not divisible by ep = 4"):
        check_moe(6, 2, 1.0, ep=4)
    with pytest.raises(ValueError, match="top_k = 5 must be between 1 and num_experts = 4"):
        check_moe(4, 5, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        MoE(8, 16, 4, top_k=5)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(8, 16, 4, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="no lslm GPT Block"):
        apply_moe(torch.nn.Linear(2, 2), 4)
    model = apply_moe(GPT(GPTConfig.tiny()), 6, 2)
    with pytest.raises(ValueError, match="already"):
        apply_moe(model, 6, 2)
    with pytest.raises(ValueError, match="not divisible by ep = 4"):
        rows_per_rank(torch.zeros(4, 6, dtype=torch.long))
    with fake_world(0, 4):  # refused while building, before any token moves
        ctx = ParallelContext.create(RankGrid.build(4, dp=4), rank=0, local_rank=0, node_rank=0,
                                     device=torch.device("cpu"), backend="fake")
        with pytest.raises(ValueError, match="num_experts = 6 is not divisible by ep = 4"):
            apply_expert_parallel(model, ctx)
        with pytest.raises(ValueError, match="no MoE layer"):
            apply_expert_parallel(GPT(GPTConfig.tiny()), ctx)
        serial = apply_moe(GPT(GPTConfig.tiny()), 8, 2)
        numel = {n: p.numel() for n, p in serial.named_parameters()}
        sharded = apply_expert_parallel(serial, ctx)
        assert all(len(b.mlp.experts) == 2 for b in sharded.blocks)  # rank 0 keeps experts 0 and 1 of 8
        expert_numel = sum(v for n, v in numel.items() if ".experts." in n)
        assert sum(p.numel() for p in sharded.parameters()) == sum(numel.values()) - expert_numel * 3 // 4


_MOE_ARGS = dict(n_embd=8, hidden=16, num_experts=4, top_k=2)


@pytest.mark.parametrize(("name", "value"), [
    # Before: capacity_factor=inf built, then an OverflowError at the first forward (ceil(inf)); top_k=2.5 a
    # TypeError from inside torch.topk; NaN compares false both ways and slipped past range checks.
    ("capacity_factor", math.inf), ("capacity_factor", math.nan), ("capacity_factor", -1.0),
    ("capacity_factor", True), ("capacity_factor", "1.25"),
    ("top_k", 2.5), ("top_k", 0), ("top_k", 5), ("top_k", True), ("top_k", 2.0),
    ("num_experts", 4.0), ("num_experts", 0), ("num_experts", True),
    ("n_embd", 0), ("n_embd", 8.5), ("hidden", 0), ("hidden", -16), ("hidden", 16.0),
    ("renormalize", 1), ("renormalize", "yes"), ("bias", 0), ("bias", None),
    ("dropout", math.nan), ("dropout", -0.1), ("dropout", 1.5), ("dropout", True),
])
def test_bad_moe_arguments_are_refused_at_construction_naming_them(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{name}"):
        MoE(**{**_MOE_ARGS, name: value})


@pytest.mark.parametrize(("name", "value"), [("capacity_factor", math.inf), ("top_k", 2.5), ("num_experts", 4.5),
                                             ("hidden", 0), ("renormalize", 1)])
def test_apply_moe_refuses_bad_arguments_before_touching_the_model(name: str, value: object) -> None:
    model = GPT(GPTConfig.tiny())
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=f"^{name}"):
        apply_moe(model, **{"num_experts": 4, "top_k": 2, name: value})
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_router_and_capacity_refuse_bad_arguments() -> None:
    with pytest.raises(ValueError, match="^top_k"):
        TopKRouter(8, 4, 2.5)
    with pytest.raises(ValueError, match="^n_embd"):
        TopKRouter(0, 4, 2)
    with pytest.raises(ValueError, match="^capacity_factor"):
        expert_capacity(32, 4, 2, math.inf)
    with pytest.raises(ValueError, match="^ep"):
        check_moe(4, 2, 1.0, ep=0)
    # What is allowed stays allowed: None is dropless, an integral capacity factor is a number like any other.
    assert expert_capacity(32, 4, 2, None) is None and expert_capacity(32, 4, 2, 2) == 32
    moe = MoE(**{**_MOE_ARGS, "capacity_factor": None, "dropout": 1.0})
    assert moe(_x(3, 8)).shape == (3, 8)


# -- across ranks --------------------------------------------------------------------------------
@functools.cache
def _suite(nproc: int, backend: str) -> tuple[dict, ...]:
    return tuple(run_workers("tests.expert_parallel_workers:suite", nproc, backend=backend, timeout=300))


@pytest.mark.parametrize("nproc,backend", nproc_backends(2, 4))
def test_expert_parallel_equals_the_serial_moe(nproc: int, backend: str) -> None:
    """Outputs and gradients (input, router, experts), top-1 and top-2, with drops and dropless."""
    for r in _suite(nproc, backend):
        assert len(r["cases"]) == 4
        for c in r["cases"]:
            assert c["ep"] == nproc, c
            assert max(c["out"], c["grad_x"], c["grad_router"], c["grad_experts"]) <= TOL, c
            assert c["grad_experts_unreduced"] > 100 * TOL, c  # the gradient rule is what makes them equal


@pytest.mark.parametrize("nproc,backend", nproc_backends(2, 4))
def test_dropped_tokens_equal_the_serial_count(nproc: int, backend: str) -> None:
    results = _suite(nproc, backend)
    for r in results:
        for c in r["cases"]:
            assert c["dropped"] == c["dropped_serial"] == c["dropped_all"][r["rank"]], c
            assert (sum(c["dropped_all"]) == 0) == (c["capacity_factor"] is None), c
    assert all(c["dropped"] > 0 for c in results[0]["cases"] if c["capacity_factor"] == 0.5)


@pytest.mark.parametrize("nproc,backend", nproc_backends(2, 4))
def test_traffic_formula_equals_the_ledger(nproc: int, backend: str) -> None:
    results = _suite(nproc, backend)
    for r in results:
        for c in r["cases"]:
            assert (c["forward_bytes"], c["backward_bytes"]) == (c["formula"]["forward"], c["formula"]["backward"]), c
            assert c["labels"] == ["ep-combine", "ep-counts", "ep-dispatch"] and c["other_ops"] == [], c
    for i in range(len(results[0]["cases"])):  # over the ranks: every dispatched row travels there and back
        sent = sum(r["cases"][i]["sent"] for r in results)
        assert sent == sum(r["cases"][i]["received"] for r in results)
        rows = sum(r["cases"][i]["formula"]["rows"] for r in results)
        assert rows == sent * 16 * 4 * 2  # dispatched × hidden × bytes × 2 directions


@pytest.mark.parametrize("nproc,backend", nproc_backends(2, 4))
def test_moe_gpt_trains_expert_parallel_equal_to_serial(nproc: int, backend: str) -> None:
    """3 SGD steps of the MoE GPT (2 layers, 4 experts, top-2, capacity 1.0) against serial on every shard."""
    for r in _suite(nproc, backend):
        t = r["training"]
        assert t["ep"] == nproc and t["same_shared_names"], t
        # the losses are ~7: 1e-5 is a few fp32 ulps of them; the parameters measured within 1.2e-7
        assert t["loss_diff"] <= 1e-5 and t["aux_diff"] <= 1e-5 and t["param_diff"] <= TOL, t


@pytest.mark.parametrize("nproc,backend", nproc_backends(2, 4))
def test_load_balance_is_recorded_per_step_over_the_ep_group(nproc: int, backend: str) -> None:
    """lslm.demos.moe_training: tokens per expert and drops per layer and step, the same on every rank."""
    results = _suite(nproc, backend)
    tokens = nproc * 2 * 15  # batch 2 × 15 positions per rank
    capacity = expert_capacity(2 * 15, 4, 2, 1.0)  # per rank and expert
    for r in results:
        assert [s["layers"] for s in r["balance"]] == [s["layers"] for s in results[0]["balance"]]
        assert [s["step"] for s in r["balance"]] == [0, 1, 2]
        for step in r["balance"]:
            assert len(step["layers"]) == 2
            for layer in step["layers"]:
                assert layer["tokens"] == tokens and sum(layer["routed"]) == 2 * tokens
                assert layer["dropped"] == sum(layer["routed"]) - sum(layer["kept"]) >= 0
                assert max(layer["kept"]) <= nproc * capacity
                assert layer["max_over_mean"] == max(layer["routed"]) * 4 / (2 * tokens)
