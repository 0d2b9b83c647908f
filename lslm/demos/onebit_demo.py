"""Launch target of notebook 10: 1-bit Adam against Adam and against itself without error feedback.

``lslm.launch("lslm.demos.onebit_demo:curves_worker", nproc=2, steps=40)`` runs
:func:`lslm.data_parallel.onebit_run.onebit_loss_curves` on every rank (the course's GPT and corpus, the same
start and data for the three runs) and returns its losses and bytes per step, identical on every rank.

The notebook reads a longer run from a committed artifact, written by this module's command line::

    python -m lslm.demos.onebit_demo --nproc 2 --steps 100 --warmup-steps 20 --out bench/results

which prints a table and writes ``onebit_adam.txt`` (what it printed, the command first), ``.json`` (every
loss and every step's bytes, the elements compressed and left frozen, how far the embedding rows of tokens unseen in the
warm-up moved) and ``.png`` (the loss curves). Losses and bytes are deterministic on gloo; no time is measured.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from lslm.data_parallel.onebit_compress import compressed_all_reduce_bus_bytes
from lslm.data_parallel.onebit_run import RUN_CONFIG, onebit_loss_curves
from lslm.harness.report import Report
from lslm.runtime.startup import init_distributed

__all__ = ["ARTIFACT", "curves_worker", "main", "plot_curves"]

ARTIFACT = "onebit_adam"


def curves_worker(**kwargs: Any) -> dict[str, Any]:
    """One rank of the job: join the world (dp = world size), run the three optimizers, return the curves."""
    with init_distributed() as ctx:
        return onebit_loss_curves(ctx, **kwargs)


def plot_curves(data: dict[str, Any], path: Path) -> None:
    """The three loss curves, the warm-up's end marked; written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=80)
    for name, losses in data["losses"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=name)
    ax.axvline(data["warmup_steps"] + 0.5, color="grey", ls="--", label="variance frozen, compression starts")
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)",
           title=f"1-bit Adam vs Adam, {data['world']} ranks, GPT of {data['numel']:,} parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Run the three optimizers on ``--nproc`` ranks and write the artifact (module doc)."""
    from lslm.launcher.launch import launch

    parser = argparse.ArgumentParser(prog="python -m lslm.demos.onebit_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for onebit_adam.{txt,json,png} (default: print only)")
    args = parser.parse_args(argv)
    if not 1 <= args.warmup_steps < args.steps:
        parser.error(f"--warmup-steps must be in [1, --steps), got {args.warmup_steps}")
    command = (f"python -m lslm.demos.onebit_demo --nproc {args.nproc} --steps {args.steps} "
               f"--warmup-steps {args.warmup_steps}" + (f" --out {args.out}" if args.out else ""))
    results = launch("lslm.demos.onebit_demo:curves_worker", nproc=args.nproc, output="none", steps=args.steps,
                     warmup_steps=args.warmup_steps)
    r0 = results[0]
    keys = ("world", "numel", "losses", "bus_bytes", "compressed_numel", "frozen_numel", "unseen_rows",
            "unseen_rows_moved")
    compressed = r0["compressed_numel"]["1-bit adam"]
    data = {"command": command, "steps": args.steps, "warmup_steps": args.warmup_steps, "model": RUN_CONFIG,
            **{k: r0[k] for k in keys}, "compressed_formula": compressed_all_reduce_bus_bytes(compressed, r0["world"])}
    with Report(ARTIFACT, args.out) as rep:
        rep.print(f"command: {command}")
        rep.print(f"GPT {RUN_CONFIG}, {r0['numel']:,} parameters, {r0['world']} ranks (gloo), {args.steps} steps, "
                  f"warm-up {args.warmup_steps} (uncompressed Adam), then 1-bit momentum")
        adam_total = sum(r0["bus_bytes"]["adam"])
        rep.print(f"{'run':<32}{'loss first':>11}{'loss last':>11}{'last 10':>9}{'bytes, last step':>24}"
                  f"{'run total':>13}{'fp32 / this':>13}")
        for name, losses in r0["losses"].items():
            sent = r0["bus_bytes"][name]
            rep.print(f"{name:<32}{losses[0]:>11.4f}{losses[-1]:>11.4f}{sum(losses[-10:]) / 10:>9.4f}"
                      f"{sent[-1]:>24,.0f}{sum(sent):>13,.0f}{adam_total / sum(sent):>12.2f}x")
        last = r0["bus_bytes"]["1-bit adam"][-1]
        rep.print(f"compression phase: {r0['bus_bytes']['adam'][-1]:,.0f} / {last:,.0f} = "
                  f"{r0['bus_bytes']['adam'][-1] / last:.2f}x fewer bytes per step (formula "
                  f"{data['compressed_formula']:,} for the {compressed:,} compressed elements); bytes are the "
                  "ledger's bus bytes of rank 0, the loss's own all-reduce left out")
        rep.print(f"frozen sqrt(v_hat) <= eps (not compressed, not updated after the warm-up): "
                  f"{r0['frozen_numel']['1-bit adam']:,} of {r0['numel']:,} elements; {r0['unseen_rows']} of "
                  f"{RUN_CONFIG['vocab_size']} token ids no rank fed in the warm-up, their embedding rows moved by "
                  "at most " + ", ".join(f"{v:.3g} ({k})" for k, v in r0["unseen_rows_moved"].items()))
        rep.write(data, plot_curves)


if __name__ == "__main__":
    main(sys.argv[1:])
