"""Exercise of notebook 03: a parallel criterion, built from DataParallel's pieces.

The learner writes ``parallel_loss(model, devices, idx, targets, ledger)``: one
DataParallel forward in which every replica computes its own loss, so that only
``n`` scalars (not the ``B x T x V`` logits) are gathered onto ``devices[0]``. It
returns the full-batch mean loss there, a 0-dim tensor in the autograd graph, using
``chunk_sizes``, ``scatter``, ``replicate``, ``parallel_apply``, ``gather`` and
``gpt_token_loss`` from :mod:`lslm.data_parallel.single_process`, each given
``ledger=ledger`` where it takes one.

The checker runs in this process (no launch: the "devices" are CPU threads, as in
the notebook): on an even and an uneven split it compares the loss and every
gradient with the plain model's, and the ledger's bytes with
:func:`~lslm.data_parallel.single_process.measure.theory_step_bytes`, exactly.
Each plausible mistake has its own diagnosis: logits gathered, an unweighted mean
of the replicas' losses, no replicas (the model itself applied to every chunk),
targets not scattered, losses taken out of the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lslm.data_parallel.single_process import (
    TransferLedger,
    chunk_sizes,
    gather,
    gpt_token_loss,
    parallel_apply,
    replicate,
    scatter,
    to_devices,
)
from lslm.data_parallel.single_process.measure import theory_step_bytes
from lslm.exercises.core import Verdict, report, run_local
from lslm.exercises.registry import Exercise, register
from lslm.models.gpt import GPT, GPTConfig

# fp32: the replicas sum their rows' losses and gradients in another order than the plain model (per chunk, then
# across chunks); with values O(1) that differs by a few ulps (~1e-7). The notebook compares with the same 1e-6.
ATOL = 1e-6
# (replica count, batch rows): an even split, then 5 rows over 3 replicas (chunks 2, 2, 1), where an unweighted
# mean of the replicas' losses differs from the full-batch mean.
CASES = ((2, 4), (3, 5))
SEQ = 8
CONFIG = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=64, block_size=SEQ)


def reference_parallel_loss(model: torch.nn.Module, devices: Sequence[torch.device], idx: torch.Tensor,
                            targets: torch.Tensor, ledger: TransferLedger) -> torch.Tensor:
    """Our solution: scatter (idx, targets), replicate, each replica its own loss, gather n scalars, weight b_i / B."""
    sizes = chunk_sizes(idx.shape[0], len(devices))
    pairs = scatter((idx, targets), devices, sizes, ledger=ledger)  # one (idx_i, targets_i) per replica
    replicas = replicate(model, devices, ledger=ledger)

    def replica_loss(replica: torch.nn.Module, idx_i: torch.Tensor, targets_i: torch.Tensor) -> torch.Tensor:
        return gpt_token_loss(replica(idx_i), targets_i)

    losses = parallel_apply([lambda x, t, r=r: replica_loss(r, x, t) for r in replicas], pairs, devices=devices)
    gathered = gather(losses, devices[0], devices, ledger=ledger)  # n scalars -> a vector of n on devices[0]
    weights = torch.tensor(sizes, dtype=gathered.dtype, device=gathered.device) / sum(sizes)
    return (gathered * weights).sum()


HINTS = {
    "error": "call it by hand on a small batch first; every tensor argument of scatter needs the batch as dim 0",
    "not_tensor": "return the combined loss itself: a 0-dim tensor on devices[0], still in the autograd graph",
    "no_ledger": "pass ledger=ledger to scatter, replicate and gather, so that every copy is counted",
    "no_replicas": "build the replicas with replicate(model, devices, ledger=ledger) and apply replica i to chunk i: "
                   "the model itself lives on device 0 only",
    "targets": "scatter the targets together with the inputs, scatter((idx, targets), devices, sizes, ledger=ledger),"
               " so that replica i gets the targets of its own rows on its own device",
    "logits": "the logits were gathered onto device 0: compute the loss inside each replica (a function that runs "
              "replica(idx_i) and then gpt_token_loss) and gather only the n scalar losses",
    "unweighted": "the replicas' chunks differ in size (5 rows over 3 replicas: 2, 2, 1): weight replica i's mean "
                  "loss by its share of the rows, b_i / B, instead of averaging the n losses",
    "sum": "that is the sum of the replicas' mean losses: weight each by its share of the rows, b_i / B",
    "no_grad": "no gradient reached the model's parameters: keep the losses in the autograd graph (no .item(), "
               "no .detach(), no torch.no_grad()) and build the replicas with replicate(...)",
    "loss": "the loss must equal the plain model's mean cross-entropy over the whole batch",
    "grad": "the loss is right but a gradient is not: every replica's graph must lead back to the model's "
            "parameters through replicate(...) (not through copies you made yourself)",
    "ledger": "compare your copies with the table of section 8 (parallel criterion): scatter inputs and targets, "
              "broadcast the parameters, gather n scalars",
}


def _problem(kind: str, message: str, **details: Any) -> dict[str, Any]:
    return {"passed": False, "message": message, "hint": HINTS[kind], "details": {"kind": kind, **details}}


def _case(fn: Callable[..., Any], n: int, batch: int) -> dict[str, Any] | None:
    """Run ``fn`` on one split; None if it matches the reference in loss, gradients and bytes, else the problem."""
    devices = to_devices(["cpu"] * n)
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(**CONFIG))
    gen = torch.Generator().manual_seed(100 + batch)
    # The 'devices' are CPU stand-ins, as in notebook 03; data starts on the host and scatter moves it.
    idx, targets = (torch.randint(0, CONFIG["vocab_size"], (batch, SEQ), generator=gen)  # lslm: cpu-ok (host data)
                    for _ in range(2))
    where = f"{n} replicas, batch {batch} (chunks {chunk_sizes(batch, n)})"
    ref_loss = model(idx, targets)[1]
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    ledger = TransferLedger()
    try:
        loss = fn(model, devices, idx, targets, ledger)
    except Exception as exc:  # noqa: BLE001 - the learner's error becomes the verdict
        return _problem("error", f"{where}: {type(exc).__name__}: {exc}")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or loss.device != devices[0]:
        got = f"shape {tuple(loss.shape)} on {loss.device}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        return _problem("not_tensor", f"{where}: expected a 0-dim tensor on {devices[0]}, got {got}")
    if not ledger.by_op():
        return _problem("no_ledger", f"{where}: the ledger recorded no copy at all")
    if ledger.total("broadcast", "forward") == 0:
        return _problem("no_replicas", f"{where}: no parameter was broadcast to the other replicas")
    row_logits = SEQ * CONFIG["vocab_size"] * 4
    gathered = ledger.total("gather", "forward")
    if gathered >= batch * row_logits:
        return _problem("logits", f"{where}: {gathered:,} bytes gathered onto device 0 (the logits, B*T*V*4 = "
                                  f"{batch * row_logits:,}); a parallel criterion gathers n*4 = {n * 4}")

    # The loss: the full-batch mean, else which wrong combination of the replicas' losses it is.
    if abs(loss.item() - ref_loss.item()) > ATOL:
        with torch.no_grad():
            per = [gpt_token_loss(model(i), t).item() for i, t in zip(idx.split(chunk_sizes(batch, n)),
                                                                       targets.split(chunk_sizes(batch, n)))]
        kind = "loss"
        if abs(loss.item() - sum(per) / n) <= ATOL:
            kind = "unweighted"
        elif abs(loss.item() - sum(per)) <= ATOL:
            kind = "sum"
        return _problem(kind, f"{where}: loss {loss.item():.7f}, expected {ref_loss.item():.7f}")

    if not loss.requires_grad:
        return _problem("no_grad", f"{where}: the returned loss does not require grad")
    try:
        loss.backward()
    except Exception as exc:  # noqa: BLE001
        return _problem("error", f"{where}: loss.backward() raised {type(exc).__name__}: {exc}")
    for name, p in model.named_parameters():
        if p.grad is None:
            return _problem("no_grad", f"{where}: {name}.grad is None after loss.backward()")
        if (p.grad - ref_grads[name]).abs().max().item() > ATOL:
            err = (p.grad - ref_grads[name]).abs().max().item()
            return _problem("grad", f"{where}: {name}.grad differs from the plain model's by {err:.2e}")

    # Every copy of the step, forward and backward, against the formulas of section 8.
    want = theory_step_bytes(param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                             batch=batch, n=n, input_row_bytes=SEQ * 8, target_row_bytes=SEQ * 8,
                             output_row_bytes=row_logits, parallel_loss=True)
    got = ledger.by_op()
    if got != want:
        key = next(k for k in [*want, *got] if got.get(k, 0) != want.get(k, 0))
        kind = "targets" if key == ("forward", "scatter") and got.get(key, 0) < want[key] else "ledger"
        return _problem(kind, f"{where}: {key[0]} {key[1]} moved {got.get(key, 0):,} bytes, "
                              f"expected {want.get(key, 0):,}",
                        ledger={f"{a} {b}": v for (a, b), v in got.items()})
    return None


def _judge(fn: Callable[..., Any]) -> dict[str, Any]:
    for n, batch in CASES:
        problem = _case(fn, n, batch)
        if problem is not None:
            return problem
    cases = "; ".join(f"{n} replicas x batch {b}" for n, b in CASES)
    return {"passed": True, "message": f"loss, gradients and every byte of the ledger match ({cases})"}


def check_parallel_loss(fn: Callable[..., Any]) -> Verdict:
    """Check the learner's ``parallel_loss(model, devices, idx, targets, ledger)`` in this process and print it."""
    return report(run_local(fn, _judge, exercise="parallel_loss"))


register(Exercise(
    name="parallel_loss", notebook="03_data_parallel", reference=reference_parallel_loss, check=check_parallel_loss,
    hints=("the forward of DataParallel (section 1) with one change: replica i computes its loss right after its "
           "forward, so gather receives n scalars, not logits; scatter the targets with the inputs",
           "sizes = chunk_sizes(B, n); pairs = scatter((idx, targets), devices, sizes, ledger=ledger); "
           "replicas = replicate(model, devices, ledger=ledger); parallel_apply one function per replica that "
           "returns gpt_token_loss(replica(idx_i), targets_i); gather the n losses onto devices[0] and return "
           "their sum weighted by b_i / B"),
))
