"""Zero-bubble's split linears under bf16 autocast on the CPU: ZB-H1's I-then-W gives 1F1B's gradients.

The split linear casts as autocast's ``F.linear`` does and keeps the half copies, so its ``I`` and its deferred
``W`` run their matmuls in bf16, the dtype of the forward (before, the backward mixed a bf16 output gradient with
the fp32 saved weight and raised "expected m1 and m2 to have the same dtype").

Bounds: ZB-H1 against 1F1B through the same split linears runs the same ops in the same order (the weight
gradients are only computed later), so they must be equal bit for bit. Against 1F1B with torch's own
``nn.Linear`` the kernels may differ in how they sum, so each gradient must lie within one bf16 unit roundoff
(``2^-8``) of its largest entry; against the serial model (one batch, not two micro-batches: other sums, each
rounded to bf16) within 4 units, the bound tests/test_recipe_precision.py allows a pipeline in bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from lslm.models.gpt import GPT, GPTConfig
from lslm.pipeline.partition import split_gpt
from lslm.pipeline.split_backward import WeightGradStore, split_linears
from lslm.pipeline.stage import StageRuntime

U_BF16 = 2.0**-8
CPU = torch.device("cpu")
M = 2  # micro-batches of 2 sequences


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(n_layer=4, block_size=16, vocab_size=96, n_embd=32, n_head=2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(0, 96, (4, 17), generator=torch.Generator().manual_seed(3))
    return tok[:, :-1], tok[:, 1:]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pipeline(schedule: str, split: bool) -> dict[str, torch.Tensor]:
    """Two stages in one process, forwards under bf16 autocast, backwards outside it (torch's AMP recipe).

    ``"1f1b"``: a full backward per micro-batch; ``"zb-h1"``: the input-gradient halves (I) first, every weight
    gradient (W) after them, in ZB-H1's order on two stages."""
    model = _model()
    stages = split_gpt(model, 2)
    stores = [WeightGradStore() if split else None for _ in stages]
    for s, store in zip(stages, stores):
        if store is not None:
            split_linears(s, store)
    rt = [StageRuntime(s, CPU, store=st) for s, st in zip(stages, stores)]
    x, y = _data()
    for mb in range(M):
        rows = slice(2 * mb, 2 * mb + 2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = rt[0].forward(mb, x[rows].clone())
            rt[1].forward(mb, out.detach().clone(), y[rows].clone(), 1 / M)
    deferred = schedule == "zb-h1"
    for mb in range(M):
        g = rt[1].backward(mb, split=deferred)
        rt[0].backward(mb, g, split=deferred)
    if deferred:
        for mb in range(M):
            rt[1].weight(mb)
            rt[0].weight(mb)
    for r in rt:
        r.finish()
    return _grads(model)


def _serial() -> dict[str, torch.Tensor]:
    model = _model()
    x, y = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)[1]
    loss.backward()
    return _grads(model)


def _within(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], units: float) -> None:
    assert got.keys() == want.keys()
    for n in want:
        assert got[n].dtype == torch.float32, n  # half weight gradients widened into the fp32 parameters'
        assert (got[n] - want[n]).abs().max() <= units * U_BF16 * want[n].abs().max(), n


def test_zb_h1_under_bf16_autocast_equals_1f1b_and_the_serial_model() -> None:
    zb = _pipeline("zb-h1", split=True)
    same_ops = _pipeline("1f1b", split=True)
    assert all(torch.equal(zb[n], same_ops[n]) for n in same_ops)
    _within(zb, _pipeline("1f1b", split=False), 1)
    _within(zb, _serial(), 4)


def test_split_linear_keeps_the_half_copies_autocast_keeps() -> None:
    """The deferred W holds bf16 tensors (the half input, the half output gradient), as nn.Linear's backward does."""
    model, store = _model(), WeightGradStore()
    split_linears(model, store)
    x, y = _data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x, y)[1]
    with store.deferring(0):
        loss.backward()
    held = store.tensors(0)
    assert len(held) == 2 * 17 and {t.dtype for t in held} == {torch.bfloat16}
    store.flush(0)
    store.reset()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.float32
