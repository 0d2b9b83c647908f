"""``lslm bench cp``: ring attention (contiguous, zig-zag) and Ulysses next to full attention, side by side.

One job per context-parallel size ``cp`` (= world size). Every rank draws the same full ``q, k, v``
(``B x H x T x D``) and output gradient from one seed and keeps its slice of the sequence in the
variant's layout; the bench runner (:func:`lslm.harness.run_variants`) runs the variants round-robin,
a barrier before each, a step costing its slowest rank's time, medians after warm-up rounds:

* ``full``: causal ``F.scaled_dot_product_attention`` of the whole sequence on one process (every rank
  runs the same, so the machine is as busy as in the others), forward + backward;
* ``ring contiguous``, ``ring zigzag``: :func:`~lslm.context_parallel.ring.ring_attention` on ``T/cp``
  tokens per rank (contiguous: the last rank's queries see the whole sequence; zig-zag: every rank the
  same work, :func:`~lslm.context_parallel.layout.attention_work`);
* ``ulysses``: :func:`~lslm.context_parallel.ulysses.ulysses_attention` (all-to-all to ``H/cp`` heads of the
  whole sequence and back);
* and the same around one GPT block (``block full`` / ``block ring zigzag`` / ``block ulysses``: the block's
  projections, MLP and LayerNorms on ``T/cp`` tokens, the core swapped as
  :func:`~lslm.context_parallel.apply.apply_context_parallel` does).

Per variant and rank, from one untimed step each: the bytes this rank sent in the forward and in the
backward (the ledger: the ring's sends, Ulysses' all-to-all inputs, of which ``(cp - 1)/cp`` leave the
rank), which must equal :func:`~lslm.context_parallel.traffic.cp_traffic` exactly (``formula_equal``);
the bytes autograd saved (:class:`~lslm.metrics.activations.ActivationMemory`, the block's parameters
excluded); and the largest difference of the output from full attention's rows. Times are
meaningful only on a quiet machine (tests assert on the counts, never on times). The last line is
the step-time ratios to full attention.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lslm.bench.checks import at_least, world_sizes
from lslm.bench.devices import device_env
from lslm.harness import Report, StepTimer, Variant, run_variants

__all__ = ["BENCH_SHAPE", "QUICK_SHAPE", "VARIANTS", "plot", "print_table", "ratios", "run", "worker"]

#: 1 sequence of 1024 tokens, 8 heads of 32 (width 256): ~3 GFLOP per full-attention step, tens to a few hundred
#: ms on one CPU core; 8 heads split over Ulysses' cp = 2, 4, 8.
BENCH_SHAPE = dict(batch=1, n_head=8, seq=1024, head_dim=32)
QUICK_SHAPE = dict(batch=2, n_head=4, seq=64, head_dim=8)
#: (name, what, method, layout); method "full" is single-process attention
VARIANTS = (("full", "attention", "full", "contiguous"), ("ring contiguous", "attention", "ring", "contiguous"),
            ("ring zigzag", "attention", "ring", "zigzag"), ("ulysses", "attention", "ulysses", "contiguous"),
            ("block full", "block", "full", "contiguous"), ("block ring zigzag", "block", "ring", "zigzag"),
            ("block ulysses", "block", "ulysses", "contiguous"))
PHASES = {"forward": ("start", "forward_end"), "backward": ("forward_end", "end")}
MIB = 1024 * 1024


def _check_shape(shape: dict[str, int], nprocs: tuple[int, ...]) -> None:
    """Refuse, before any launch, a shape the layouts or Ulysses cannot split over some cp."""
    from lslm.context_parallel.layout import check_sequence
    from lslm.context_parallel.ulysses import check_heads

    for key in ("batch", "n_head", "seq", "head_dim"):
        at_least(key, shape[key], 1)
    for n in nprocs:
        check_sequence(shape["seq"], n, "zigzag")
        check_heads(shape["n_head"], n)


def worker(shape: dict[str, int], steps: int = 10, warmup: int = 2, threads: int = 1, seed: int = 0,
           device: str | None = None) -> dict[str, Any]:
    """One rank of the benchmark (module doc); rank 0 returns the rows, the others ``{"rank"}``."""
    import copy

    import torch.nn.functional as F

    from lslm.context_parallel import CPGroup, CPPlan, cp_traffic, local_positions, ring_attention, ulysses_attention
    from lslm.context_parallel.apply import ContextParallelAttention
    from lslm.metrics.activations import ActivationMemory
    from lslm.models.gpt import Block, GPTConfig
    from lslm.runtime import init_distributed

    cores = {"ring": ring_attention, "ulysses": ulysses_attention}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with init_distributed(cp=world, device=device, seed=seed) as ctx:
        torch.set_num_threads(threads)
        dev, ledger, g = ctx.device, ctx.comm.ledger, CPGroup.of(ctx)
        B, H, T, D = (shape[k] for k in ("batch", "n_head", "seq", "head_dim"))
        gen = torch.Generator().manual_seed(seed)  # the same numbers on every rank, drawn on the CPU, then moved
        q, k, v, dout = (torch.randn(B, H, T, D, generator=gen).to(dev)  # lslm: cpu-ok (seeded, then moved)
                         for _ in range(4))
        x, dy = (torch.randn(B, T, H * D, generator=gen).to(dev)  # lslm: cpu-ok (seeded, then moved)
                 for _ in range(2))
        cfg = GPTConfig(vocab_size=16, block_size=T, n_layer=1, n_head=H, n_embd=H * D)
        torch.manual_seed(seed)
        serial = Block(cfg).to(dev)
        blocks = {"full": serial}
        for method in cores:
            blocks[method] = copy.deepcopy(serial)
            blocks[method].attn = ContextParallelAttention(blocks[method].attn, g,
                                                           CPPlan(method, "zigzag" if method == "ring" else
                                                                  "contiguous"))

        def make(what: str, method: str, layout: str) -> tuple[Any, Any]:
            """(step(timer) -> output, the full-attention rows it must equal)."""
            pos = local_positions(T, g.size, g.index, layout, device=dev)
            if what == "attention":
                ins = [t if method == "full" else t.index_select(2, pos) for t in (q, k, v)]
                grad = dout if method == "full" else dout.index_select(2, pos)

                def attend(*a: torch.Tensor) -> torch.Tensor:
                    if method == "full":
                        return F.scaled_dot_product_attention(*a, is_causal=True)
                    return cores[method](*a, g, causal=True, layout=layout)
            else:
                ins = [x if method == "full" else x.index_select(1, pos)]
                grad = dy if method == "full" else dy.index_select(1, pos)
                attend = blocks[method]

            def step(timer: StepTimer) -> torch.Tensor:
                leaves = [t.detach().requires_grad_() for t in ins]
                out = attend(*leaves)
                timer.mark("forward_end")
                out.backward(grad)
                return out.detach()

            return step, (pos, 2 if what == "attention" else 1)

        built = {name: (what, method, layout, *make(what, method, layout)) for name, what, method, layout in VARIANTS}
        variants = [Variant(name, lambda timer, _i, step=b[3]: step(timer)) for name, b in built.items()]
        timings = run_variants(variants, steps=steps, warmup=warmup, phases=PHASES, device=dev,
                               after_round=lambda _i: ledger.reset())
        formula = cp_traffic(B, H, T, D, g.size)
        reference: dict[str, torch.Tensor] = {}
        rows = []
        for name, (what, method, layout, step, (pos, dim)) in built.items():
            with ActivationMemory(blocks[method] if what == "block" else None) as act:
                out, fwd_bytes, bwd_bytes = _counted_step(step, dev, ledger)  # forward counted, then backward
            if method == "full":
                reference[what] = out
            want = reference[what] if method == "full" else reference[what].index_select(dim, pos)
            fwd_formula, bwd_formula = {"full": (0, 0), "ring": (formula["ring_forward"], formula["ring_backward"]),
                                        "ulysses": (formula["ulysses_forward_ledger"],
                                                    formula["ulysses_backward_ledger"])}[method]
            leaving = (g.size - 1) / g.size if method == "ulysses" else 1  # an all-to-all keeps 1/cp at home
            t = timings[name]
            rows.append({"variant": name, "what": what, "method": method, "layout": layout,
                         "step_ms": t.median() * 1e3, **{f"{p}_ms": t.median(p) * 1e3 for p in PHASES},
                         "step_ms_all": [s * 1e3 for s in t.total_s],
                         "forward_bytes": fwd_bytes, "backward_bytes": bwd_bytes,
                         "formula_forward_bytes": fwd_formula, "formula_backward_bytes": bwd_formula,
                         "formula_equal": (fwd_bytes, bwd_bytes) == (fwd_formula, bwd_formula),
                         "wire_bytes": round((fwd_bytes + bwd_bytes) * leaving), "activation_bytes": act.bytes,
                         "max_diff_vs_full": (out - want).abs().max().item()})
        result = {"cp": g.size, "shape": shape, "steps": steps, "warmup": warmup, "threads": torch.get_num_threads(),
                  "backend": ctx.backend, "device": str(dev), "traffic_formula": formula, "rows": rows}
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def _counted_step(step: Any, dev: torch.device, ledger: Any) -> tuple[torch.Tensor, int, int]:
    """Run ``step`` once, untimed; its output and the bytes the ledger saw before and after ``forward_end``."""
    ops = ("send", "all_to_all")  # the ring's sends, Ulysses' all-to-alls (their receives are the peers' sends)
    start = len(ledger.records)
    split: list[int] = []

    class _Marker(StepTimer):
        def mark(self, name: str) -> None:
            split.append(len(ledger.records))
            super().mark(name)

    timer = _Marker(dev)
    timer.start()
    out = step(timer)
    fwd = sum(r.nbytes for r in ledger.records[start:split[0]] if r.op in ops)
    bwd = sum(r.nbytes for r in ledger.records[split[0]:] if r.op in ops)
    return out, fwd, bwd


def _row(result: dict[str, Any], variant: str) -> dict[str, Any]:
    return next(r for r in result["rows"] if r["variant"] == variant)


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """Median step time of each context-parallel variant over full attention's (attention, or block) at one cp."""
    out = {}
    for r in result["rows"]:
        if r["method"] != "full":
            base = _row(result, "full" if r["what"] == "attention" else "block full")["step_ms"]
            out[r["variant"]] = r["step_ms"] / base
    return out


def print_table(results: dict[int, dict[str, Any]], report: Report | None = None) -> None:
    """One table per cp: times (ms, medians), bytes sent per rank against the formula, saved activations (MiB)."""
    out = report.print if report is not None else print
    for n, res in results.items():
        s = res["shape"]
        out(f"\n== cp={n} ({res['backend']}, {res['threads']} thread(s)/rank): causal attention, batch {s['batch']}, "
            f"{s['n_head']} heads x {s['head_dim']}, {s['seq']} tokens ({s['seq'] // n} per rank), GPT block of "
            f"width {s['n_head'] * s['head_dim']}; medians of {res['steps']} steps ==")
        out(f"{'variant':<18} {'step ms':>8} {'fwd':>7} {'bwd':>7} {'vs full':>7} {'sent fwd':>9} {'sent bwd':>9} "
            f"{'= formula':>9} {'wire MiB':>8} {'saved MiB':>9} {'max |diff|':>10}")
        rel = ratios(res)
        for r in res["rows"]:
            vs = f"{rel[r['variant']]:.2f}x" if r["variant"] in rel else "1.00x"
            same = "yes" if r["formula_equal"] else "NO"
            out(f"{r['variant']:<18} {r['step_ms']:>8.1f} {r['forward_ms']:>7.1f} {r['backward_ms']:>7.1f} {vs:>7} "
                f"{r['forward_bytes']:>9,} {r['backward_bytes']:>9,} {same:>9} {r['wire_bytes'] / MIB:>8.3f} "
                f"{r['activation_bytes'] / MIB:>9.3f} {r['max_diff_vs_full']:>10.1e}")
    out("(times: ms, slowest rank; sent: bytes per rank the ledger recorded (ring: sends; Ulysses: all-to-all "
        "inputs), = formula: equal to lslm.context_parallel.cp_traffic; wire: what leaves the rank (Ulysses keeps "
        "1/cp at home); saved: bytes autograd keeps for backward on one rank; max |diff|: output against full "
        "attention's rows)")


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Left: step time per variant and cp. Middle: bytes sent per rank vs cp. Right: saved activations per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = sorted(results)
    fig, (ax_t, ax_b, ax_m) = plt.subplots(1, 3, figsize=(15, 4.5), dpi=80)
    names = [name for name, *_ in VARIANTS]
    width = 0.8 / len(cps)
    for i, n in enumerate(cps):
        times = [_row(results[n], name)["step_ms"] for name in names]
        ax_t.bar([j + i * width for j in range(len(names))], times, width, label=f"cp={n}")
    ax_t.set_xticks([j + width * (len(cps) - 1) / 2 for j in range(len(names))], [nm.replace(" ", "\n", 1)
                                                                                 for nm in names], fontsize=8)
    ax_t.set_ylabel("ms per forward + backward (median, slowest rank)")
    ax_t.set_title("Step time")
    ax_t.legend(fontsize=8)
    for name, style in (("ring zigzag", "o-"), ("ulysses", "s-")):
        ax_b.plot(cps, [_row(results[n], name)["wire_bytes"] / MIB for n in cps], style, label=f"{name}: measured")
    unit = {n: results[n]["traffic_formula"] for n in cps}
    ax_b.plot(cps, [(unit[n]["ring_forward"] + unit[n]["ring_backward"]) / MIB for n in cps], "k:",
              label="ring formula 2(cp-1)u + (2(cp-1) + 2cp)u")
    ax_b.plot(cps, [(unit[n]["ulysses_forward"] + unit[n]["ulysses_backward"]) / MIB for n in cps], "k--",
              label="Ulysses formula 8u(cp-1)/cp")
    ax_b.set_xticks(cps)
    ax_b.set_xlabel("cp")
    ax_b.set_ylabel("MiB leaving each rank per forward + backward")
    ax_b.set_title("Attention traffic per rank (one layer)")
    ax_b.legend(fontsize=7)
    for name, style in (("full", "kx--"), ("ring zigzag", "o-"), ("ulysses", "s-"), ("block full", "k+:"),
                        ("block ring zigzag", "o-"), ("block ulysses", "s-")):
        ax_m.plot(cps, [_row(results[n], name)["activation_bytes"] / MIB for n in cps], style, label=name)
    ax_m.set_xticks(cps)
    ax_m.set_xlabel("cp")
    ax_m.set_ylabel("MiB saved for backward per rank")
    ax_m.set_title("Activations per rank")
    ax_m.legend(fontsize=7)
    fig.suptitle("Context parallelism: ring attention and Ulysses vs full attention on one process")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(nprocs: tuple[int, ...] = (2, 4), *, quick: bool = False, shape: dict[str, int] | None = None,
        steps: int | None = None, warmup: int | None = None, threads: int = 1,
        out_dir: str | Path | None = "bench/results", timeout: float = 900.0,
        device: str = "cpu") -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each cp (= world size) on ``device``; print the table and write ``cp.txt``,
    ``cp.json`` and ``cp.png`` to ``out_dir`` (``None``: print only).

    ``quick=True``: tiny shapes and 2 timed steps, for tests (counts meaningful, timings not).
    """
    from lslm.launcher.launch import launch

    nprocs = world_sizes(nprocs, 2, "context parallelism needs peers")
    if steps is not None:
        at_least("steps", steps, 1)
    if warmup is not None:
        at_least("warmup", warmup, 0)
    at_least("threads", threads, 1)
    shape = dict(shape or (QUICK_SHAPE if quick else BENCH_SHAPE))
    _check_shape(shape, nprocs)
    env = device_env(device, max(nprocs))
    steps = steps if steps is not None else (2 if quick else 10)
    warmup = warmup if warmup is not None else (0 if quick else 2)
    results: dict[int, dict[str, Any]] = {}
    for n in nprocs:
        res = launch("lslm.bench.cp:worker", nproc=n, timeout=timeout, output="none", shape=shape, steps=steps,
                     warmup=warmup, threads=threads, env=env)
        results[n] = res[0]
    with Report("cp", out_dir) as report:
        print_table(results, report)
        report.write(results, plot)
        report.print("step time / full attention: " + "; ".join(
            f"cp={n} " + ", ".join(f"{name} {x:.2f}x" for name, x in ratios(r).items()) for n, r in results.items()))
    return results
