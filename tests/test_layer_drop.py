"""Progressive layer dropping (lslm.layer_drop): the schedule against its formula, bit-for-bit with keep
probability 1, a fixed mask against a model without those blocks, the expected number of kept blocks, bad
parameters refused, and data parallelism at 2 gloo ranks against the serial run."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from lslm.layer_drop import PLDSchedule, apply_progressive_layer_drop
from lslm.models.gpt import GPT, GPTConfig
from tests.helpers import run_workers

CONFIG = GPTConfig.tiny(n_layer=4, vocab_size=64, block_size=16, n_embd=32, n_head=2)


def _gpt(seed: int = 0, **overrides: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny(**{**CONFIG.__dict__, **overrides}))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (3, CONFIG.block_size + 1),
                           generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_schedule_equals_the_formula() -> None:
    s = PLDSchedule(theta_bar=0.5, gamma=0.01)
    for t in (0, 1, 10, 123, 10_000):
        theta = (1 - 0.5) * math.exp(-0.01 * t) + 0.5
        assert s.theta(t) == theta
        probs = s.keep_probs(t, 6)
        assert probs == [1 - layer / 6 * (1 - theta) for layer in range(1, 7)]
        assert s.expected_kept(t, 6) == pytest.approx(6 - 7 / 2 * (1 - theta), abs=1e-12)
    assert s.theta(0) == 1.0 and s.keep_probs(0, 3) == [1.0, 1.0, 1.0]
    assert s.keep_probs(10**9, 4)[-1] == pytest.approx(0.5)  # the last block tends to theta_bar
    span = PLDSchedule.spanning(200, theta_bar=0.5, remaining=0.05)
    assert span.gamma == math.log(20) / 200 and span.theta(200) - 0.5 == pytest.approx(0.05 * 0.5)


@pytest.mark.parametrize("kwargs", [dict(theta_bar=0.0), dict(theta_bar=1.5), dict(theta_bar=float("nan")),
                                    dict(gamma=-0.1), dict(gamma="fast"), dict(theta_bar=True)])
def test_bad_schedule_parameters_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="theta_bar|gamma"):
        PLDSchedule(**kwargs)


def test_bad_use_is_refused() -> None:
    with pytest.raises(ValueError, match="steps"):
        PLDSchedule.spanning(0)
    with pytest.raises(ValueError, match="remaining"):
        PLDSchedule.spanning(10, remaining=1.0)
    with pytest.raises(ValueError, match="t must be >= 0"):
        PLDSchedule().theta(-1)
    with pytest.raises(ValueError, match="generator"):
        apply_progressive_layer_drop(_gpt(), PLDSchedule(), generator=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no `blocks`"):
        apply_progressive_layer_drop(nn.Linear(2, 2), PLDSchedule(), generator=_gen())
    model = _gpt()
    pld = apply_progressive_layer_drop(model, PLDSchedule(), generator=_gen())
    with pytest.raises(ValueError, match="already applied"):
        apply_progressive_layer_drop(model, PLDSchedule(), generator=_gen())
    with pytest.raises(ValueError, match="one entry per block"):
        pld.fix_mask([True])


def test_keep_probability_one_reproduces_the_baseline_bit_for_bit() -> None:
    # gamma = 0 keeps theta(t) = 1 (as theta_bar = 1 does): every p_l is 1, nothing dropped, nothing rescaled.
    assert PLDSchedule(theta_bar=0.5, gamma=0.0).keep_probs(10**6, 4) == [1.0] * 4
    # Dropout on: the PLD draws come from their own generator, so the global RNG's dropout masks are unchanged.
    runs = []
    for pld in (False, True):
        model = _gpt(dropout=0.1)
        handle = apply_progressive_layer_drop(model, PLDSchedule(theta_bar=1.0, gamma=0.1),
                                              generator=_gen()) if pld else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        losses = []
        for step in range(2):
            opt.zero_grad()
            loss = model(*_batch(step))[1]
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if handle is not None:
                handle.step()
                assert handle.mask == [True] * CONFIG.n_layer
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def _reference(model: GPT, x: torch.Tensor, y: torch.Tensor, mask: list[bool], scales: list[float]) -> torch.Tensor:
    """The GPT's forward written out: blocks not in ``mask`` left out, kept sub-layers scaled."""
    h = model.drop(model.wte(x) + model.wpe(torch.arange(x.shape[1])))
    for block, keep, s in zip(model.blocks, mask, scales):
        if keep:
            h = h + block.attn(block.ln_1(h)) * s if s != 1.0 else h + block.attn(block.ln_1(h))
            h = h + block.mlp(block.ln_2(h)) * s if s != 1.0 else h + block.mlp(block.ln_2(h))
    logits = model.lm_head(model.ln_f(h))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("rescale", [False, True])
def test_a_fixed_mask_equals_the_model_without_those_blocks(rescale: bool) -> None:
    mask = [True, False, True, False]
    model = _gpt()
    ref = copy.deepcopy(model)
    pld = apply_progressive_layer_drop(model, PLDSchedule(0.5, 0.1), generator=_gen(), rescale=rescale)
    pld.set_step(5)
    pld.fix_mask(mask)
    calls = [0] * CONFIG.n_layer
    for i, block in enumerate(model.blocks):  # counts the MLP's first matmul: a skipped block computes nothing
        block.mlp.c_fc.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    x, y = _batch(0)
    loss = model(x, y)[1]
    loss.backward()
    assert calls == [1, 0, 1, 0] and pld.mask == mask
    scales = [1 / p if rescale else 1.0 for p in pld.keep_probs]
    ref_loss = _reference(ref, x, y, mask, scales)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if name.startswith("blocks.") and not mask[int(name.split(".")[1])]:
            assert p.grad is None and q.grad is None, name  # skipped: no gradient at all
        else:
            assert torch.equal(p.grad, q.grad), name
    if not rescale:  # and literally the model with those blocks removed
        removed = copy.deepcopy(ref)
        removed.blocks = nn.ModuleList(b for b, keep in zip(removed.blocks, mask) if keep)
        assert torch.equal(removed(x, y)[1], loss)
    # eval(): every block, unscaled, whatever the mask
    model.eval()
    pld.remove()
    plain = _gpt().eval()
    assert torch.equal(model(x)[0], plain(x)[0])


def test_gradients_without_rescale_equal_the_removed_model() -> None:
    mask = [False, True, True, False]
    model = _gpt()
    kept = copy.deepcopy(model)
    kept.blocks = nn.ModuleList(b for b, keep in zip(kept.blocks, mask) if keep)
    pld = apply_progressive_layer_drop(model, PLDSchedule(0.5, 0.1), generator=_gen(), rescale=False)
    pld.fix_mask(mask)
    x, y = _batch(1)
    model(x, y)[1].backward()
    kept(x, y)[1].backward()
    got = dict(model.named_parameters())
    renumber = {new: old for new, old in enumerate(i for i, keep in enumerate(mask) if keep)}
    for name, q in kept.named_parameters():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            name = f"blocks.{renumber[int(i)]}.{rest}"
        assert torch.equal(got[name].grad, q.grad), name
    assert all(p.grad is None for i in (0, 3) for p in model.blocks[i].parameters())


def test_expected_number_of_kept_blocks_is_the_sum_of_p() -> None:
    model = _gpt(n_layer=6)
    s = PLDSchedule(0.5, 0.01)
    pld = apply_progressive_layer_drop(model, s, generator=_gen(3))
    pld.set_step(50)
    n = 20_000
    draws = torch.tensor([pld.draw() for _ in range(n)], dtype=torch.float64)
    probs = torch.tensor(s.keep_probs(50, 6), dtype=torch.float64)
    # Independent Bernoulli draws: the mean count's standard error is sqrt(sum p(1-p) / n).
    se = math.sqrt(float((probs * (1 - probs)).sum()) / n)
    assert abs(draws.sum(1).mean().item() - s.expected_kept(50, 6)) < 4 * se
    per_layer_se = torch.sqrt(probs * (1 - probs) / n)
    assert bool(((draws.mean(0) - probs).abs() < 4 * per_layer_se).all())
    # Reproducible: the same seed draws the same masks; forwards count what they ran.
    again = apply_progressive_layer_drop(_gpt(n_layer=6), s, generator=_gen(3))
    again.set_step(50)
    assert [again.draw() for _ in range(50)] == draws[:50].bool().tolist()
    model.train()
    run = 0
    for step in range(3):
        model(_batch(step)[0])
        run += sum(pld.mask)
    assert pld.forwards == 3 and pld.blocks_run == run


def test_data_parallel_at_2_ranks_equals_the_serial_run() -> None:
    r = run_workers("tests.layer_drop_workers:dp_vs_serial", 2, timeout=120)
    first = r[0]
    assert any(not all(m) for m in first["masks"])  # blocks were skipped: the comparison is not vacuous
    assert all(rank["masks"] == first["masks"] for rank in r)  # every rank skipped the same blocks
    assert all(rank["skipped_none"] for rank in r)
    for variant in ("naive", "bucketed", "torch"):
        got = first[variant]
        assert got["masks_equal"], variant
        # fp32, the global batch's mean reduced in another order: rounding only.
        assert got["loss_diff"] < 1e-5 and got["param_diff"] < 1e-5, (variant, got)


def test_the_demo_records_both_runs_from_one_start() -> None:
    from lslm.demos.pld import pld_run, summarize_runs
    from lslm.plot.pld import plot_pld_curves

    data = pld_run(steps=3, batch_size=2, eval_every=3, eval_batches=1)
    base, pld = data["runs"]["baseline"], data["runs"]["pld"]
    n_layer = data["config"]["n_layer"]
    assert [s["blocks"] for s in base["steps"]] == [n_layer] * 3
    # t = 0: theta = 1, every block kept and unscaled, the same start and batch: the same loss, bit for bit.
    assert pld["steps"][0]["theta"] == 1.0 and pld["steps"][0]["blocks"] == n_layer
    assert pld["steps"][0]["loss"] == base["steps"][0]["loss"]
    assert base["evals"][0] == pld["evals"][0] and [e["step"] for e in pld["evals"]] == [-1, 2]
    assert [s["tokens"] for s in pld["steps"]] == [2 * data["config"]["block_size"] * k for k in (1, 2, 3)]
    s = summarize_runs(data, skip=0)
    assert s["baseline"]["blocks_per_step"] == n_layer and 0 < s["blocks_ratio"] <= 1
    data["summary"] = s
    fig = plot_pld_curves(data)
    assert len(fig.axes) == 3 and fig.axes[1].get_xlabel().startswith("training time (s")
    import matplotlib.pyplot as plt

    plt.close(fig)
