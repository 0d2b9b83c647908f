"""Notebook 10's exercise: one block of ring attention and the log-sum-exp merge, each classic mistake named.

The three mistakes the checker must tell apart (issue 23): the unstable form (``exp`` of raw scores, in the
block or in the merge), a missing rescale of the running output, and a wrong mask on the diagonal block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lslm.context_parallel import merge_partials as library_merge
from lslm.exercises import exercises, solution
from lslm.exercises.lse_merge import (
    check_merge_partials,
    reference_block_attention,
    reference_merge_partials,
)


# --- candidates (module level: the checker reads their source to tell a stub) -------------------------------
def block_attention(q, k, v, diagonal):  # a plain, correct solution written the online-softmax way
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    return (p @ v) / denom, (m + denom.log()).squeeze(-1)


def merge_partials(out_a, lse_a, out_b, lse_b):
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], m + torch.log(wa + wb)


def block_unstable(q, k, v, diagonal):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(s)  # no maximum subtracted
    return (e @ v) / e.sum(-1, keepdim=True), torch.log(e.sum(-1))


def merge_unstable(out_a, lse_a, out_b, lse_b):
    ea, eb = torch.exp(lse_a), torch.exp(lse_b)
    return (out_a * ea[..., None] + out_b * eb[..., None]) / (ea + eb)[..., None], torch.log(ea + eb)


def merge_no_rescale(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a + out_b * torch.exp(lse_b - lse)[..., None], lse  # the running output left as it was


def merge_plain_sum(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def block_diagonal_hidden(q, k, v, diagonal):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if diagonal:  # triu(0): a query no longer sees its own key (the first row sees nothing)
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(0), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def block_no_mask(q, k, v, diagonal):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def block_wrong_triangle(q, k, v, diagonal):
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if diagonal:  # the future is visible, the past hidden
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril(-1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def merge_max_lse(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse)[..., None] + out_b * torch.exp(lse_b - lse)[..., None], torch.maximum(
        lse_a, lse_b)


def merge_stub(out_a, lse_a, out_b, lse_b):
    """Merge two partial attention results."""
    raise NotImplementedError


def block_stub(q, k, v, diagonal):
    """Attention of q over one key block."""
    raise NotImplementedError


# --- tests ---------------------------------------------------------------------------------------------------
def test_the_references_are_the_library_merge_and_full_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 4, generator=gen) * 10 for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out, lse = torch.zeros_like(q[:, :, 8:]), torch.full((2, 2, 4), float("-inf"))
    for j in range(3):  # query block 2 over key blocks 0, 1 and its own (diagonal)
        part = reference_block_attention(q[:, :, 8:], k[:, :, 4 * j:4 * j + 4], v[:, :, 4 * j:4 * j + 4], j == 2)
        mine = reference_merge_partials(out, lse, *part)
        theirs = library_merge(out, lse, *part)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        out, lse = mine
    torch.testing.assert_close(out, want[:, :, 8:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge, block", [(reference_merge_partials, reference_block_attention),
                                          (merge_partials, block_attention)])
def test_correct_solutions_pass(merge, block, capsys) -> None:
    verdict = check_merge_partials(merge, block)
    assert verdict.passed, verdict
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("merge, block, kind, words", [
    (reference_merge_partials, block_unstable, "unstable", "exp without subtracting the maximum"),
    (merge_unstable, reference_block_attention, "unstable", "exp(lse) overflows"),
    (merge_no_rescale, reference_block_attention, "rescale", "not rescaled"),
    (merge_plain_sum, reference_block_attention, "rescale", "not rescaled"),
    (reference_merge_partials, block_diagonal_hidden, "mask", "diagonal block"),
    (reference_merge_partials, block_no_mask, "mask", "diagonal block"),
    (reference_merge_partials, block_wrong_triangle, "mask", "diagonal block"),
    (merge_max_lse, reference_block_attention, "lse", "merged lse is wrong"),
])
def test_each_mistake_is_named(merge, block, kind, words) -> None:
    verdict = check_merge_partials(merge, block)
    assert verdict.state == "failed" and verdict.details["kind"] == kind, verdict
    assert words in verdict.message, verdict.message
    assert verdict.hint


def test_stubs_are_not_attempted() -> None:
    assert check_merge_partials(merge_stub, block_stub).state == "not attempted"
    assert check_merge_partials(merge_partials, block_stub).state == "not attempted"


def test_registered_for_notebook_10(capsys) -> None:
    ex = exercises()["merge_partials"]
    assert ex.notebook == "10_beyond" and ex.check is check_merge_partials and len(ex.hints) == 2
    solution("merge_partials")
    shown = capsys.readouterr().out
    assert "def reference_merge_partials" in shown and "def reference_block_attention" in shown
