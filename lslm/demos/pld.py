"""Progressive layer dropping measured (notebook 10): a small deep GPT on the course corpus, with and without PLD.

``pld_run()`` trains two copies of one model from the same start on the same batches - the baseline and
:func:`~lslm.layer_drop.apply_progressive_layer_drop` with ``theta_bar = 0.5`` and a decay spanning the run -
**interleaved step by step**, so that both see the same load on a shared machine, and returns per step the
training loss, the time of the step (forward + backward + optimizer, :class:`~lslm.harness.StepTimer`) and the
blocks run, and every ``eval_every`` steps the held-out loss of the whole model (``eval()``: every block).
Evaluation time is not counted in the wall-clock axis. ``summary`` gives time per step (median, after the
first steps), the blocks run, and the tokens and training seconds each run needed to reach a target held-out
loss (by default the higher of the two final losses, so that both reach it).

Command line (the committed ``bench/results/pld.{txt,json,png}``)::

    python -m lslm.demos.pld --out bench/results/pld

The learning rate is the same for both runs (the paper also raises it with PLD; not done here), and the model
is tiny and on CPU: what is measured is this model on this machine, not the paper's BERT on GPUs.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from lslm.data.dataset import batches, token_blocks
from lslm.harness import Report, StepTimer
from lslm.layer_drop import PLDSchedule, apply_progressive_layer_drop
from lslm.models.gpt import GPT, GPTConfig
from lslm.plot.pld import plot_pld_curves

__all__ = ["RUN_CONFIG", "main", "pld_run", "summarize_runs"]

#: Deep and narrow, so that the blocks are most of the step (the embedding and head are small).
RUN_CONFIG = dict(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=64)
RUNS = ("baseline", "pld")


def _held_out_loss(model: torch.nn.Module, held: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with torch.no_grad():
        loss = sum(model(x, y)[1].item() for x, y in held) / len(held)
    model.train()
    return loss


def _first_reaching(evals: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((e for e in evals if e["loss"] <= target), None)


def summarize_runs(data: dict[str, Any], target: float | None = None, skip: int = 5) -> dict[str, Any]:
    """Time per step (median over steps after the first ``skip``), blocks run, and tokens / training seconds
    to the ``target`` held-out loss (default: the higher of the two final ones) per run, and PLD's ratios."""
    runs = data["runs"]
    if target is None:
        target = max(runs[name]["evals"][-1]["loss"] for name in RUNS)
    out: dict[str, Any] = {"target_loss": target}
    for name in RUNS:
        steps = runs[name]["steps"]
        hit = _first_reaching(runs[name]["evals"], target)
        out[name] = {"step_ms": 1e3 * statistics.median(s["step_s"] for s in steps[skip:]),
                     "blocks_per_step": sum(s["blocks"] for s in steps) / len(steps),
                     "final_loss": runs[name]["evals"][-1]["loss"],
                     "tokens_to_target": hit["tokens"] if hit else None,
                     "seconds_to_target": hit["wall_s"] if hit else None}
    b, p = out["baseline"], out["pld"]
    out["step_time_ratio"] = p["step_ms"] / b["step_ms"]
    out["blocks_ratio"] = p["blocks_per_step"] / b["blocks_per_step"]
    both = b["tokens_to_target"] and p["tokens_to_target"]
    out["tokens_ratio"] = p["tokens_to_target"] / b["tokens_to_target"] if both else None
    out["seconds_ratio"] = p["seconds_to_target"] / b["seconds_to_target"] if both else None
    return out


def pld_run(*, steps: int = 200, batch_size: int = 16, lr: float = 3e-3, theta_bar: float = 0.5,
            remaining: float = 0.05, eval_every: int = 20, eval_batches: int = 4, seed: int = 0,
            device: str | torch.device = "cpu", threads: int = 0) -> dict[str, Any]:
    """Baseline and PLD, interleaved step by step from the same start and batches (module doc); the records.

    Returns ``config``, ``schedule`` (``theta_bar``, ``gamma``), ``tokens_per_step`` and ``runs[name]`` with
    ``steps`` (``step``, ``tokens``, ``loss``, ``step_s``, ``wall_s``, ``blocks``, ``theta``) and ``evals``
    (``step``, ``tokens``, ``wall_s``, ``loss``), ``name`` in ``("baseline", "pld")``.
    """
    if threads:
        torch.set_num_threads(threads)
    device = torch.device(device)
    cfg = GPTConfig(**RUN_CONFIG)
    blocks = token_blocks(cfg.block_size, cfg.vocab_size)
    n_held = eval_batches * batch_size
    held = list(batches(blocks.select(range(len(blocks) - n_held, len(blocks))), batch_size, shuffle=False))
    held = [(x.to(device), y.to(device)) for x, y in held]
    train = blocks.select(range(len(blocks) - n_held))
    schedule = PLDSchedule.spanning(steps, theta_bar=theta_bar, remaining=remaining)
    torch.manual_seed(seed)
    start = GPT(cfg).to(device)
    models = {name: copy.deepcopy(start) for name in RUNS}
    pld = apply_progressive_layer_drop(models["pld"], schedule, generator=torch.Generator().manual_seed(seed))
    opts = {name: torch.optim.AdamW(m.parameters(), lr=lr) for name, m in models.items()}
    tokens_per_step = batch_size * cfg.block_size
    runs: dict[str, Any] = {name: {"steps": [], "evals": []} for name in RUNS}
    wall = dict.fromkeys(RUNS, 0.0)

    def stream() -> Any:
        epoch = 0
        while True:
            yield from batches(train, batch_size, seed=seed, epoch=epoch)
            epoch += 1

    data = stream()
    first = _held_out_loss(start, held)  # the common starting point
    for name in RUNS:
        runs[name]["evals"].append({"step": -1, "tokens": 0, "wall_s": 0.0, "loss": first})
    for step in range(steps):
        x, y = (t.to(device) for t in next(data))
        for name in (RUNS if step % 2 == 0 else RUNS[::-1]):  # alternate who goes first
            model, opt = models[name], opts[name]
            theta = pld.theta if name == "pld" else 1.0
            timer = StepTimer(device)
            timer.start()
            opt.zero_grad()
            loss = model(x, y)[1]
            loss.backward()
            opt.step()
            step_s = timer.stop().total
            wall[name] += step_s
            ran = sum(pld.mask) if name == "pld" else cfg.n_layer
            if name == "pld":
                pld.step()
            runs[name]["steps"].append({"step": step, "tokens": (step + 1) * tokens_per_step, "loss": loss.item(),
                                        "step_s": step_s, "wall_s": wall[name], "blocks": ran, "theta": theta})
            if (step + 1) % eval_every == 0 or step == steps - 1:
                runs[name]["evals"].append({"step": step, "tokens": (step + 1) * tokens_per_step,
                                            "wall_s": wall[name], "loss": _held_out_loss(model, held)})
    return {"config": dict(RUN_CONFIG, batch_size=batch_size, lr=lr, steps=steps, seed=seed,
                           eval_batches=eval_batches, device=str(device)),
            "schedule": {"theta_bar": schedule.theta_bar, "gamma": schedule.gamma},
            "tokens_per_step": tokens_per_step, "runs": runs}


def _fmt(value: float | None, spec: str) -> str:
    return "not reached" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m lslm.demos.pld --out bench/results/pld``: run, print the table, write ``.txt/.json/.png``."""
    parser = argparse.ArgumentParser(prog="python -m lslm.demos.pld", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="path prefix of the results, e.g. bench/results/pld")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ns = parser.parse_args(argv)
    if ns.steps < 2:
        parser.error(f"--steps must be >= 2, got {ns.steps}")
    out = Path(ns.out) if ns.out else None
    command = " ".join(["python -m lslm.demos.pld", *(sys.argv[1:] if argv is None else argv)])
    with Report(out.name if out else "pld", out.parent if out else None) as report:
        report.print(f"command: {command}")
        load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        data = pld_run(steps=ns.steps, threads=ns.threads)
        s = summarize_runs(data)
        load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        data.update(summary=s, command=command, load_average_1min=[load_before, load_after],
                    cpu_count=os.cpu_count())
        c, sch = data["config"], data["schedule"]
        report.print(f"progressive layer dropping: GPT {c['n_layer']} layers x width {c['n_embd']}, "
                     f"{data['tokens_per_step']} tokens/step, {c['steps']} steps, AdamW lr {c['lr']}, "
                     f"theta_bar {sch['theta_bar']}, gamma {sch['gamma']:.4g}, torch threads {torch.get_num_threads()}")
        report.print(f"{'run':<10}{'ms/step':>9}{'blocks/step':>13}{'final loss':>12}"
                     f"{'tokens to target':>18}{'s to target':>13}")
        for name in RUNS:
            r = s[name]
            report.print(f"{name:<10}{r['step_ms']:>9.1f}{r['blocks_per_step']:>13.2f}{r['final_loss']:>12.3f}"
                         f"{_fmt(r['tokens_to_target'], ',d'):>18}{_fmt(r['seconds_to_target'], '.1f'):>13}")
        report.print(f"target held-out loss {s['target_loss']:.3f}; PLD / baseline: time per step "
                     f"{s['step_time_ratio']:.2f}, blocks run {s['blocks_ratio']:.2f}, tokens to target "
                     f"{_fmt(s['tokens_ratio'], '.2f')}, training seconds to target {_fmt(s['seconds_ratio'], '.2f')}")
        def plot(d: dict[str, Any], path: Path) -> None:
            plot_pld_curves(d).savefig(path)

        if load_before is not None:
            report.print(f"machine: {os.cpu_count()} CPUs, 1-minute load average {load_before:.1f} before and "
                         f"{load_after:.1f} after (times on a busy machine are approximate; the runs are interleaved "
                         "step by step, so both see the same load)")
        report.write(data, plot)
    return data


if __name__ == "__main__":
    main()
