"""fp8 emulation (lslm.precision.fp8) against serial references written out here."""

from __future__ import annotations

import math

import pytest
import torch

from lslm.precision import fp8


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_exactly_representable_values_round_trip(fmt: str) -> None:
    # Every finite fp8 value, times a power-of-two scale, survives quantise -> dequantise exactly.
    dtype = fp8.FP8_DTYPES[fmt]
    raw = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = raw[torch.isfinite(raw)].reshape(1, -1)
    for scale in (1.0, 2.0**-20, 2.0**10):
        x = values * scale
        for rule, block in (("amax", (None, None)), ("e8m0_up", (1, 8)), ("none", (None, None))):
            if rule == "none" and scale != 1.0:
                continue
            q = fp8.quantize(x, fmt, block, rule)
            if rule == "amax":
                # amax / max is exact only when amax is the format's max times the scale: true here.
                assert float(q.scale) == scale
            assert torch.equal(q.dequantize(), x), (fmt, scale, rule)


def test_ocp_rule_saturates_block_maxima_above_1_75_times_a_power_of_two() -> None:
    # OCP MX v1.0 §6.3 puts a block max m at m / 2^(floor(log2 m) - 8) in [256, 512): e4m3 stops at 448, so a
    # max of 1.875 · 2^k (representable itself) saturates to 1.75 · 2^k. Rounding the scale up avoids it.
    x = torch.tensor([[1.875, 0.5, -0.25, 1.0]])
    assert torch.equal(fp8.quantize(x, "e4m3", (1, 4), "e8m0").dequantize(), torch.tensor([[1.75, 0.5, -0.25, 1.0]]))
    assert torch.equal(fp8.quantize(x, "e4m3", (1, 4), "e8m0_up").dequantize(), x)
    # Blocks whose max has a mantissa up to 1.75 round-trip exactly under the OCP rule too.
    y = torch.tensor([[1.75, 2.0**-9, 0.375, -1.5]]) * 2.0**-30
    assert torch.equal(fp8.quantize(y, "e4m3", (1, 4), "e8m0").dequantize(), y)


def test_mx_scales_are_powers_of_two_and_e8m0() -> None:
    x = torch.randn(64, 96, generator=_gen()) * torch.logspace(-6, 6, 96)
    q = fp8.quantize(x, "e4m3", (1, 32), "e8m0")
    assert q.scale.shape == (64, 3)
    mant, exp = torch.frexp(q.scale)
    assert torch.all(mant == 0.5)  # an exact power of two
    assert torch.all((exp - 1 >= -127) & (exp - 1 <= 127))
    # OCP MX v1.0 §6.3: the shared exponent is floor(log2 amax) - 8 for e4m3 elements.
    amax = x.abs().reshape(64, 3, 32).amax(-1)
    assert torch.equal(q.scale, 2.0 ** (torch.floor(torch.log2(amax)) - 8))
    up = fp8.quantize(x, "e4m3", (1, 32), "e8m0_up")
    assert torch.all(up.scale >= q.scale) and torch.all(amax / up.scale <= 448) and torch.all(amax / up.scale > 224)


def test_block_and_tile_shapes() -> None:
    x = torch.randn(256, 384, generator=_gen(1))
    assert fp8.quantize(x, "e4m3", (1, 128)).scale.shape == (256, 3)  # DeepSeek-V3 activations: 1 x 128
    assert fp8.quantize(x, "e4m3", (128, 128)).scale.shape == (2, 3)  # weights: 128 x 128
    assert fp8.quantize(x, "e4m3", (1, 32), "e8m0").scale.shape == (256, 12)  # MX: 32 elements
    assert fp8.quantize(x, "e4m3").scale.shape == (1, 1)
    # A ragged edge: 130 columns in blocks of 128 make two, the second 2 wide.
    y = torch.randn(4, 130, generator=_gen(2))
    q = fp8.quantize(y, "e4m3", (1, 128))
    assert q.scale.shape == (4, 2)
    assert torch.allclose(q.scale[:, 1], y[:, 128:].abs().amax(1) / 448)
    assert q.dequantize().shape == y.shape
    # 3-D activations are blocked on their 2-D view (tokens, channels).
    z = torch.randn(2, 8, 256, generator=_gen(3))
    assert fp8.quantize(z, "e4m3", (1, 128)).scale.shape == (16, 2)


def test_per_block_scale_is_the_blocks_own_amax() -> None:
    x = torch.randn(128, 256, generator=_gen(4))
    q = fp8.quantize(x, "e4m3", (128, 128))
    ref = x.reshape(1, 128, 2, 128).abs().amax(dim=(1, 3)) / 448  # the serial reference, block by block
    assert torch.equal(q.scale, ref)
    assert q.data.dtype == torch.float8_e4m3fn
    assert float(q.data.float().abs().max()) == 448  # each block's max lands on the format's max


def test_delayed_scaling_uses_the_history_max() -> None:
    ds = fp8.DelayedScaling("e4m3", history_len=3)
    assert ds.amax() is None
    first = ds.quantize(torch.tensor([[2.0, -1.0]]))
    assert float(first.scale) == pytest.approx(2.0 / 448, rel=1e-7)  # no history yet: the tensor's own amax
    for a in (8.0, 4.0, 1.0):
        ds.quantize(torch.tensor([[a]]))
    assert list(ds.history) == [8.0, 4.0, 1.0] and ds.amax() == 8.0  # only the last 3 kept
    q = ds.quantize(torch.tensor([[0.5, 16.0]]))
    assert float(q.scale) == pytest.approx(8.0 / 448, rel=1e-7)  # the history's max, not this tensor's 16
    assert float(q.dequantize().max()) == 8.0  # 16 saturates at the format's max times the scale
    assert ds.amax() == 16.0


def test_per_block_beats_per_tensor_on_outliers() -> None:
    x = torch.randn(64, 256, generator=_gen(5))
    x[3, 7] = 1e5  # one outlier: per tensor, every other value is pushed towards fp8's subnormals
    err = {name: fp8.relative_error(fp8.quantize(x, "e4m3", block, rule).dequantize()[torch.arange(64) != 3], x[
        torch.arange(64) != 3]) for name, block, rule in (("tensor", (None, None), "amax"),
                                                           ("deepseek", (1, 128), "amax"), ("mx", (1, 32), "e8m0_up"))}
    assert err["deepseek"] <= err["tensor"] and err["mx"] <= err["tensor"]
    assert err["tensor"] > 3 * err["deepseek"]
    # Without outliers all three are near e4m3's rounding error (u = 2^-4).
    y = torch.randn(64, 256, generator=_gen(6))
    for block, rule in (((None, None), "amax"), ((1, 128), "amax"), ((1, 32), "e8m0_up")):
        assert fp8.relative_error(fp8.quantize(y, "e4m3", block, rule).dequantize(), y) < 2.0**-4


def test_errors_shrink_with_mantissa_bits() -> None:
    x = torch.randn(256, 256, generator=_gen(7))
    e = {f: fp8.relative_error(fp8.quantize(x, f).dequantize(), x) for f in ("e5m2", "e4m3")}
    bf = fp8.relative_error(fp8.quantize(x, torch.bfloat16, scale_rule="none").dequantize(), x)
    assert bf < e["e4m3"] < e["e5m2"]


@pytest.mark.parametrize("recipe", list(fp8.RECIPES))
def test_fp8_linear_matches_a_serial_reference(recipe: str) -> None:
    lin = torch.nn.Linear(256, 128)
    f = fp8.Fp8Linear.from_linear(lin, recipe)
    assert f.weight is lin.weight and f.bias is lin.bias
    x = torch.randn(2, 64, 256, generator=_gen(8), requires_grad=True)
    g = torch.randn(2, 64, 128, generator=_gen(9))
    (f(x) * g).sum().backward()
    r = fp8.RECIPES[recipe]
    # The serial reference: each GEMM's operands quantised along its contraction, product in fp32.
    x2, g2, w = x.detach().reshape(128, 256), g.reshape(128, 128), lin.weight.detach()

    def dq(t: torch.Tensor, role: str, along_last: bool) -> torch.Tensor:
        fmt = r.backward if role == "g" else r.forward
        block = r.weight_block if role == "w" else r.block
        return fp8.quantize(t, fmt, block if along_last else block[::-1], r.scale_rule).dequantize()

    y_ref = dq(x2, "x", True) @ dq(w, "w", True).t() + lin.bias.detach()
    with torch.no_grad():
        assert torch.allclose(fp8.Fp8Linear.from_linear(lin, recipe)(x).reshape(128, 128), y_ref, rtol=0, atol=1e-6)
    gx = dq(g2, "g", True) @ dq(w, "w", False)
    gw = dq(g2, "g", False).t() @ dq(x2, "x", False)
    assert torch.allclose(x.grad.reshape(128, 256), gx, atol=1e-6)
    assert torch.allclose(lin.weight.grad, gw, atol=1e-5)
    assert torch.allclose(lin.bias.grad, g2.sum(0))
    # and close to the exact layer: e4m3/e5m2's rounding, not a wrong formula
    exact = x2 @ w.t() + lin.bias.detach()
    assert fp8.relative_error(y_ref, exact) < (0.01 if recipe == "bf16" else 0.1)


def test_emulate_fp8_keeps_parameters_and_skips_the_head() -> None:
    from lslm.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    before = dict(model.named_parameters())
    done = fp8.emulate_fp8(model, "MXFP8")
    assert "lm_head" not in done and any(n.endswith("c_fc") for n in done)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    idx = torch.randint(0, 64, (2, 16), generator=_gen(10))
    _, loss = model(idx, idx)
    loss.backward()
    assert math.isfinite(loss.item()) and all(p.grad is not None for p in model.parameters())


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="unknown fp8 format"):
        fp8.quantize(torch.ones(2, 2), "e3m4")
    with pytest.raises(ValueError, match="scale_rule"):
        fp8.quantize(torch.ones(2, 2), "e4m3", scale_rule="max")
    with pytest.raises(ValueError, match="block"):
        fp8.quantize(torch.ones(2, 2), "e4m3", (0, 2))
    with pytest.raises(ValueError, match="per-tensor only"):
        fp8.Fp8Recipe("x", delayed=True, block=(1, 32))
    with pytest.raises(ValueError, match="history_len"):
        fp8.DelayedScaling("e4m3", history_len=0)
    with pytest.raises(ValueError, match="amax"):
        fp8.quantize(torch.ones(4, 4), "e4m3", (1, 2), amax=1.0)
