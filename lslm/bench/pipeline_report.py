"""The report of ``lslm bench pipeline`` (:mod:`lslm.bench.pipeline`): its table, its last line and its figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lslm.harness import Report, throughput_lines

__all__ = ["PAIR_NAMES", "model_line", "plot", "print_table", "ratio_line"]

#: The schedule pairs in report order (:data:`lslm.bench.pipeline.PAIRS` names them; this module stays below it).
PAIR_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "ZB-H1", "DualPipeV")


def _msg(row: dict[str, Any]) -> str:
    ms = row.get("message_in_step_ms")
    return "-" if ms is None else f"{ms:.2f}"


def print_table(results: dict[int, dict[str, Any]], report: Report | None = None) -> None:
    """One table per pipeline size: step times (ms, medians), their ratio, the bubble fractions."""
    out = report.print if report is not None else print
    for p, res in results.items():
        mod = res["model"]
        out(f"\n== p={p} ({res['backend']}, {res['threads']} thread(s)/rank): GPT {res['num_parameters']:,} params "
            f"({mod['n_layer']} layers, width {mod['n_embd']}), batch {res['batch']} x {mod['block_size']} tokens, "
            f"medians of {res['repeats']} steps ==")
        out(f"{'schedule':<16} {'m':>2} {'v':>2} {'lslm ms':>8} {'model ms':>8} {'error':>6} {'msg ms':>6} "
            f"{'model*':>7} {'error*':>6} {'outside':>7} "
            f"{'torch ms':>8} "
            f"{'lslm/torch':>10} "
            f"{'bubble meas':>11} {'sim 1:2':>7} {'sim meas':>8} {'meas/sim':>8} {'p2p KiB r0':>10} "
            f"{'loss diff':>9}")
        for r in res["rows"]:
            sim = r["bubble_simulated"]
            sim_m = r["bubble_simulated_measured_costs"]
            over = "-" if not sim_m else f"{r['bubble_measured'] / sim_m:.2f}x"
            star = r.get("model_in_step_ms")
            out(f"{r['pair']:<16} {r['m']:>2} {r['v']:>2} {r['lslm_ms']:>8.1f} {r['model_ms']:>8.1f} "
                f"{r['model_error']:>+6.0%} {_msg(r):>6} "
                f"{'-' if star is None else f'{star:.1f}':>7} "
                f"{'-' if star is None else format(r['model_in_step_error'], '+.0%'):>6} {r['outside_ms']:>7.1f} "
                f"{r['torch_ms']:>8.1f} {r['ratio']:>9.2f}x "
                f"{r['bubble_measured']:>11.1%} "
                f"{'-' if sim is None else f'{sim:.1%}':>7} {'-' if sim_m is None else f'{sim_m:.1%}':>8} {over:>8} "
                f"{r['pp_comm_bytes_rank0'] / 1024:>10.0f} {r['max_loss_diff']:>9.1e}")
        for line in throughput_lines(res["rows"], lambda r: f"lslm {r['pair']} m={r['m']}"):
            out("  " + line)
        for m, why in res["skipped"].items():
            for name, reason in why.items():
                out(f"  skipped {name} at m={m}: {reason}")
        fit = res.get("p2p_fit")
        big = max(res["rows"], key=lambda r: r["m"]) if res["rows"] else None
        where = f"; {big['model_message_ms']:.3f} ms per message at m={big['m']}" if big else ""
        out("  time model: simulator with each stage's measured F/B/I/W and " + (
            f"p2p alpha {fit['alpha_s'] * 1e6:.0f} us + S / {1 / fit['beta_s_per_byte'] / 1e9:.2f} GB/s "
            f"(lslm bench collectives' fit at {p} ranks{where})" if fit else
            "free messages (no collectives fit given)"))
    out("(times: ms, slowest rank; model ms / error: the time model's step, messages priced by the collectives' "
        "alpha-beta fit, and (model - measured) / measured; model* / error*: the same with every message priced at "
        "msg ms, the mean time a message took inside the recorded steps (both ends posted to received); outside: "
        "the recorded steps' median time outside the schedule (step - span: micro-batch copies, tied-embedding sum, "
        "loss broadcast, final waits), added to both models; "
        "bubble meas: lslm's measured timeline, 1 - busy / (p x span); sim 1:2 / sim meas: "
        "simulated with F=1, B=2, I=W=1 (= the closed forms) / with the measured F, B, I, W times; meas/sim: measured "
        "over sim meas, what messages and per-action overheads add; p2p: rank 0's activations and gradients per step)")


def _ratio_entry(res: dict[str, Any], pair: str) -> str | None:
    """``"p=2 m=8 0.97x"`` at the largest m this pair ran at, or None."""
    rows = [r for r in res["rows"] if r["pair"] == pair]
    if not rows:
        return None
    r = max(rows, key=lambda r: r["m"])
    return f"p={res['p']} m={r['m']} {r['ratio']:.2f}x"


def ratio_line(results: dict[int, dict[str, Any]]) -> str:
    """``lslm / torch pipelining step time: GPipe p=2 m=8 0.97x p=4 m=8 1.01x; 1F1B ...`` (largest m of each)."""
    parts = []
    for name in PAIR_NAMES:
        entries = [e for e in (_ratio_entry(res, name) for _, res in sorted(results.items())) if e is not None]
        parts.append(f"{name} " + (" ".join(entries) if entries else "n/a"))
    return "lslm / torch pipelining step time: " + "; ".join(parts)


def model_line(results: dict[int, dict[str, Any]], p: int = 2) -> str:
    """``time model worst |predicted - measured| / measured at p=2: 7.1% (ZB-H1 m=8) with in-step message times,
    18.0% (Interleaved1F1B m=8) with the collectives fit``, or why there is none."""
    rows = results.get(p, {}).get("rows", [])
    if not rows:
        return f"time model: no run at p={p}"
    parts = []
    for key, how in (("model_in_step_error", "with in-step message times"),
                     ("model_error", "with the collectives' alpha-beta fit")):
        have = [r for r in rows if r.get(key) is not None]
        if have:
            worst = max(have, key=lambda r: abs(r[key]))
            parts.append(f"{abs(worst[key]):.1%} ({worst['pair']} m={worst['m']}) {how}")
    return f"time model worst |predicted - measured| / measured at p={p}: " + ", ".join(parts)


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Left: step times, lslm (measured and its time model) next to torch, per schedule, p and m. Right: bubble
    fraction measured vs simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(14, 4.8), dpi=80)
    labels, ours, model, model_in, theirs, meas, sim = [], [], [], [], [], [], []
    for p, res in sorted(results.items()):
        for r in res["rows"]:
            labels.append(f"{r['pair']}\np={p} m={r['m']}")
            ours.append(r["lslm_ms"])
            model.append(r["model_ms"])
            model_in.append(r.get("model_in_step_ms") or 0.0)
            theirs.append(r["torch_ms"])
            meas.append(r["bubble_measured"])
            sim.append(r["bubble_simulated_measured_costs"] or 0.0)
    xs = range(len(labels))
    w = 0.2
    ax_t.bar([i - 1.5 * w for i in xs], ours, width=w, label="lslm, measured")
    ax_t.bar([i - 0.5 * w for i in xs], model_in, width=w, label="time model, messages at their in-step time")
    ax_t.bar([i + 0.5 * w for i in xs], model, width=w, label="time model, messages at the alpha-beta fit")
    ax_t.bar([i + 1.5 * w for i in xs], theirs, width=w, label="torch.distributed.pipelining, measured")
    ax_t.set_ylabel("ms per step (median, slowest rank)")
    ax_t.set_title("Step time: measured and predicted")
    ax_b.bar([i - 0.2 for i in xs], meas, width=0.4, label="lslm, measured")
    ax_b.bar([i + 0.2 for i in xs], sim, width=0.4, label="simulated (measured F/B/I/W costs)")
    ax_b.set_ylabel("bubble fraction")
    ax_b.set_title("Bubble: 1 - compute / (ranks x span)")
    for ax in (ax_t, ax_b):
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=90)
        ax.legend(fontsize=8)
    fig.suptitle("Pipeline parallelism: lslm's executor vs torch.distributed.pipelining, same GPT stages and data")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
