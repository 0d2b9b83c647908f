"""Notebook 10's exercise: one block of ring attention and the log-sum-exp merge, each classic mistake named.

The three mistakes the checker must tell apart (issue 23): the unstable form (``exp`` of raw scores, in the
block or in the merge), a missing rescale of the running output, and a wrong mask on the diagonal block.
Issue 32 adds: the unstable form computed in float64 (it overflows past 709.8 too), a wrong scale that the
old single shape could not tell from 1/sqrt(D) (0.5, 1/len(q)), and rows with lse = -inf on both sides.
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


def merge_partials(out_a, lse_a, out_b, lse_b):  # the max trick written out, rows that saw no key included
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # no key on either side: any finite shift will do
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = (wa + wb)[..., None]
    return (out_a * wa[..., None] + out_b * wb[..., None]) / total.clamp_min(1e-30), m + torch.log(wa + wb)


def block_softmax(q, k, v, diagonal):  # another stable form: torch's softmax and logsumexp
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def merge_sigmoid(out_a, lse_a, out_b, lse_b):  # and another: the share of a is sigmoid(lse_a - lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    share_a = torch.sigmoid(lse_a - lse_b).nan_to_num(0.0)  # -inf - -inf is nan: a row with no key takes 0
    share_b = torch.where(torch.isneginf(lse), torch.zeros_like(share_a), 1 - share_a)
    return out_a * share_a[..., None] + out_b * share_b[..., None], lse


def merge_nan_when_both_empty(out_a, lse_a, out_b, lse_b):  # the max trick, right unless both sides are -inf
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (out_a * wa[..., None] + out_b * wb[..., None]) / (wa + wb)[..., None], m + torch.log(wa + wb)


def block_float64(q, k, v, diagonal):  # the unstable form computed in float64: fine up to 709, not beyond
    s = q.double() @ k.double().transpose(-2, -1) / q.shape[-1] ** 0.5
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(s)
    return ((e @ v.double()) / e.sum(-1, keepdim=True)).to(q.dtype), torch.log(e.sum(-1)).to(q.dtype)


def merge_float64(out_a, lse_a, out_b, lse_b):
    ea, eb = torch.exp(lse_a.double()), torch.exp(lse_b.double())
    out = (out_a.double() * ea[..., None] + out_b.double() * eb[..., None]) / (ea + eb)[..., None]
    return out.to(out_a.dtype), torch.log(ea + eb).to(lse_a.dtype)


def block_half_scale(q, k, v, diagonal):  # 0.5 is 1/sqrt(D) only for D = 4
    s = q @ k.transpose(-2, -1) * 0.5
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def block_batch_scale(q, k, v, diagonal):  # len(q) is the batch, not the head dimension
    s = q @ k.transpose(-2, -1) / len(q)
    if diagonal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


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
        torch.testing.assert_close(mine, theirs)  # the same merge wherever some key was seen
        out, lse = mine
    torch.testing.assert_close(out, want[:, :, 8:], rtol=1e-5, atol=1e-5)


def test_reference_merge_of_two_empty_sides_is_zero() -> None:
    out = torch.ones(2, 3, 4)
    nothing = torch.full((2, 3), float("-inf"))
    merged, lse = reference_merge_partials(out * 0, nothing, out * 0, nothing)
    assert torch.equal(merged, torch.zeros_like(out)) and torch.equal(lse, nothing)


@pytest.mark.parametrize("merge, block", [(reference_merge_partials, reference_block_attention),
                                          (merge_partials, block_attention), (merge_sigmoid, block_softmax)])
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
    (reference_merge_partials, block_float64, "unstable", "float64 scores up to"),
    (merge_float64, reference_block_attention, "unstable", "overflows float64 past 709.8"),
    (reference_merge_partials, block_half_scale, "scale", "scaled by 0.5, not 1/sqrt(D)"),
    (reference_merge_partials, block_batch_scale, "scale", "scaled by 1/len(q) (the batch)"),
    (merge_nan_when_both_empty, reference_block_attention, "both_empty", "lse_a = lse_b = -inf"),
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
