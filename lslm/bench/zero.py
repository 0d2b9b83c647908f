"""``lslm bench zero``: lslm's ZeRO stages next to torch DDP, ZeroRedundancyOptimizer and FSDP2, one run.

One job per world size (every rank data-parallel). Every rank builds the same GPT from one
seed and, in turn, each entry: torch ``DistributedDataParallel`` (the baseline), lslm's
:class:`~lslm.zero.optimizer.ZeroOptimizer` at stages 1, 2, 3, and 3 with CPU offload and with disk offload (states in
files in a temporary folder, streamed in chunks),
torch's ``ZeroRedundancyOptimizer`` over DDP (ZeRO-1 by whole parameters), FSDP2
``fully_shard`` per block then the root (ZeRO-3 by per-parameter dim-0 chunks), and FSDP2
with ``CPUOffloadPolicy(pin_memory=False)``, and DeepSpeed's ZeRO engine at stages 1, 2, 3 and 3 with the
optimizer and parameters on the host (:mod:`lslm.integrations.deepspeed_zero`; skipped, with the reason, where
DeepSpeed cannot run here). All train fp32 AdamW (``foreach=False``) on the
same tokens, each rank its share of the batch; the bench runner
(:func:`lslm.harness.run_variants`) runs them round-robin, a barrier before each step, a step
costing its slowest rank's time, medians after warm-up rounds.

Per entry and rank, also: bytes by owner after a step (parameters, gradients, fp32 masters,
optimizer states; local shards of FSDP2's DTensors; DeepSpeed's partitions by
:func:`lslm.metrics.held.held_by_owner`'s rule; torch DDP's own bucket copy of the gradients and DeepSpeed's
staging buffers are communication buffers, not counted), one step's collectives and bytes
where lslm's ledger sees them (lslm's entries: torch's and DeepSpeed's collectives bypass it; every entry's, by
kind, as torch's dispatcher sees them: :func:`~lslm.metrics.dispatched_collectives.count_collectives`), offload bytes,
and the largest loss difference from DDP over the run (rounding). The last printed line is the step-time
ratios the issue targets: stage 1 / ZeroRedundancyOptimizer, stage 3 / FSDP2 and stage 3 / DeepSpeed stage 3.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch

from lslm.bench.checks import at_least, world_sizes
from lslm.bench.devices import device_env
from lslm.harness import Report, StepTimer, Variant, run_variants, step_throughput, throughput_lines
from lslm.metrics.flops import gpt_step_flops

__all__ = ["BENCH_MODEL", "DEEPSPEED_ENTRIES", "ENTRIES", "QUICK_MODEL", "plot", "print_table", "ratios", "run",
           "worker"]

#: 6 blocks of width 192, vocabulary 2048: 3.5 M parameters (14 MB in fp32).
BENCH_MODEL = dict(vocab_size=2048, block_size=64, n_layer=6, n_head=6, n_embd=192)
BENCH_ROWS = 4  # rows per rank, 64 tokens each
QUICK_MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
QUICK_ROWS = 2
ENTRIES = ("ddp", "zero1", "zero2", "zero3", "zero3-offload", "zero3-disk", "torch-zero1", "fsdp2", "fsdp2-offload",
           "deepspeed1", "deepspeed2", "deepspeed3", "deepspeed3-offload")
#: The entries that need DeepSpeed (skipped, with the reason, where it cannot run).
DEEPSPEED_ENTRIES = tuple(e for e in ENTRIES if e.startswith("deepspeed"))
PHASES = {"forward": ("start", "forward_end"), "backward": ("forward_end", "backward_end"),
          "optimizer": ("backward_end", "end")}
MIB = 1024 * 1024
LR = 1e-3


def _groups(net: torch.nn.Module) -> list[dict[str, Any]]:
    params = [p for p in net.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _adamw(net: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(_groups(net), lr=LR, betas=(0.9, 0.95), foreach=False)


def _entry(kind: str, serial: Any, ctx: Any, rows: int) -> tuple[Any, Any, Any]:
    """(model, optimizer, step function) of one entry; ``step(timer, x, y)`` returns the loss tensor."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from lslm.zero.optimizer import ZeroOptimizer

    net = copy.deepcopy(serial).to(ctx.device)
    if kind.startswith("zero"):
        offload = "cpu" if "offload" in kind else "disk" if "disk" in kind else None
        folder = tempfile.mkdtemp(prefix="lslm-bench-zero-") if offload == "disk" else None
        opt = ZeroOptimizer(net, _adamw(net), ctx, stage=int(kind[4]), offload=offload, offload_dir=folder)

        def step(timer: StepTimer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            _, loss = net(x, y)
            timer.mark("forward_end")
            opt.backward(loss)
            timer.mark("backward_end")
            opt.step()
            return loss.detach()

        return net, opt, step
    if kind.startswith("deepspeed"):
        from lslm.integrations.deepspeed_zero import build_engine

        engine = build_engine(net, _adamw(net), int(kind[9]), rows, offload="cpu" if "offload" in kind else None)

        def ds_step(timer: StepTimer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            _, loss = engine(x, y)
            timer.mark("forward_end")
            engine.backward(loss)
            timer.mark("backward_end")
            engine.step()  # the step, then DeepSpeed zeroes the gradients itself
            return loss.detach()

        ds_step.engine = engine  # type: ignore[attr-defined]
        return engine.module, engine.optimizer, ds_step
    if kind in ("ddp", "torch-zero1"):
        module = DistributedDataParallel(net)
        opt = (_adamw(net) if kind == "ddp" else
               ZeroRedundancyOptimizer(_groups(net), optimizer_class=torch.optim.AdamW, lr=LR, betas=(0.9, 0.95),
                                       foreach=False))
    else:
        policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if "offload" in kind else {}
        for block in net.blocks:
            fully_shard(block, **policy)
        module = fully_shard(net, **policy)
        opt = _adamw(net)

    def torch_step(timer: StepTimer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        _, loss = module(x, y)
        timer.mark("forward_end")
        loss.backward()
        timer.mark("backward_end")
        opt.step()
        return loss.detach()

    return net, opt, torch_step


def _memory(net: Any, opt: Any) -> dict[str, int]:
    """Bytes by owner on this rank after a step (storages counted once; FSDP2's local shards)."""
    from lslm.metrics.held import held_by_owner

    held = held_by_owner(net, opt)
    return {"params_bytes": held["parameters"], "grads_bytes": held["gradients"],
            "masters_bytes": held["master_weights"], "optimizer_bytes": held["optimizer_states"]}


def worker(model: dict[str, Any], rows: int, entries: list[str], steps: int = 10, warmup: int = 2,
           threads: int = 1, seed: int = 0, device: str | None = None) -> dict[str, Any]:
    """One rank of the benchmark (see the module doc); rank 0 returns the rows, the others ``{"rank"}``."""
    from lslm.metrics.dispatched_collectives import count_collectives
    from lslm.metrics.memory import peak_rss_bytes
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.runtime import init_distributed
    from lslm.zero.optimizer import GATHER_LABEL, REDUCE_SCATTER_LABEL

    with init_distributed(device=device, seed=seed) as ctx:
        torch.set_num_threads(threads)
        dev, ledger, cfg = ctx.device, ctx.comm.ledger, GPTConfig(**model)
        world = ctx.world_size
        torch.manual_seed(seed)
        serial = GPT(cfg)
        g = torch.Generator().manual_seed(seed)  # the same global batches on every rank and for every entry
        data = [torch.randint(0, cfg.vocab_size, (rows * world, cfg.block_size + 1),
                              generator=g)[ctx.rank * rows:(ctx.rank + 1) * rows].to(dev)  # lslm: cpu-ok (moved)
                for _ in range(warmup + steps)]
        built, losses, variants = [], {}, []
        for kind in entries:
            net, opt, step = _entry(kind, serial, ctx, rows)
            built.append((kind, net, opt, step))
            losses[kind] = []
            last: list[Any] = [None]

            def run(timer: StepTimer, i: int, step: Any = step, last: list[Any] = last) -> None:
                last[0] = step(timer, data[i][:, :-1], data[i][:, 1:])

            def after(i: int, kind: str = kind, last: list[Any] = last) -> None:
                losses[kind].append(last[0].item())

            variants.append(Variant(kind, run, after))
        timings = run_variants(variants, steps=steps, warmup=warmup, phases=PHASES, device=dev,
                               after_round=lambda _i: ledger.reset())
        x, y = data[0][:, :-1], data[0][:, 1:]
        flops = gpt_step_flops(cfg, rows * world)  # the global batch
        out_rows = []
        for (kind, net, opt, step), t in zip(built, timings.values()):
            start = len(ledger.records)
            timer = StepTimer(dev)
            timer.start()
            with count_collectives() as seen:  # every entry's collectives, as torch's dispatcher sees them
                step(timer, x, y)  # one more step: its traffic, then the memory it leaves
            recs = ledger.records[start:]
            lslm_sees = kind.startswith("zero")
            base = losses["ddp"] if "ddp" in losses else losses[kind]
            out_rows.append({
                "entry": kind, "step_ms": t.median() * 1e3, **{f"{p}_ms": t.median(p) * 1e3 for p in PHASES},
                "step_ms_all": [s * 1e3 for s in t.total_s], "losses": losses[kind],
                "max_loss_diff_vs_ddp": max(abs(a - b) for a, b in zip(losses[kind], base)),
                "rs_bytes": sum(r.nbytes for r in recs if r.label == REDUCE_SCATTER_LABEL) if lslm_sees else None,
                "ag_bytes": sum(r.nbytes for r in recs if r.label == GATHER_LABEL) if lslm_sees else None,
                "offload_bytes": dict(opt.offload_bytes) if lslm_sees else None,
                "disk_bytes": dict(opt.disk.bytes_moved) if lslm_sees and opt.disk is not None else None,
                "collectives": seen.as_dict(),
                "throughput": step_throughput(flops, t.median(), dev, world).to_dict(),
                **_memory(net, opt)})
        result = {"world": world, "model": model, "rows_per_rank": rows, "steps": steps, "warmup": warmup,
                  "threads": torch.get_num_threads(), "backend": ctx.backend, "device": str(dev),
                  "num_parameters": sum(p.numel() for p in serial.parameters()),
                  "process_peak_rss_bytes": peak_rss_bytes(), "rows": out_rows}
        for _kind, _net, opt, step in built:
            if getattr(opt, "disk", None) is not None:
                opt.disk.close(remove=True)  # the temporary offload folder
            if hasattr(step, "engine"):
                step.engine.destroy()  # before the process group ends (a rare abort at exit otherwise)
        torch.distributed.barrier()  # DTensor users may abort at exit without one (DESIGN §10)
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def _row(result: dict[str, Any], entry: str) -> dict[str, Any] | None:
    return next((r for r in result["rows"] if r["entry"] == entry), None)


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """Median step-time ratios lslm / peer at one world size, for the pairs present."""
    out = {}
    for ours, peer in (("zero1", "torch-zero1"), ("zero3", "fsdp2"), ("zero3", "deepspeed3"),
                       ("zero3-offload", "fsdp2-offload"), ("zero3-offload", "deepspeed3-offload"),
                       ("zero1", "deepspeed1"), ("zero2", "deepspeed2"), ("zero1", "ddp"), ("zero3-disk", "zero3")):
        a, b = _row(result, ours), _row(result, peer)
        if a is not None and b is not None:
            out[f"{ours}/{peer}"] = a["step_ms"] / b["step_ms"]
    return out


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def print_table(results: dict[int, dict[str, Any]], report: Report | None = None) -> None:
    """One table per world size: times (ms, medians), memory per rank by owner (MiB), lslm's traffic per step."""
    out = report.print if report is not None else print
    for n, res in results.items():
        m = res["model"]
        psi = res["num_parameters"]
        out(f"\n== dp={n} ({res['backend']}, {res['threads']} thread(s)/rank): GPT {psi:,} params ({m['n_layer']} "
            f"layers, width {m['n_embd']}), {res['rows_per_rank']} x {m['block_size']} tokens per rank, fp32 AdamW, "
            f"medians of {res['steps']} steps ==")
        out(f"{'entry':<18} {'step ms':>8} {'fwd':>6} {'bwd':>6} {'optim':>6} {'vs DDP':>6} {'params':>7} "
            f"{'grads':>6} {'master':>6} {'optim':>6} {'B/param':>7} {'RS MiB':>6} {'AG MiB':>6} {'loss diff':>9}")
        ddp = _row(res, "ddp")
        for r in res["rows"]:
            total = r["params_bytes"] + r["grads_bytes"] + r["masters_bytes"] + r["optimizer_bytes"]
            vs = f"{r['step_ms'] / ddp['step_ms']:>5.2f}x" if ddp is not None else f"{'-':>6}"
            out(f"{r['entry']:<18} {r['step_ms']:>8.1f} {r['forward_ms']:>6.1f} {r['backward_ms']:>6.1f} "
                f"{r['optimizer_ms']:>6.1f} {vs} {_mib(r['params_bytes']):>7} {_mib(r['grads_bytes']):>6} "
                f"{_mib(r['masters_bytes']):>6} {_mib(r['optimizer_bytes']):>6} {total / psi:>7.2f} "
                f"{_mib(r['rs_bytes']):>6} {_mib(r['ag_bytes']):>6} {r['max_loss_diff_vs_ddp']:>9.1e}")
        for line in throughput_lines(res["rows"], lambda r: r["entry"]):
            out("  " + line)
        out("(times: ms, slowest rank; memory: MiB per rank after a step, by owner (FSDP2: its local shards; "
            "DeepSpeed: its partitions; torch DDP's internal gradient buckets and DeepSpeed's staging buffers not "
            "counted); B/param: model-state bytes per parameter per rank; RS/AG: one step's reduce-scatters and "
            "all-gathers as lslm's ledger counts them (lslm's entries only: torch's and DeepSpeed's collectives "
            "bypass it); process "
            f"peak RSS, all entries of the job: {res['process_peak_rss_bytes'] / MIB:.0f} MiB)")
        peers = [r for r in res["rows"] if r["entry"].startswith(("fsdp2", "deepspeed")) and r.get("collectives")]
        if peers:
            out("collectives of one step outside lslm's ledger, as torch's dispatcher sees them (calls x MiB): " +
                "; ".join(f"{r['entry']} " + ", ".join(f"{k} {c} x {_mib(b)}" for k, (c, b) in r["collectives"].items())
                          for r in peers))
        for entry, why in res.get("skipped", {}).items():
            out(f"{entry}: skipped ({why})")


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Left: step time per entry and world size. Right: model-state bytes per parameter per rank, by owner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(14, 4.8), dpi=80)
    labels, times, mems = [], [], []
    for n, res in sorted(results.items()):
        psi = res["num_parameters"]
        for r in res["rows"]:
            labels.append(f"dp={n}\n{r['entry']}")
            times.append([r[f"{p}_ms"] for p in PHASES])
            mems.append([r[k] / psi for k in ("params_bytes", "grads_bytes", "masters_bytes", "optimizer_bytes")])
    for ax, values, names, unit, title in (
            (ax_t, times, ("forward", "backward", "optimizer step"), "ms", "Step time (median, slowest rank)"),
            (ax_m, mems, ("parameters", "gradients", "fp32 masters", "optimizer states"), "bytes per parameter",
             "Model states per rank")):
        bottom = [0.0] * len(labels)
        for k, name in enumerate(names):
            vals = [max(0.0, v[k]) for v in values]
            ax.bar(range(len(labels)), vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=60)
        ax.set_ylabel(unit)
        ax.set_ylim(0, 1.3 * max(bottom))
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle("ZeRO: lslm's stages vs torch DDP, ZeroRedundancyOptimizer and FSDP2, same GPT and data (fp32 AdamW)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(nprocs: tuple[int, ...] = (2, 4), *, quick: bool = False, model: dict[str, Any] | None = None,
        rows: int | None = None, entries: tuple[str, ...] = ENTRIES, steps: int | None = None,
        warmup: int | None = None, threads: int = 1, out_dir: str | Path | None = "bench/results",
        timeout: float = 1200.0, device: str = "cpu") -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each world size on ``device``; print the table and write ``zero.txt``,
    ``zero.json`` and ``zero.png`` to ``out_dir`` (``None``: print only).

    ``quick=True``: a tiny model and 2 timed steps, for tests and notebooks (memory and counts are
    meaningful, timings are not). DeepSpeed's entries are left out, the reason printed and recorded under
    ``"skipped"``, where :func:`~lslm.integrations.deepspeed_zero.deepspeed_available` says it cannot run
    (checked, and its op compiled once into the environment's cache, here, before any rank starts).
    """
    from lslm.launcher.launch import launch

    nprocs = world_sizes(nprocs, 2, "ZeRO partitions over data-parallel peers")
    unknown = [e for e in entries if e not in ENTRIES]
    if unknown or not entries:
        raise ValueError(f"unknown entries {unknown}; choose from {ENTRIES}")
    if steps is not None:
        at_least("steps", steps, 1)
    if warmup is not None:
        at_least("warmup", warmup, 0)
    at_least("threads", threads, 1)
    model = dict(model or (QUICK_MODEL if quick else BENCH_MODEL))
    rows = at_least("rows", rows, 1) if rows is not None else (QUICK_ROWS if quick else BENCH_ROWS)
    env = device_env(device, max(nprocs))
    steps = steps if steps is not None else (2 if quick else 10)
    warmup = warmup if warmup is not None else (1 if quick else 2)
    skipped: dict[str, str] = {}
    if any(e in DEEPSPEED_ENTRIES for e in entries):
        from lslm.integrations import deepspeed_zero

        ok, why = deepspeed_zero.deepspeed_available()
        if not ok:
            skipped = {e: why for e in entries if e in DEEPSPEED_ENTRIES}
            entries = tuple(e for e in entries if e not in DEEPSPEED_ENTRIES)
            print(f"lslm bench zero: skipping {', '.join(skipped)}: {why}")
            if not entries:
                raise RuntimeError(f"nothing to run: {why}")
    results: dict[int, dict[str, Any]] = {}
    for n in nprocs:
        res = launch("lslm.bench.zero:worker", nproc=n, timeout=timeout, output="none", model=model, rows=rows,
                     entries=list(entries), steps=steps, warmup=warmup, threads=threads, env=env)
        results[n] = {**res[0], "skipped": skipped}
    with Report("zero", out_dir) as report:
        print_table(results, report)
        report.write(results, plot)
        report.print("lslm / peer step time: " + "; ".join(
            f"{pair} " + " ".join(f"p={n} {ratios(r)[pair]:.2f}x" for n, r in results.items() if pair in ratios(r))
            for pair in ratios(next(iter(results.values())))))
    return results


