"""Activation memory of one layer: Korthikanti et al. (2022) Table 2, our term-by-term accounting, and measurements.

Measured bytes (saved-tensor hooks, unique storages, fp32 CPU) must equal
:func:`adapted_layer_bytes` exactly: every tensor the block saves is one named term.
The paper's 2-byte formula is reported next to it (a ratio, not an equality).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest

from lslm.demos.activation_check import run, table
from lslm.demos.activation_check import serial_layer as _serial_layer
from lslm.metrics.activation_theory import adapted_layer_bytes, format_terms, korthikanti_layer_bytes, layer_terms
from tests.helpers import backends, run_workers

# GPT-3 175B's layer (Korthikanti et al. 2022, Table 3): s=2048, h=12288, a=96, micro-batch 1.
GPT3 = dict(s=2048, b=1, h=12288, a=96)


# -- the paper's formulas ----------------------------------------------------------------------------------
def test_paper_formulas_are_table_2() -> None:
    s, b, h, a = GPT3.values()
    sbh = s * b * h
    assert korthikanti_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    for t in (2, 4, 8):
        assert korthikanti_layer_bytes(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
        assert korthikanti_layer_bytes(s, b, h, a, t, True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    # t = 1: every row of the table is the no-parallelism row.
    assert korthikanti_layer_bytes(s, b, h, a, 1, True) == korthikanti_layer_bytes(s, b, h, a, 1)


def test_paper_formula_at_other_widths_is_linear_in_them() -> None:
    s, b, h, a = 64, 2, 64, 4
    sbh, s2 = s * b * h, a * s * s * b
    # 34 = 16 activations x 2 bytes + 2 masks x 1 byte; 5as/h = (2 x 2 + 1) as/h.
    assert korthikanti_layer_bytes(s, b, h, a, act_bytes=4, mask_bytes=4) == 72 * sbh + 12 * s2
    assert korthikanti_layer_bytes(s, b, h, a, act_bytes=2, mask_bytes=1) == 34 * sbh + 5 * s2


# -- our accounting ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_adapted_is_paper_at_our_widths_plus_layer_norm_statistics(t: int, sp: bool) -> None:
    s, b, h, a = 64, 2, 64, 8  # at least two heads per rank (one head per rank keeps more: see below)
    stats = 4 * s * b * 4 // (t if sp else 1)  # mean and rstd of two LayerNorms, fp32
    assert adapted_layer_bytes(s, b, h, a, t, sp) == korthikanti_layer_bytes(s, b, h, a, t, sp, act_bytes=4,
                                                                             mask_bytes=4) + stats
    # With the paper's widths the only difference left is those statistics (fp32 here too).
    assert adapted_layer_bytes(s, b, h, a, t, sp, act_bytes=2, mask_bytes=1) == korthikanti_layer_bytes(
        s, b, h, a, t, sp) + stats


def test_terms_name_their_tensor_and_paper_term() -> None:
    terms = layer_terms(64, 2, 64, 4, 2, True)
    assert len(terms) == 19  # the paper's 15 tensors (13 activations, 2 masks) + 4 LayerNorm statistics
    names = [term.name for term in terms]
    assert names.count("ln_1 mean") == 1 and "softmax output" in names and "mlp dropout noise" in names
    assert sum(term.paper == "not counted" for term in terms) == 4  # LayerNorm mean/rstd, twice
    assert {term.sharding for term in terms} == {"sequence / t", "tensor / t"}
    assert format_terms(terms).splitlines()[-1].split()[-1] == f"{sum(x.bytes for x in terms):,}"
    no_regather = layer_terms(64, 2, 64, 4, 2, True, regather=False)
    diff = sum(x.bytes for x in no_regather) - sum(x.bytes for x in terms)
    assert diff == 2 * (64 * 2 * 64 - 64 * 2 * 64 // 2) * 4  # c_attn and c_fc inputs saved whole


def test_flash_and_no_dropout_terms() -> None:
    s, b, h, a = 64, 2, 64, 4
    sbh, s2, sb = s * b * h, a * s * s * b, s * b
    # No masks, and the softmax output is saved once (the attention-over-values matmul reuses it).
    assert adapted_layer_bytes(s, b, h, a, dropout=False) == 4 * (16 * sbh + s2) + 16 * sb
    # The fused kernel: the s^2 probabilities replaced by one log-sum-exp per row and head.
    assert adapted_layer_bytes(s, b, h, a, dropout=False, attention="flash") == 4 * (16 * sbh + a * s * b) + 16 * sb


@pytest.mark.parametrize("kwargs,match", [
    (dict(t=3), "heads must split"), (dict(h=66), "divisible by the number of heads"),
    (dict(t=4, sequence_parallel=True, s=62), "s must be divisible"), (dict(attention="xformers"), "attention"),
    (dict(attention="flash"), "no dropout"), (dict(b=0), "b must be a positive int"),
])
def test_bad_sizes_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        layer_terms(**{"s": 64, "b": 2, "h": 64, "a": 4, **kwargs})


# -- measured, one process ---------------------------------------------------------------------------------
@functools.cache
def _serial(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return _serial_layer(*args, **kwargs)


def serial_layer(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The measurement, once per set of arguments (tests only read it)."""
    return _serial(*args, **kwargs)


def _assert_term_by_term(saved: list[dict], terms: list[Any]) -> None:
    """One new storage per term, of the term's size; for linear and attention terms, saved by the node named."""
    assert sorted(row["storage_bytes"] for row in saved if row["new"]) == sorted(x.bytes for x in terms)
    # Node names: the flash output is first saved by the kernel, then by c_proj (one storage), so compare the
    # node of the first save only.
    rows = Counter((row["saved_by"], row["storage_bytes"]) for row in saved if row["new"])
    expected = Counter((x.saved_by.split(" = ")[-1], x.bytes) for x in terms if "/" not in x.saved_by)
    assert expected - rows == Counter(), f"terms not found as saved: {expected - rows}"


@pytest.mark.parametrize("a", [1, 2])
def test_one_head_keeps_the_whole_qkv_output_alive(a: int) -> None:
    # With one head v is a view of the c_attn output, not a copy: the full 3sbh storage is what stays allocated.
    r = serial_layer(64, 2, 64, a, dropout=0.1)
    assert r["measured_bytes"] == r["adapted_bytes"]
    v = next(x for x in layer_terms(64, 2, 64, a) if x.name.startswith("v "))
    assert v.elements == (3 if a == 1 else 1) * 64 * 2 * 64

@pytest.mark.parametrize("sizes,kwargs", [
    (dict(s=64, b=2, h=64, a=4), dict(dropout=0.1)),
    (dict(s=32, b=3, h=48, a=6), dict(dropout=0.1)),
    (dict(s=64, b=2, h=64, a=4), dict(dropout=0.0)),
    (dict(s=64, b=2, h=64, a=4), dict(dropout=0.0, attention="flash")),
])
def test_serial_measurement_equals_adapted_formula(sizes: dict, kwargs: dict) -> None:
    r = serial_layer(**sizes, **kwargs)
    assert r["measured_bytes"] == r["adapted_bytes"]
    assert r["difference_bytes"] == r["measured_bytes"]  # GPT(2 layers) - GPT(1 layer): the same block
    options = dict(dropout=kwargs["dropout"] > 0, attention=kwargs.get("attention", "math"))
    _assert_term_by_term(r["saved"], layer_terms(*sizes.values(), **options))
    saved_by = {row["saved_by"].split(".")[0] for row in r["saved"]}
    if options["attention"] == "math":
        assert "SafeSoftmaxBackward0" in saved_by and ("MulBackward0" in saved_by) == options["dropout"]
    else:
        assert "ScaledDotProductFlashAttentionForCpuBackward0" in saved_by and "BmmBackward0" not in saved_by


def test_serial_ratio_to_paper_and_table() -> None:
    r = serial_layer(s=64, b=2, h=64, a=4, dropout=0.1)
    # fp32 (x2) and float dropout noise (x4) against the paper's 2-byte activations and 1-byte masks.
    assert r["measured_bytes"] / r["paper_bytes"] == pytest.approx(985088 / 442368)
    assert "serial" in table([r]) and "985,088" in table([r])
    if r["allocator_bytes"] is not None:  # glibc: the same bytes plus the graph's per-node bookkeeping
        assert r["measured_bytes"] <= r["allocator_bytes"] <= 1.05 * r["measured_bytes"], r
        assert "allocator" in table([r])


def test_run_rejects_sizes_before_launching() -> None:
    with pytest.raises(ValueError, match="heads must split"):
        run(64, 2, 64, 4, tps=(3,))
    with pytest.raises(ValueError, match="must divide it"):
        run(48, 2, 48, 12, tps=(3, 4))


# -- measured, tensor parallel (one launch per world size: both sequence-parallel modes) ----------------------
TP_SIZES = dict(s=64, b=2, h=64, a=4)  # t=4 leaves one head per rank: the whole-qkv-view case above


@functools.cache
def _tp(backend: str) -> tuple[dict[str, Any], ...]:
    # One launch of 4 processes measures t=4 and t=2 (two TP groups of 2), and at t=2 also sequence
    # parallelism without re-gathering.
    return tuple(run_workers("lslm.demos.activation_check:tp_worker", 4, backend=backend,
                             tps=[2, 4], modes=["tp", "sp", "sp-keep-gathered"], **TP_SIZES))


def _results(backend: str, t: int, rank: int = 0) -> dict[str, dict[str, Any]]:
    return {r["mode"]: r for r in _tp(backend)[rank]["results"] if r["t"] == t}


@pytest.mark.parametrize("backend", backends(4))
@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_measurement_equals_adapted_formula(t: int, backend: str) -> None:
    masks = dict(mask_bytes=4 if backend == "gloo" else 1)  # float noise on the CPU, bool masks on CUDA
    for rank in range(4):
        for mode, r in _results(backend, t, rank).items():
            sp = r["sequence_parallel"]
            assert r["measured_bytes"] == adapted_layer_bytes(*TP_SIZES.values(), t, sp, regather=r["regather"],
                                                              **masks), (rank, mode)
            assert r["paper_bytes"] == pytest.approx(korthikanti_layer_bytes(*TP_SIZES.values(), t, sp))
    for r in _results(backend, t).values():
        _assert_term_by_term(r["saved"], layer_terms(*TP_SIZES.values(), t, r["sequence_parallel"],
                                                     regather=r["regather"], **masks))
    tp, sp = _results(backend, t)["tp"], _results(backend, t)["sp"]
    serial = adapted_layer_bytes(*TP_SIZES.values(), **masks)
    # Sequence parallelism shards what tensor parallelism left replicated: everything is /t, except that a
    # single head per rank keeps its whole [q|k|v] output (3sbh/t instead of sbh/t for v).
    one_head_extra = 2 * (64 * 2 * 64) // t * 4 if TP_SIZES["a"] == t else 0
    assert sp["measured_bytes"] == serial // t + one_head_extra
    assert tp["measured_bytes"] > sp["measured_bytes"]
    if backend == "gloo" and tp["allocator_bytes"] is not None:  # glibc never reads less than the hooks count
        assert all(r["allocator_bytes"] >= r["measured_bytes"] for r in _results(backend, t).values())


@pytest.mark.parametrize("t", [2, 4])
def test_sequence_parallel_without_regather_keeps_the_gathered_inputs(t: int) -> None:
    results = _results("gloo", t)
    sbh = 64 * 2 * 64
    # The c_attn and c_fc inputs: saved whole (sbh) instead of their sequence slice (sbh/t).
    assert results["sp-keep-gathered"]["measured_bytes"] - results["sp"]["measured_bytes"] == 2 * (sbh - sbh // t) * 4
