"""lslm.plan's cp axis, pure arithmetic (no processes): traffic against lslm.context_parallel's formula, what cp
divides and what it does not, the ring's overlap verdict, the search, ``lslm plan --cp``, and notebook 10's
activation-vs-sequence table and figure. The checks against measurement (ActivationMemory and the ledger on
lslm's context-parallel GPT) are in tests/test_context_parallel.py, which reuses its launches."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from lslm.cli import main  # noqa: E402
from lslm.context_parallel import cp_traffic  # noqa: E402
from lslm.plan import Layout, ModelSpec, check_layout, estimate, hardware_presets, model_presets, search  # noqa: E402
from lslm.plan.long_context import activation_vs_sequence, format_activation_table  # noqa: E402
from lslm.plan.timing import ring_block_flops  # noqa: E402
from lslm.plot.long_context import plot_activation_vs_sequence  # noqa: E402

H100 = hardware_presets()["h100-sxm"]
GPT = ModelSpec(4, 256, 8, 1024, 512, micro_batch=2, global_batch=8, name="small gpt")


@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cp_bytes_per_layer_equal_the_context_parallel_formula(cp: int, precision: str) -> None:
    e = 4 if precision == "fp32" else 2
    t = cp_traffic(GPT.micro_batch, GPT.n_head, GPT.seq_len, GPT.head_dim, cp, element_size=e)
    m, layers = 4, GPT.n_layer  # micro-batches per step at dp = 1
    ring = estimate(GPT, Layout(cp=cp, precision=precision), H100).comm["cp"]
    assert ring.group == cp and ring.payload_bytes == m * layers * (t["ring_forward"] + t["ring_backward"])
    assert ring.wire_bytes == ring.payload_bytes  # p2p: every recorded byte leaves the rank
    uly = estimate(GPT, Layout(cp=cp, precision=precision, cp_method="ulysses"), H100).comm["cp"]
    assert uly.payload_bytes == m * layers * (t["ulysses_forward_ledger"] + t["ulysses_backward_ledger"])
    assert uly.wire_bytes == pytest.approx(m * layers * (t["ulysses_forward"] + t["ulysses_backward"]))
    # recomputation reruns the forward's ring (and Ulysses' forward all-to-alls)
    again = estimate(GPT, Layout(cp=cp, precision=precision, recompute="full"), H100).comm["cp"]
    assert again.payload_bytes == ring.payload_bytes + m * layers * t["ring_forward"]


def test_cp_divides_activations_but_not_model_states_and_reduces_gradients_over_dp_x_cp() -> None:
    one, two = (estimate(GPT, Layout(cp=c, flash_attention=True), H100) for c in (1, 2))
    assert two.memory.activations.value == one.memory.activations.value / 2  # every per-token tensor: s/cp
    assert two.memory.states.device_bytes == one.memory.states.device_bytes  # parameters replicated over cp
    ring = "context-parallel ring blocks"
    assert ring in two.memory.buffers and ring not in one.memory.buffers
    assert one.comm["dp"].collectives == () and two.comm["dp"].group == 2  # gradients summed over dp x cp
    assert two.comm["dp"].payload_bytes == 4 * one.memory.params  # one fp32 main_grad all-reduce
    # ZeRO shards over dp x cp: stage 1 at dp = 1, cp = 2 halves the optimizer states
    z1 = estimate(GPT, Layout(cp=2, zero=1), H100).memory.states.device
    assert z1["optimizer_states"].value == pytest.approx(two.memory.states.device["optimizer_states"].value / 2)
    # without flash attention the s^2 scores are kept at cp = 1 only: the ring never builds them
    assert estimate(GPT, Layout(cp=1), H100).memory.activations.value > one.memory.activations.value
    rows = {row[1]: row for row in two.table()}
    assert "cp (group 2)" in rows and "dp x cp (group 2)" in rows


@pytest.mark.parametrize("precision,e", [("fp32", 4), ("bf16", 2)])
def test_ring_blocks_count_the_dkv_accumulators_in_fp32(precision: str, e: int) -> None:
    """K/V in hand and arriving at the inputs' e bytes, the dK/dV accumulators (filled, sent, received) at 4."""
    t = cp_traffic(GPT.micro_batch, GPT.n_head, GPT.seq_len, GPT.head_dim, 4, element_size=e)
    buffers = estimate(GPT, Layout(cp=4, precision=precision), H100).memory.buffers
    assert buffers["context-parallel ring blocks"].value == 2 * 2 * t["unit_kv"] + 3 * 2 * t["unit_kv"] * 4 // e


def test_a_grouped_query_gpt_config_is_refused_not_miscounted() -> None:
    from lslm.models.gpt import GPTConfig

    assert ModelSpec.from_gpt_config(GPTConfig.tiny(n_kv_head=4)).kv_heads == 4  # = n_head: the multi-head GPT
    with pytest.raises(ValueError, match="n_kv_head = 2"):
        ModelSpec.from_gpt_config(GPTConfig.tiny(n_kv_head=2))


def test_ring_verdict_turns_compute_bound_as_tokens_per_rank_grow() -> None:
    llama = dataclasses.replace(model_presets()["llama3-8b"], global_batch=1)
    ratios, bandwidth_ratios = [], []
    for seq in (8192, 32768, 131072):
        spec = dataclasses.replace(llama, seq_len=seq)
        layout = Layout(tp=8, cp=2, sequence_parallel=True, flash_attention=True)
        est = estimate(spec, layout, H100)
        v = next(v for v in est.verdicts if v.axis == "cp")
        send = est.comm["cp"].collectives[0]
        assert v.comm_s == pytest.approx(send.time_s / send.count)
        assert v.compute_s == pytest.approx(ring_block_flops(spec, layout) / H100.flops("bf16"))
        ratios.append(v.ratio)
        bandwidth_ratios.append((v.comm_s - send.link.alpha_s) / v.compute_s)
        assert est.times["cp"].value > 0 and "exposed cp" in est.times["step"].formula
    # K/V bytes grow as s/cp, the block's flops as (s/cp)^2: a 4x longer sequence, a 4x smaller bandwidth term
    assert ratios[0] > 1 > ratios[2]
    assert bandwidth_ratios[0] / bandwidth_ratios[1] == pytest.approx(4) == bandwidth_ratios[1] / bandwidth_ratios[2]
    uly = estimate(dataclasses.replace(llama, seq_len=8192), Layout(cp=8, cp_method="ulysses"), H100)
    assert uly.times["cp"].value == pytest.approx(uly.comm["cp"].time_s)  # not overlapped


def test_layouts_cp_cannot_split_are_refused() -> None:
    with pytest.raises(ValueError, match="cp_method must be one of"):
        Layout(cp=2, cp_method="striped")
    with pytest.raises(ValueError, match="must split into 2 x cp = 8 chunks"):
        check_layout(dataclasses.replace(GPT, seq_len=12), Layout(cp=4))
    with pytest.raises(ValueError, match="8 query and 8 key/value heads per rank must be divisible by cp=16"):
        check_layout(GPT, Layout(cp=16, cp_method="ulysses"))
    llama = model_presets()["llama3-8b"]
    with pytest.raises(ValueError, match="1 key/value heads per rank must be divisible by cp=2"):
        check_layout(llama, Layout(tp=8, cp=2, cp_method="ulysses", sequence_parallel=True))


def test_search_chooses_cp_for_a_long_sequence() -> None:
    llama = dataclasses.replace(model_presets()["llama3-8b"], seq_len=262144, global_batch=1)
    options = dict(flash_attention=True, micro_batches=(1,), top=3)
    without = search(llama, H100, 32, **options)
    found = search(llama, H100, 32, context_parallel=(1, 2, 4, 8), **options)
    assert found and all(e.fits and e.layout.world == 32 for e in found)
    assert found[0].layout.cp > 1 and found[0].step_s < without[0].step_s  # cp beats a bubble-bound pipeline here
    with pytest.raises(ValueError, match="context_parallel must list ints >= 1"):
        search(llama, H100, 32, context_parallel=(0,))


def test_lslm_plan_cp_prints_the_cp_axis(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama3-8b", "--seq", "65536", "--global-batch", "1", "--devices", "16",
                 "--tp", "8", "--cp", "2", "--sp", "--flash"]) == 0
    out = capsys.readouterr().out
    assert "cp 2 (ring)" in out and "ring K/V blocks (forward)" in out and "ring dK/dV accumulators" in out
    assert "dp x cp (group 2)" in out and "context-parallel ring blocks" in out
    main(["plan", "--model", "llama3-8b", "--seq", "65536", "--global-batch", "1", "--devices", "8", "--tp", "1",
          "--cp", "8", "--cp-method", "ulysses", "--flash"])
    assert "q, k, v all-to-all (forward)" in capsys.readouterr().out


def test_activation_vs_sequence_table_and_figure() -> None:
    rows = activation_vs_sequence(seq_lens=(65536, 131072, 262144))
    by = {(r["seq_len"], r["cp"]): r for r in rows}
    for (seq, cp), r in by.items():
        assert r["devices"] == 8 * cp and r["states_bytes"] == by[(seq, 1)]["states_bytes"]
        assert r["activations_bytes"] * cp == pytest.approx(by[(seq, 1)]["activations_bytes"])
        assert r["total_bytes"] == pytest.approx(r["activations_bytes"] + r["states_bytes"] + r["other_bytes"])
    assert by[(65536, 1)]["fits"] and not by[(131072, 1)]["fits"] and by[(262144, 4)]["fits"]
    text = format_activation_table(rows)
    assert "TP+SP alone" in text and "cp=8" in text and "*" in text
    fig = plot_activation_vs_sequence(rows)
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 5 and ax.get_title() and "GB" in ax.get_ylabel() and "tokens" in ax.get_xlabel()
    plt.close(fig)
