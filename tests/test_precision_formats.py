"""lslm.precision.formats: format facts against torch.finfo and hand-known values, bit layouts, gradient fractions.

The hand-known values: IEEE 754 binary16 (max (2 - 2^-10)·2^15 = 65504, smallest
subnormal 2^-24), bfloat16 (max (2 - 2^-7)·2^127 ≈ 3.39e38), and the OCP 8-bit formats
(Micikevicius et al. 2022, Table 1: E4M3 max 448 = 1.75·2^8, E5M2 max 57344 = 1.75·2^15).
The gradient fractions are checked on hand-built tensors whose every entry's fate is
worked out in the comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from lslm.precision.formats import (
    FORMATS,
    bit_layout,
    format_of,
    format_table,
    grad_exponent_histogram,
    underflow_report,
    underflow_window,
)

HAND = {  # name: (exponent bits, mantissa bits, bias, max, smallest normal, smallest subnormal, has inf)
    "fp32": (8, 23, 127, (2 - 2.0**-23) * 2.0**127, 2.0**-126, 2.0**-149, True),
    "fp16": (5, 10, 15, 65504.0, 2.0**-14, 2.0**-24, True),
    "bf16": (8, 7, 127, (2 - 2.0**-7) * 2.0**127, 2.0**-126, 2.0**-133, True),
    "fp8_e4m3": (4, 3, 7, 448.0, 2.0**-6, 2.0**-9, False),
    "fp8_e5m2": (5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, True),
}


@pytest.mark.parametrize("name", list(HAND))
def test_format_facts(name: str) -> None:
    f = FORMATS[name]
    fi = torch.finfo(f.dtype)
    assert (f.max, f.smallest_normal, f.eps, f.bits) == (fi.max, fi.smallest_normal, fi.eps, fi.bits)
    e, m, bias, mx, normal, sub, has_inf = HAND[name]
    assert (f.exponent_bits, f.mantissa_bits, f.bias, f.has_inf) == (e, m, bias, has_inf)
    assert (f.max, f.smallest_normal, f.smallest_subnormal) == (mx, normal, sub)
    assert f.sign_bits + f.exponent_bits + f.mantissa_bits == f.bits
    assert f.unit_roundoff == 2.0 ** -(m + 1)
    assert f.decimal_digits == pytest.approx((m + 1) * math.log10(2))
    # The smallest subnormal is representable; half of it rounds (ties to even) to 0; 3/4 of it rounds up to it.
    t = torch.tensor([sub, sub / 2, sub * 0.75], dtype=torch.float64).to(f.dtype).double()
    assert t.tolist() == [sub, 0.0, sub]


def test_hand_known_ranges_and_rows() -> None:
    assert FORMATS["bf16"].max == pytest.approx(3.3895e38, rel=1e-4)
    assert FORMATS["fp16"].unit_roundoff == 2.0**-11 and FORMATS["bf16"].unit_roundoff == 2.0**-8
    assert FORMATS["fp16"].log2_range == (-24, -14, 15)
    rows = format_table()
    assert [r["format"] for r in rows] == ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
    assert rows[1]["max"] == 65504.0 and rows[1]["decimal digits"] == 3.31
    assert format_of(torch.bfloat16) is FORMATS["bf16"] and format_of("fp16") is FORMATS["fp16"]
    with pytest.raises(ValueError, match="no float format"):
        format_of(torch.int32)


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e5m2"])
def test_overflow_threshold_is_where_the_cast_gives_inf(name: str) -> None:
    f = FORMATS[name]
    thr = torch.tensor(f.overflow_threshold, dtype=torch.float32)
    below = torch.nextafter(thr, torch.tensor(0.0))
    assert torch.isinf(thr.to(f.dtype)) and below.to(f.dtype).item() == f.max


def test_e4m3fn_saturates_instead_of_inf() -> None:
    f = FORMATS["fp8_e4m3"]
    assert f.overflow_threshold == 464.0
    big = torch.tensor([464.0, 1e4, float("inf")]).to(f.dtype).float()
    assert big.tolist() == [448.0, 448.0, 448.0]  # torch's cast: no inf in e4m3fn, it clamps


@pytest.mark.parametrize(("x", "name", "bits", "stored"), [
    (1.0, "fp16", ("0", "01111", "0000000000"), 1.0),
    (0.1, "fp16", ("0", "01011", "1001100110"), 0.0999755859375),  # 0x2E66
    (0.1, "bf16", ("0", "01111011", "1001101"), 0.10009765625),  # 0x3DCD
    (0.1, "fp32", ("0", "01111011", "10011001100110011001101"), 0.10000000149011612),  # 0x3DCCCCCD
    (0.1, "fp8_e4m3", ("0", "0011", "101"), 0.1015625),  # 1.625 · 2^-4
    (0.1, "fp8_e5m2", ("0", "01011", "10"), 0.09375),  # 1.5 · 2^-4
    (-2.0, "bf16", ("1", "10000000", "0000000"), -2.0),
    (65504.0, "fp16", ("0", "11110", "1111111111"), 65504.0),
    (1e5, "fp16", ("0", "11111", "0000000000"), math.inf),
    (2.0**-24, "fp16", ("0", "00000", "0000000001"), 2.0**-24),
    (1e-9, "fp16", ("0", "00000", "0000000000"), 0.0),
])
def test_bit_layout_hand_known(x: float, name: str, bits: tuple[str, str, str], stored: float) -> None:
    got = bit_layout(x, name)
    assert (got["sign"], got["exponent"], got["mantissa"]) == bits
    assert got["stored"] == stored


@pytest.mark.parametrize("name", list(HAND))
def test_bit_layout_decodes_to_the_stored_value(name: str) -> None:
    f = FORMATS[name]
    values = torch.randn(200, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 10.0 ** torch.randint(
        -6, 3, (200,), generator=torch.Generator().manual_seed(2))
    for x in values.tolist():
        b = bit_layout(x, name)
        e, mant = int(b["exponent"], 2), int(b["mantissa"], 2)
        if b["kind"] in ("inf", "nan") or e == 2**f.exponent_bits - 1 and f.has_inf:
            continue
        mag = 2.0 ** (1 - f.bias) * mant / 2**f.mantissa_bits if e == 0 else \
            2.0 ** (e - f.bias) * (1 + mant / 2**f.mantissa_bits)
        assert (-1) ** int(b["sign"]) * mag == b["stored"], (x, b)
        if b["kind"] == "normal" and abs(x) <= f.max:
            assert b["rel_error"] <= f.unit_roundoff
    assert bit_layout(0.0, name)["kind"] == "zero"


# -- gradients against a format -------------------------------------------------------------------------
def _grads() -> list[torch.Tensor | None]:
    # 1e-45 is fp32's smallest subnormal 2^-149 once stored.
    return [torch.tensor([0.0, 1.0, 0.75, -3.0, 2.0**-30]), None, torch.tensor([[0.5, 1e-45]])]


def test_exponent_histogram_exact() -> None:
    h = grad_exponent_histogram(_grads())
    # exponents: 1 -> 0, 0.75 -> -1, -3 -> 1, 2^-30 -> -30, 0.5 -> -1, 2^-149 -> -149
    assert h["exponents"] == list(range(-149, 2)) and (h["zeros"], h["nonzero"], h["total"]) == (1, 6, 7)
    assert {e: c for e, c in zip(h["exponents"], h["counts"]) if c} == {-149: 1, -30: 1, -1: 2, 0: 1, 1: 1}
    h = grad_exponent_histogram(_grads(), bins=range(-2, 1))
    assert (h["counts"], h["below"], h["above"]) == ([0, 2, 1], 2, 1)
    with pytest.raises(ValueError, match="consecutive"):
        grad_exponent_histogram(_grads(), bins=[0, 2])
    with pytest.raises(ValueError, match="no gradients"):
        grad_exponent_histogram([None])


def test_underflow_report_exact_fp16() -> None:
    g = torch.tensor([
        0.0,  # already zero in fp32: counted in "zeros", not classified
        2.0**-25,  # exactly half the smallest subnormal: ties to even -> 0, underflow
        -(2.0**-25) * 1.5,  # rounds to -2^-24: subnormal
        2.0**-20,  # subnormal
        2.0**-14,  # the smallest normal
        1.0,
        65519.0,  # below 65520: rounds to 65504, normal
        65520.0,  # the overflow threshold: inf
        -1e6,  # inf
    ])
    r = underflow_report([g], torch.float16)
    assert (r["zeros"], r["nonzero"]) == (1, 8)
    assert (r["underflow"], r["subnormal"], r["normal"], r["overflow"]) == (1 / 8, 2 / 8, 3 / 8, 2 / 8)
    r = underflow_report([g], "fp16", scale=2.0)  # 2^-24 now representable; 2^-19 still subnormal; 65519 overflows
    assert (r["underflow"], r["subnormal"], r["normal"], r["overflow"]) == (0, 3 / 8, 2 / 8, 3 / 8)
    with pytest.raises(ValueError, match="scale"):
        underflow_report([g], "fp16", scale=0.0)


def test_underflow_report_other_formats() -> None:
    r = underflow_report([torch.tensor([500.0, 1.0, 2.0**-10, 2.0**-8])], "fp8_e4m3")
    # 500 saturates to 448 in torch's cast: still an overflow; 2^-10 < half of 2^-9 -> 0; 2^-8 subnormal
    assert (r["overflow"], r["normal"], r["underflow"], r["subnormal"]) == (0.25, 0.25, 0.25, 0.25)
    r = underflow_report([torch.tensor([2.0**-130, 1e-30, 3e38])], torch.bfloat16, scale=4.0)
    assert (r["subnormal"], r["normal"], r["overflow"]) == (1 / 3, 1 / 3, 1 / 3)


def test_underflow_window_rows() -> None:
    g = [torch.tensor([2.0**-30, 2.0**-26, 2.0**-20, 1e-3, 0.5, 8.0])]
    rows = underflow_window(g, "fp16", range(0, 17, 4))
    assert [r["log2_scale"] for r in rows] == [0, 4, 8, 12, 16]
    assert rows[2] == {"log2_scale": 8, **underflow_report(g, "fp16", 2.0**8)}
    under = [r["underflow"] for r in rows]
    over = [r["overflow"] for r in rows]
    assert under == sorted(under, reverse=True) and over == sorted(over)
    assert under[0] == 2 / 6 and under[-1] == 0 and over[0] == 0 and over[-1] == 1 / 6  # 8 · 2^16 > 65504
