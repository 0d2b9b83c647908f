"""The pipeline executor: split backward, stage runtime, memory accounting, and every schedule against serial.

Tolerance against the serial GPT: ``max |g_pp - g| / max |g| <= 5e-6`` per parameter, and the
same relative bound on the loss. Micro-batching changes the order of the sums (the
gradient of a batch becomes the sum of ``m`` micro-batch gradients, each a mean over fewer
tokens, then scaled by ``1/m``), so results agree to a few fp32 ulps of the largest entry
(eps = 1.2e-7; measured <= 7e-7 here), not bit for bit. Between two runs of the *same*
schedule that differ only in rematerialisation or output deallocation the ops are the
same, so the gradients must be identical (exactly 0 difference on the CPU).
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from torch import nn

from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.actions import Action
from lslm.pipeline.apply import PipelinePlan, apply_pipeline, check_plan
from lslm.pipeline.memory import PipelineMemory
from lslm.pipeline.p2p import action_of_record, comm_label, peer_stage
from lslm.pipeline.partition import split_gpt
from lslm.pipeline.schedules import build_schedule
from lslm.pipeline.simulator import simulate
from lslm.pipeline.split_backward import SplitLinear, WeightGradStore, split_linears, unsplit_linears
from lslm.pipeline.stage import StageRuntime
from lslm.pipeline.theory import activation_memory_theory, activation_units_theory
from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import RankGrid
from lslm.runtime.records import CommRecord
from tests.helpers import backends, fake_world, nproc_backends, run_workers

TOL = 5e-6
CPU = torch.device("cpu")


def _model(dropout: float = 0.0, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(n_layer=4, block_size=16, vocab_size=96, n_embd=32, n_head=2, dropout=dropout))


def _data(rows: int = 4, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, 96, (rows, 17), generator=torch.Generator().manual_seed(seed))
    return tok[:, :-1], tok[:, 1:]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- split backward (zero bubble's I and W) ---------------------------------------------------------
def test_i_then_w_equals_the_full_backward_exactly() -> None:
    x, y = _data()
    plain = _model()
    for mb in range(2):
        plain(x[2 * mb:2 * mb + 2], y[2 * mb:2 * mb + 2])[1].backward()
    full, split = _model(), _model()
    stores = [WeightGradStore(), WeightGradStore()]
    names = split_linears(full, stores[0])
    split_linears(split, stores[1])
    assert len(names) == 4 * 4 + 1 and all(isinstance(m, SplitLinear) for m in (full.lm_head, full.blocks[0].mlp.c_fc))
    assert [n for n, _ in full.named_parameters()] == [n for n, _ in plain.named_parameters()]  # names unchanged
    for mb in range(2):
        full(x[2 * mb:2 * mb + 2], y[2 * mb:2 * mb + 2])[1].backward()  # store idle: a full B
    for mb in range(2):
        with stores[1].deferring(mb):  # I: input grads (and LayerNorm / embedding grads) only
            split(x[2 * mb:2 * mb + 2], y[2 * mb:2 * mb + 2])[1].backward()
    assert split.lm_head.weight.grad is None and split.blocks[0].ln_1.weight.grad is not None
    assert stores[1].pending() == [0, 1]
    # What each W needs: the layers' inputs and output gradients (every other tensor of the store's list).
    output_grads = [weakref.ref(g) for mb in range(2) for g in stores[1].tensors(mb)[1::2]]
    for mb in range(2):
        stores[1].flush(mb)  # W
    stores[1].reset()
    # W's matmuls record no graph: the gradients hold none, so an output gradient dies with its W (issue 30: they
    # had lived on in ``.grad``'s graph until the gradients were dropped, megabytes per stage under ZB-H1).
    assert all(p.grad is None or (p.grad.grad_fn is None and not p.grad.requires_grad) for p in split.parameters())
    assert len(output_grads) == 2 * 17 and all(r() is None for r in output_grads)
    g_full, g_split, g_plain = _grads(full), _grads(split), _grads(plain)
    assert g_full.keys() == g_split.keys() == g_plain.keys()
    for n in g_full:  # the same ops in the same order: bit for bit
        assert torch.equal(g_full[n], g_split[n]), n
    # Against torch's own nn.Linear backward: equal on torch 2.13's CPU kernels; the bound leaves room for
    # a BLAS that sums in another order.
    for n in g_full:
        assert (g_full[n] - g_plain[n]).abs().max() <= 1e-6 * g_plain[n].abs().max(), n
    assert unsplit_linears(split) == 17 and type(split.lm_head) is nn.Linear


def test_weight_grad_store_refuses_a_w_without_its_i_and_an_i_run_twice() -> None:
    model, store = _model(), WeightGradStore()
    split_linears(model, store)
    x, y = _data(2)
    with pytest.raises(RuntimeError, match="without its I"):
        store.flush(0)
    with store.deferring(0):
        model(x, y)[1].backward()
    with pytest.raises(RuntimeError, match="ran twice"), store.deferring(0):
        pass
    with pytest.raises(RuntimeError, match="never W"):
        store.reset()
    store.flush(0)
    with pytest.raises(RuntimeError, match="W ran twice"):
        store.flush(0)
    store.reset()


# -- one stage at a time, in one process ------------------------------------------------------------
def _two_stage_step(remat: bool, dealloc: bool, dropout: float = 0.0, split: bool = False,
                    memory: bool = False) -> tuple[GPT, list[StageRuntime], torch.Tensor, PipelineMemory | None]:
    model = _model(dropout)
    model.train()
    stages = split_gpt(model, 2)
    mem = PipelineMemory(model.parameters()) if memory else None
    stores = [WeightGradStore() if split else None for _ in stages]
    for s, store in zip(stages, stores):
        if store is not None:
            split_linears(s, store)
    rt = [StageRuntime(s, CPU, remat=remat, store=st, memory=mem) for s, st in zip(stages, stores)]
    x, y = _data()
    torch.manual_seed(11)  # dropout masks
    outs, losses = [], []
    for mb in range(2):
        out = rt[0].forward(mb, x[2 * mb:2 * mb + 2].clone())
        outs.append(out)
        recv = out.detach().clone()  # what a receive buffer would hold
        if dealloc:
            assert rt[0].deallocate_output(mb) == (0 if remat else 2 * 16 * 32 * 4)
        losses.append(rt[1].forward(mb, recv, y[2 * mb:2 * mb + 2].clone(), 0.5))
        if mem is not None:
            mem.observe()
    for mb in range(2):
        g = rt[1].backward(mb, split=split)
        rt[0].backward(mb, g, split=split)
        if split:
            rt[1].weight(mb)
            rt[0].weight(mb)
    for r in rt:
        r.finish()
    return model, rt, torch.stack(losses), mem


def test_stage_runtime_matches_the_serial_model() -> None:
    x, y = _data()
    ref = _model()
    ref(x, y)[1].backward()
    for remat, dealloc, split in [(False, False, False), (False, True, False), (True, False, False),
                                  (False, True, True)]:
        model, _, losses, _ = _two_stage_step(remat, dealloc, split=split)
        assert abs(losses.mean().item() - ref(x, y)[1].item()) < 1e-6
        got, want = _grads(model), _grads(ref)
        assert got.keys() == want.keys()
        for n in want:
            assert (got[n] - want[n]).abs().max() <= TOL * want[n].abs().max(), (remat, dealloc, split, n)


def test_deallocated_output_keeps_its_graph_and_remat_replays_dropout_exactly() -> None:
    model, rt, _, _ = _two_stage_step(remat=False, dealloc=False, dropout=0.1)
    base = _grads(model)
    rng_after = torch.get_rng_state()
    for remat, dealloc in [(False, True), (True, False), (True, True)]:
        model, rt, _, _ = _two_stage_step(remat=remat, dealloc=dealloc, dropout=0.1)
        got = _grads(model)
        assert all(torch.equal(got[n], base[n]) for n in base), (remat, dealloc)
        # The replay restored the RNG it borrowed: later random numbers are those of a run without remat.
        assert torch.equal(torch.get_rng_state(), rng_after)


def test_deallocation_frees_the_output_but_not_the_sent_bytes() -> None:
    model = _model()
    stage = StageRuntime(split_gpt(model, 2)[0], CPU)
    x, _ = _data(2)
    out = stage.forward(0, x)
    alias = out.detach()  # what the send holds
    before = alias.clone()
    assert stage.deallocate_output(0) == 2 * 16 * 32 * 4
    assert out.shape == (1,) and out.grad_fn is not None
    assert torch.equal(alias, before)  # the send still reads the old values
    assert stage.backward(0, torch.ones(2, 16, 32)) is None  # first stage: no input gradient
    stage.finish()


def test_memory_counts_saved_tensors_inputs_and_w_stores() -> None:
    model, rt, _, mem = _two_stage_step(remat=False, dealloc=True, memory=True)
    assert mem is not None
    per_mb = mem.summary()["per_mb_bytes"]
    assert per_mb["0"][0] == per_mb["0"][1] > 0 and per_mb["1"][0] == per_mb["1"][1] > 0
    # Both micro-batches in flight on both stages at the peak (GPipe-like order above).
    assert mem.peak_bytes == 2 * (per_mb["0"][0] + per_mb["1"][0])
    assert mem.freed_by_deallocation == 2 * 2 * 16 * 32 * 4
    assert mem.entries == {}
    if mem.allocator_peak_bytes is not None:  # glibc sees at least what the count holds at the same boundaries
        assert mem.allocator_peak_bytes >= mem.peak_bytes
    mem.note_gradients(model.parameters())  # each gradient storage once (the tied embedding's too)
    assert mem.gradient_bytes == sum(4 * p.numel() for p in model.parameters()) == mem.summary()["gradient_bytes"]
    _, _, _, kept = _two_stage_step(remat=False, dealloc=False, memory=True)
    assert kept is not None
    assert kept.summary()["per_mb_bytes"]["0"][0] - per_mb["0"][0] == 2 * 16 * 32 * 4
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert params  # parameters never enter an entry (checked through the exact counts above)


# -- plumbing ---------------------------------------------------------------------------------------
def test_labels_name_the_action() -> None:
    for a in [Action(2, "SEND_F", 5), Action(3, "RECV_F", 5), Action(1, "SEND_B", 0), Action(0, "RECV_B", 7)]:
        op = "send" if a.kind.startswith("SEND") else "recv"
        assert action_of_record(CommRecord(op=op, nbytes=4, group_size=2, label=comm_label(a))) == a
    assert comm_label(Action(2, "SEND_F", 5)) == "pp F s2 mb5" and comm_label(Action(2, "RECV_B", 1)) == "pp B s2 mb1"
    assert peer_stage(Action(2, "SEND_F", 0)) == 3 and peer_stage(Action(2, "SEND_B", 0)) == 1
    assert action_of_record(CommRecord(op="all_reduce", nbytes=4, group_size=2, label="pp dp grads s0")) is None


def test_check_plan_rejects_bad_plans_before_any_process_starts() -> None:
    check_plan(PipelinePlan("interleaved", 8, 2), pp_size=4, n_layer=8, batch_size=16)
    with pytest.raises(ValueError, match="8 stages, but the model has 4 blocks"):
        check_plan(PipelinePlan("interleaved", 8, 2), pp_size=4, n_layer=4, batch_size=16)
    with pytest.raises(ValueError, match="does not split into 3"):
        check_plan(PipelinePlan("1f1b", 3), pp_size=2, n_layer=4, batch_size=8)
    with pytest.raises(ValueError, match="multiple of num_ranks"):
        check_plan(PipelinePlan("interleaved", 6, 2), pp_size=4, n_layer=8, batch_size=12)
    with pytest.raises(ValueError, match="dualpipev needs"):
        check_plan(PipelinePlan("dualpipev", 4, 2), pp_size=4, n_layer=8, batch_size=8)
    with pytest.raises(ValueError, match="unknown schedule"):
        check_plan(PipelinePlan("pipedream"), pp_size=2, n_layer=4, batch_size=8)
    with pytest.raises(ValueError, match="unknown partition"):
        check_plan(PipelinePlan(partition="flops"), pp_size=2, n_layer=4, batch_size=8)
    with pytest.raises(ValueError, match="positive int"):
        check_plan(PipelinePlan(microbatches=0), pp_size=2, n_layer=4, batch_size=8)


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf"), True, "2"])
def test_step_refuses_a_loss_scale_that_is_not_a_finite_positive_number(bad: Any) -> None:
    # -1 would run gradient ascent and NaN would leave NaN gradients, both silently: refused
    # before any micro-batch runs (a fake 2-rank world: no process, nothing communicated).
    with fake_world(0, 2):
        ctx = ParallelContext.create(RankGrid.build(2, pp=2), rank=0, local_rank=0, node_rank=0, device=CPU,
                                     backend="fake", timeout_s=5)
        pipe = apply_pipeline(_model(), ctx, PipelinePlan("1f1b", 2))
        x, y = _data()
        with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
            pipe.step(x, y, loss_scale=bad)
        assert all(p.grad is None for p in pipe.parameters())


# -- real processes ---------------------------------------------------------------------------------
ROWS, T, C = 8, 16, 32  # tests/pipeline_workers.py: global batch, sequence, width


def _cases(p: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []

    def add(name: str, **kw: Any) -> None:
        cases.append({"name": name, **kw})

    for m in (1, 4):
        add(f"naive m{m}", schedule="naive", m=m)
    for sched in ("gpipe", "1f1b", "zb-h1"):
        for m in (1, 4, 8):
            add(f"{sched} m{m}", schedule=sched, m=m)
    for m in sorted({4, 8}):
        add(f"interleaved m{m}", schedule="interleaved", m=m, v=2)
    for m in sorted({2 * p, 8}):
        add(f"dualpipev m{m}", schedule="dualpipev", m=m, v=2)
    add("custom 1f1b-iw m4", schedule="1f1b", m=4, custom=True)
    add("timeline", schedule="1f1b", m=4, timeline=True)
    # Same schedule with remat / without deallocation: identical gradients.
    add("1f1b m8 remat", schedule="1f1b", m=8, remat=True, base="1f1b m8")
    add("zb-h1 m8 remat keep", schedule="zb-h1", m=8, remat=True, dealloc=False, base="zb-h1 m8")
    add("interleaved m8 remat", schedule="interleaved", m=8, v=2, remat=True, base="interleaved m8")
    add("dualpipev m8 keep", schedule="dualpipev", m=8, v=2, dealloc=False, base="dualpipev m8")
    add("dualpipev m8 remat", schedule="dualpipev", m=8, v=2, remat=True, base="dualpipev m8")
    add("1f1b m4 by time", schedule="1f1b", m=4, partition="time")  # measured costs, averaged over ranks
    # Memory, m = 8.
    for sched in ("gpipe", "1f1b"):
        add(f"mem {sched}", schedule=sched, m=8, memory=True)
        add(f"mem {sched} keep", schedule=sched, m=8, memory=True, dealloc=False, base=f"{sched} m8")
    add("mem 1f1b remat", schedule="1f1b", m=8, memory=True, remat=True, base="1f1b m8")
    add("mem zb-h1", schedule="zb-h1", m=8, memory=True)
    add("mem interleaved", schedule="interleaved", m=8, v=2, memory=True)
    add("mem dualpipev", schedule="dualpipev", m=8, v=2, memory=True)
    for m in (2, 4):  # GPipe's peak against m (m = 8 is "mem gpipe")
        add(f"mem gpipe m{m}", schedule="gpipe", m=m, memory=True)
    return cases


@pytest.fixture(scope="module", params=[pytest.param(tuple(q.values), marks=q.marks, id=q.id)
                                        for q in nproc_backends(2, 4)])
def pp_run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    """One launch per (world size = pipeline size, backend), running every case."""
    nproc, backend = request.param
    return nproc, run_workers("tests.pipeline_workers:suite", nproc, backend=backend, timeout=240, pp=nproc,
                              cases=_cases(nproc))


def test_every_schedule_matches_the_serial_model(pp_run: tuple[int, list[dict[str, Any]]]) -> None:
    p, results = pp_run
    all_names = results[0]["all_names"]
    for name in (c["name"] for c in _cases(p)):
        held: list[str] = []
        for r in results:
            case = r["cases"][name]
            assert case["loss_err"] <= TOL, (name, r["rank"], case["loss_err"])
            assert case["grad_err"] <= TOL, (name, r["rank"], case["grad_err"])
            assert case["missing_grads"] == [], (name, r["rank"])
            assert case["dp_sync"] == []  # dp = 1: nothing to average
            held += case["names"]
        assert sorted(held) == all_names, name  # every parameter on exactly one rank


def test_remat_and_deallocation_change_no_gradient(pp_run: tuple[int, list[dict[str, Any]]]) -> None:
    p, results = pp_run
    exact = all(r["device"] == "cpu" for r in results)  # CUDA kernels may sum in varying order
    for name in (c["name"] for c in _cases(p) if "base" in c):
        for r in results:
            diff = r["cases"][name]["diff_vs_base"]
            assert diff == 0.0 if exact else diff <= 1e-6, (name, r["rank"], diff)


def test_p2p_actions_are_posted_and_labelled_as_planned(pp_run: tuple[int, list[dict[str, Any]]]) -> None:
    p, results = pp_run
    for name in ("1f1b m8", "interleaved m8", "dualpipev m8", "zb-h1 m4"):
        for r in results:
            case = r["cases"][name]
            assert case["p2p"] == case["comm_actions"], (name, r["rank"])
            assert case["p2p_bytes"] == [ROWS // int(name.split("m")[-1]) * T * C * 4], (name, r["rank"])
            assert case["p2p_timed"] == [False], (name, r["rank"])  # no timeline asked: no completion stamps
    assert all(r["cases"]["timeline"]["p2p_timed"] == [True] for r in results)  # the timeline's comm bars
    timeline = results[0]["cases"]["timeline"]["timeline"]
    schedule = build_schedule("1f1b", p, 4)
    assert timeline["ranks"] == p and timeline["ordered"]
    assert timeline["compute"] == [len(schedule.compute[r]) for r in range(p)]
    assert timeline["comm"] == [sum(a.is_comm for a in schedule.actions(r)) for r in range(p)]


def test_activation_memory_follows_the_schedule(pp_run: tuple[int, list[dict[str, Any]]]) -> None:
    p, results = pp_run
    m, out_bytes = 8, (ROWS // 8) * T * C * 4
    for r in results:
        rank = r["pp_rank"]
        stage = str(rank)
        mem = {k: r["cases"][k]["memory"] for k in ("mem gpipe", "mem 1f1b", "mem gpipe keep", "mem 1f1b keep",
                                                     "mem 1f1b remat")}
        e = mem["mem gpipe"]["per_mb_bytes"][stage]
        assert len(set(e)) == 1 and mem["mem 1f1b"]["per_mb_bytes"][stage] == e  # every micro-batch alike
        e = e[0]
        in_flight = min(m, p - rank)
        assert mem["mem gpipe"]["peak_bytes"] == m * e  # GPipe: all m micro-batches in flight
        assert mem["mem 1f1b"]["peak_bytes"] == in_flight * e  # 1F1B: p - rank
        sent = 0 if rank == p - 1 else out_bytes  # the last stage sends no activation
        for sched, k in (("gpipe", m), ("1f1b", in_flight)):
            keep = mem[f"mem {sched} keep"]
            assert keep["per_mb_bytes"][stage] == [e + sent] * m
            assert keep["peak_bytes"] - mem[f"mem {sched}"]["peak_bytes"] == k * sent
            assert mem[f"mem {sched}"]["freed_by_deallocation"] == m * sent and keep["freed_by_deallocation"] == 0
        remat = mem["mem 1f1b remat"]
        kept_input = remat["per_mb_bytes"][stage][0]
        assert kept_input < e and remat["remat_forwards"] == m
        # The kept inputs, plus one re-run micro-batch holding all a forward holds (its output included).
        assert remat["peak_bytes"] == (in_flight - 1) * kept_input + e + sent


# Memory of every schedule: one micro-batch-stage ("e") is one stage's activations for one micro-batch, the unit of
# the simulator's peak_in_flight and of theory.activation_memory_theory.
MEM_CASES = {"gpipe": ("mem gpipe", 1), "1f1b": ("mem 1f1b", 1), "zb-h1": ("mem zb-h1", 1),
             "interleaved": ("mem interleaved", 2), "dualpipev": ("mem dualpipev", 2)}


def _held_by_schedule(name: str, p: int, m: int, v: int, rank: int,
                      mem: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
    """Held bytes, in-flight count and pending-W count at each of the executor's boundaries on ``rank``.

    The boundaries are those of :class:`PipelineMemory` without rematerialisation: before each compute action,
    then once after the step. Which (stage, micro-batch) pairs are in flight comes from the schedule's order
    alone, counted as the simulator counts ``peak_in_flight`` (F adds, B / I removes); a pair waiting for its W
    (after I) holds what the W needs. The bytes of each pair are the measured ones (``per_mb_bytes``,
    ``w_bytes``): the prediction says the executor holds exactly these pairs and nothing else.
    """
    sched = build_schedule(name, p, m, v)
    per_mb = {int(s): row for s, row in mem["per_mb_bytes"].items()}
    w_bytes = {(int(k.split(",")[0]), int(k.split(",")[1])): b for k, b in mem["w_bytes"].items()}
    handed = (ROWS // m) * T * C * 4  # one hidden state: what a stage hands to the next one on the same rank
    in_flight: set[tuple[int, int]] = set()
    pending: set[tuple[int, int]] = set()
    held, counts, ws = [], [], []

    def boundary() -> None:
        b = sum(per_mb[s][mb] for s, mb in in_flight) + sum(w_bytes[k] for k in pending)
        # DualPipeV's turn of the V (stages p-1 and p on the last rank): stage s's output is never sent (so never
        # deallocated) and is stage s+1's input, one storage charged to both pairs: the union counts it once.
        b -= handed * sum((s + 1, mb) in in_flight for s, mb in in_flight)
        held.append(b)
        counts.append(len(in_flight))
        ws.append(len(pending))

    for a in sched.compute[rank]:
        boundary()
        key = (a.stage, a.mb)
        if a.kind == "F":
            in_flight.add(key)
        elif a.kind in ("B", "I"):
            in_flight.remove(key)
            if a.kind == "I":
                pending.add(key)
        else:
            pending.remove(key)
    boundary()
    return held, counts, ws


def test_held_bytes_at_every_boundary_are_the_simulated_in_flight_set(pp_run: tuple[int, list[dict[str, Any]]]) -> None:
    """Every schedule at m = 8: the bytes held at each action boundary are exactly the sum over the (stage,
    micro-batch) pairs in flight there (the simulator's count) of their measured bytes, plus what pending Ws hold."""
    p, results = pp_run
    m = 8
    for name, (case, v) in MEM_CASES.items():
        sim = simulate(build_schedule(name, p, m, v))
        for r in results:
            rank, mem = r["pp_rank"], r["cases"][case]["memory"]
            held, counts, waiting_w = _held_by_schedule(name, p, m, v, rank, mem)
            assert mem["held"] == held, (name, rank)
            assert mem["peak_bytes"] == max(held), (name, rank)
            assert max(counts) == sim.peak_in_flight[rank] == activation_memory_theory(name, p, m, v, rank)
            assert max(waiting_w) == sim.peak_pending_w[rank], (name, rank)
            assert held[-1] == 0, (name, rank)  # every entry released by the end of the step


def test_peak_in_micro_batch_stage_units_against_the_simulator(pp_run: tuple[int, list[dict[str, Any]]]) -> None:
    """The notebook's comparison (measured peak / one micro-batch-stage's bytes vs ``peak_in_flight``), exact where
    it can be, and the exact relation that replaces it where a rank's stages or a pending W make it inexact."""
    p, results = pp_run
    m = 8
    sims = {name: simulate(build_schedule(name, p, m, v)) for name, (_, v) in MEM_CASES.items()}
    for r in results:
        rank = r["pp_rank"]
        mem = {name: r["cases"][case]["memory"] for name, (case, _) in MEM_CASES.items()}
        e = {name: {int(s): row for s, row in x["per_mb_bytes"].items()} for name, x in mem.items()}
        for name, stages in e.items():
            assert all(len(set(row)) == 1 for row in stages.values()), name  # every micro-batch of a stage alike
        e = {name: {s: row[0] for s, row in stages.items()} for name, stages in e.items()}

        # ZB-H1: rank r peaks with p - r micro-batches in flight AND r micro-batches whose I ran and W waits; each
        # of those still holds every linear layer's input and output gradient (w bytes, nearly a whole e). So the
        # peak is p entries on every rank; in e units exactly p - r (the simulator's count) only on rank 0.
        (ez,) = e["zb-h1"].values()
        (wz,) = set(mem["zb-h1"]["w_bytes"].values())
        assert 0 < wz < ez
        assert sims["zb-h1"].peak_in_flight[rank] == p - rank
        assert mem["zb-h1"]["peak_bytes"] == (p - rank) * ez + rank * wz, rank
        if rank == 0:
            assert mem["zb-h1"]["peak_bytes"] == sims["zb-h1"].peak_in_flight[0] * ez

        # Interleaved (v = 2) and DualPipeV: a rank holds two stages. Where both save the same bytes per
        # micro-batch (two middle stages of one block each: p = 4, ranks 1 and 2) the peak is exactly
        # peak_in_flight stages' worth. Elsewhere they differ (stage 0 also keeps the int64 token ids and the
        # positions its embeddings saved, the last stage the logits; on DualPipeV's last rank stage p-1 keeps the
        # output it hands to stage p), so the peak depends on which pairs are in flight at once, exactly as
        # test_held_bytes_at_every_boundary_are_the_simulated_in_flight_set checks, and lies between the extremes.
        for name in ("interleaved", "dualpipev"):
            k, stages = sims[name].peak_in_flight[rank], e[name]
            if p == 4 and rank in (1, 2):
                assert len(set(stages.values())) == 1, (name, rank)
                assert mem[name]["peak_bytes"] == k * next(iter(stages.values())), (name, rank)
            elif name == "interleaved":
                assert len(set(stages.values())) == 2
                assert k * min(stages.values()) < mem[name]["peak_bytes"] < k * max(stages.values()), (name, rank)
                if rank == 0:  # stages 0 and p: ids and positions, (ROWS / m) x T int64 each
                    assert stages[0] - stages[p] == 2 * (ROWS // m) * T * 8

        # Interleaved on rank 0: (v-1) p + 2 (p-1) + 1 micro-batch-stages, i.e. in units of one micro-batch over
        # L/p layers (v stages) p (1 + (p-1)/(p v)): Narayanan et al. 2021 sec. 2.2.2's factor over 1F1B's p.
        v = MEM_CASES["interleaved"][1]
        if rank == 0:
            assert sims["interleaved"].peak_in_flight[0] == (v - 1) * p + 2 * (p - 1) + 1 == {2: 5, 4: 11}[p]
            assert sims["interleaved"].peak_activation_units[0] == p * (1 + (p - 1) / (p * v)) \
                == activation_units_theory("interleaved", p, m, v, 0) == {2: 2.5, 4: 5.5}[p]

        # DualPipeV: DeepSeek-V3 (table 2) gives PP + 1 where PP counts pipeline *stages* (chunks), of which
        # DualPipeV puts two on each of its PP/2 devices; with p ranks PP = 2p, so every rank holds 2p + 1
        # chunk-micro-batches (this repo's reading; p + 1/2 in units of one micro-batch over L/p layers).
        assert sims["dualpipev"].peak_in_flight[rank] == activation_memory_theory("dualpipev", p, m, 2, rank) \
            == 2 * p + 1
        assert activation_units_theory("dualpipev", p, m, 2, rank) == p + 0.5


def test_gpipe_peak_is_all_m_micro_batches(pp_run: tuple[int, list[dict[str, Any]]]) -> None:
    """GPipe at m = 2, 4, 8: the peak is exactly m micro-batches' worth on every rank.

    The global batch is fixed (8 rows), so a micro-batch shrinks as m grows and the peak in *bytes* stays about
    the whole batch's activations; it is the count, in units of one micro-batch, that grows as m. At a fixed
    micro-batch size the bytes would grow with m too (1F1B's stay at p - rank micro-batches).
    """
    p, results = pp_run
    for r in results:
        stage = str(r["pp_rank"])
        for m, case in ((2, "mem gpipe m2"), (4, "mem gpipe m4"), (8, "mem gpipe")):
            mem = r["cases"][case]["memory"]
            row = mem["per_mb_bytes"][stage]
            assert len(row) == m and len(set(row)) == 1, (m, r["rank"])
            assert mem["peak_bytes"] == m * row[0] == activation_memory_theory("gpipe", p, m) * row[0], (m, r["rank"])


@pytest.mark.parametrize("backend", backends(4))
def test_data_parallel_times_pipeline_and_accumulation_match_serial(backend: str) -> None:
    cases = [{"name": "1f1b m4", "schedule": "1f1b", "m": 4},
             {"name": "gpipe m2", "schedule": "gpipe", "m": 2},
             {"name": "interleaved m4", "schedule": "interleaved", "m": 4, "v": 2},
             {"name": "zb-h1 m4", "schedule": "zb-h1", "m": 4},
             {"name": "dualpipev m4", "schedule": "dualpipev", "m": 4, "v": 2},
             {"name": "accumulate 1f1b m2", "schedule": "1f1b", "m": 2, "accumulate": True, "base": "1f1b m4"}]
    results = run_workers("tests.pipeline_workers:suite", 4, backend=backend, timeout=180, pp=2, dp=2, cases=cases)
    for c in cases:
        for r in results:
            case = r["cases"][c["name"]]
            assert case["loss_err"] <= TOL and case["grad_err"] <= TOL, (c["name"], r["rank"], case)
            assert case["dp_sync"] == [f"pp dp grads s{s}" for s in case["stages"]], (c["name"], r["rank"])
    for r in results:  # two half batches (loss_scale 0.5, one sync) = one whole batch, to rounding
        assert r["cases"]["accumulate 1f1b m2"]["diff_vs_base"] <= 1e-7, r["rank"]


TIED_CASES = [{"name": "1f1b m4", "schedule": "1f1b", "m": 4},
              {"name": "zb-h1 m4", "schedule": "zb-h1", "m": 4},
              {"name": "interleaved m4", "schedule": "interleaved", "m": 4, "v": 2},
              {"name": "dualpipev m4", "schedule": "dualpipev", "m": 4, "v": 2},
              {"name": "1f1b m4 meta", "schedule": "1f1b", "m": 4, "meta": True}]


@pytest.mark.parametrize("dp", [1, 2])
def test_tied_embedding_across_stages_matches_the_serial_tied_model(dp: int) -> None:
    """Megatron's embedding copy on the last stage: gradients summed between the first and last rank equal the
    serial tied gradient, one SGD step keeps both copies on the serial weights; DualPipeV's V puts both ends on
    rank 0, which keeps the tie and exchanges nothing."""
    results = run_workers("tests.pipeline_workers:tied_suite", 2 * dp, timeout=180, pp=2, dp=dp, cases=TIED_CASES)
    for c in TIED_CASES:
        for r in results:
            case = r["cases"][c["name"]]
            assert case["loss_err"] <= TOL and case["grad_err"] <= TOL, (c["name"], r["rank"], case)
            assert case["step_diff"] <= 1e-6, (c["name"], r["rank"], case["step_diff"])
            if c["schedule"] == "dualpipev":
                assert case["tied_ops"] == 0 and case["tied_param"] is None
                assert "lm_head.weight" not in case["names"]  # one tensor, named once, on rank 0
            else:
                assert case["tied_ops"] == 2, (c["name"], r["rank"])  # one send, one receive
                assert case["tied_param"] == ("wte.weight" if r["pp_rank"] == 0 else "lm_head.weight")
