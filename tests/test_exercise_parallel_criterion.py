"""Notebook 03's exercise: a parallel criterion from DataParallel's pieces (in-process, no launch).

The reference passes; each plausible mistake is rejected with the message and hint aimed at it.
"""

from __future__ import annotations

import pytest
import torch

from lslm.data_parallel.single_process import chunk_sizes, gather, gpt_token_loss, parallel_apply, replicate, scatter
from lslm.exercises import hint, solution
from lslm.exercises.parallel_criterion import check_parallel_loss, reference_parallel_loss


def gathers_the_logits(model, devices, idx, targets, ledger):
    # DataParallel's default path: the loss is computed on device 0 after gathering B x T x V logits.
    sizes = chunk_sizes(idx.shape[0], len(devices))
    chunks = scatter(idx, devices, sizes, ledger=ledger)
    outputs = parallel_apply(replicate(model, devices, ledger=ledger), [(c,) for c in chunks], devices=devices)
    return gpt_token_loss(gather([o[0] for o in outputs], devices[0], devices, ledger=ledger), targets)


def unweighted_mean(model, devices, idx, targets, ledger):
    sizes = chunk_sizes(idx.shape[0], len(devices))
    pairs = scatter((idx, targets), devices, sizes, ledger=ledger)
    replicas = replicate(model, devices, ledger=ledger)
    losses = parallel_apply([lambda x, t, r=r: gpt_token_loss(r(x), t) for r in replicas], pairs, devices=devices)
    return gather(losses, devices[0], devices, ledger=ledger).mean()


def no_replicas(model, devices, idx, targets, ledger):
    sizes = chunk_sizes(idx.shape[0], len(devices))
    losses = [gpt_token_loss(model(x), t) for x, t in scatter((idx, targets), devices, sizes, ledger=ledger)]
    return (gather(losses, devices[0], devices, ledger=ledger) * torch.tensor(sizes) / sum(sizes)).sum()


def targets_not_scattered(model, devices, idx, targets, ledger):
    sizes = chunk_sizes(idx.shape[0], len(devices))
    inputs = scatter(idx, devices, sizes, ledger=ledger)
    replicas = replicate(model, devices, ledger=ledger)
    losses = [gpt_token_loss(r(x), t) for r, x, t in zip(replicas, inputs, targets.split(sizes))]
    return (gather(losses, devices[0], devices, ledger=ledger) * torch.tensor(sizes) / sum(sizes)).sum()


def detached_losses(model, devices, idx, targets, ledger):
    sizes = chunk_sizes(idx.shape[0], len(devices))
    pairs = scatter((idx, targets), devices, sizes, ledger=ledger)
    losses = [gpt_token_loss(r(x), t).detach() for r, (x, t) in zip(replicate(model, devices, ledger=ledger), pairs)]
    return (gather(losses, devices[0], devices, ledger=ledger) * torch.tensor(sizes) / sum(sizes)).sum()


def parallel_loss(model, devices, idx, targets, ledger):
    """The notebook's stub."""
    raise NotImplementedError


def test_reference_passes(capsys) -> None:
    v = check_parallel_loss(reference_parallel_loss)
    assert v.passed, v
    assert capsys.readouterr().out.startswith("PASSED")


@pytest.mark.parametrize("fn, kind, message, hint_text", [
    (gathers_the_logits, "logits", "8,192 bytes gathered onto device 0 (the logits", "gather only the n scalar"),
    (unweighted_mean, "unweighted", "3 replicas, batch 5 (chunks [2, 2, 1]): loss", "b_i / B"),
    (no_replicas, "no_replicas", "no parameter was broadcast", "replicate(model, devices, ledger=ledger)"),
    (targets_not_scattered, "targets", "forward scatter moved 128 bytes, expected 256", "scatter((idx, targets)"),
    (detached_losses, "no_grad", "does not require grad", "keep the losses in the autograd graph"),
])
def test_mistake_is_named(fn, kind, message, hint_text) -> None:
    v = check_parallel_loss(fn)
    assert not v.passed and v.details["kind"] == kind, v
    assert message in v.message and hint_text in v.hint, v


def test_stub_is_not_attempted(capsys) -> None:
    v = check_parallel_loss(parallel_loss)
    assert v.state == "not attempted"
    assert capsys.readouterr().out.startswith("NOT ATTEMPTED YET")


def test_hint_and_solution_are_registered(capsys) -> None:
    hint("parallel_loss")
    assert "hint 2:" in capsys.readouterr().out
    solution("parallel_loss")
    assert "def reference_parallel_loss" in capsys.readouterr().out
    solution("install_bucket_hooks")
    assert "register_post_accumulate_grad_hook" in capsys.readouterr().out
