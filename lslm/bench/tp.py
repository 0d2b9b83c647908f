"""``lslm bench tp``: lslm's tensor-parallel GPT next to PyTorch DTensor's, same model, same data, one run.

One job per world size (``tp`` = world size). Every rank builds from one seed the lslm model
(:func:`~lslm.tensor_parallel.apply.apply_tensor_parallel`) and the DTensor one
(:func:`~lslm.tensor_parallel.dtensor_reference.parallelize_gpt`), without and (unless
``sequence_parallel=False``) with sequence parallelism; the bench runner
(:func:`lslm.harness.run_variants`) runs them round-robin on the same batches, a barrier
before each step, a step costing its slowest rank's time, medians after warm-up rounds.

A step: ``zero_grad``, forward with the vocabulary-parallel loss (lslm's
:func:`~lslm.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy`, DTensor's
``loss_parallel``), backward (lslm: then :func:`~lslm.tensor_parallel.grads.sync_tensor_parallel_grads`),
SGD with momentum (``foreach=False`` for both: the DTensor model mixes DTensor and plain
parameters). DTensor's deferred all-reduces of LayerNorm gradients (SP) fall in ``optimizer``.

Per entry and rank, also: bytes of parameters, gradients, optimizer state (local shards;
DTensor's ``wte`` gradient and momentum are whole ``V x C`` tensors on every rank), bytes
saved for backward (:class:`~lslm.metrics.activations.ActivationMemory`), peak allocated on
CUDA, one step's collectives, their buffer bytes (lslm's ledger; ``CommDebugMode`` counted the
ledger's way) and bus bytes (what each rank sends: buffer bytes times 2(t-1)/t per all-reduce, (t-1)/t per
all-gather or reduce-scatter, the nccl-tests convention, :func:`lslm.runtime.records.bus_factor`), and the
largest loss difference between the two (rounding). Peak RSS holds
every model of the job: reported once. The last line is the lslm / DTensor step-time ratio.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lslm.bench.checks import at_least, world_sizes
from lslm.bench.devices import device_env
from lslm.harness import Report, StepTimer, Variant, run_variants, step_throughput, throughput_lines
from lslm.metrics.flops import gpt_step_flops

__all__ = ["BENCH_MODEL", "QUICK_MODEL", "bus_mib", "plot", "print_table", "ratio", "run", "worker"]

#: 4 layers of width 256, 8 heads (divisible by tp = 2, 4, 8), vocabulary 1024: 3.7 M parameters.
#: 2 x 64 tokens: ~2.8 GFLOP per step in all, tens of ms per rank on one CPU core at tp = 2.
BENCH_MODEL = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=8, n_embd=256)
BENCH_BATCH = (2, 64)
QUICK_MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
QUICK_BATCH = (2, 32)
PHASES = {"forward": ("start", "forward_end"), "backward": ("forward_end", "backward_end"),
          "optimizer": ("backward_end", "end")}
MIB = 1024 * 1024


def _check_sizes(model: dict[str, Any], nprocs: tuple[int, ...], seq: int) -> None:
    """Refuse, before any launch, sizes that tensor or sequence parallelism cannot split."""
    for n in nprocs:
        for name in ("n_head", "vocab_size"):
            if model[name] % n:
                raise ValueError(f"model {name}={model[name]} does not split over tp={n}; choose tp dividing it")
        if seq % n:
            raise ValueError(f"sequence length {seq} does not split over tp={n} (sequence parallelism)")
    if seq > model["block_size"]:
        raise ValueError(f"sequence length {seq} exceeds the model's block_size={model['block_size']}")


def _entry(kind: str, sp: bool, cfg: Any, ctx: Any) -> tuple[Any, Any, Any]:
    """(model, optimizer, step function) of one entry; ``step(timer, x, y)`` returns the loss tensor."""
    from torch.distributed.tensor.parallel import loss_parallel

    from lslm.models.gpt import GPT
    from lslm.tensor_parallel.apply import apply_tensor_parallel
    from lslm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    from lslm.tensor_parallel.dtensor_reference import parallelize_gpt
    from lslm.tensor_parallel.grads import sync_tensor_parallel_grads

    torch.manual_seed(0)
    net = GPT(cfg).to(ctx.device)
    if kind == "lslm":
        net = apply_tensor_parallel(net, ctx, sequence_parallel=sp)
    else:
        net = parallelize_gpt(net, ctx, sequence_parallel=sp)
    opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9, foreach=False)

    def step(timer: StepTimer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        if kind == "lslm":
            logits, _ = net(x)
            loss = vocab_parallel_cross_entropy(logits, y, ctx, vocab_size=cfg.vocab_size)
            timer.mark("forward_end")
            loss.backward()
            sync_tensor_parallel_grads(net, ctx)
        else:
            with loss_parallel():  # the loss and its backward both read the vocabulary-sharded logits
                _, loss = net(x, y)
                timer.mark("forward_end")
                loss.backward()
            loss = loss.detach().to_local()
        timer.mark("backward_end")
        opt.step()
        return loss.detach()

    return net, opt, step


def _started(dev: torch.device) -> StepTimer:
    """A running timer for an untimed step (the step marks its phases on it)."""
    timer = StepTimer(dev)
    timer.start()
    return timer


def _memory(net: Any, opt: Any, step: Any, x: torch.Tensor, y: torch.Tensor, dev: torch.device) -> dict[str, Any]:
    """Model-state and saved-activation bytes of one entry (one untimed step), and its peak on CUDA."""
    from lslm.metrics.activations import ActivationMemory
    from lslm.metrics.memory import memory_report, reset_peak_memory
    from lslm.metrics.model_state import model_state_bytes

    reset_peak_memory(dev)
    with ActivationMemory(net) as act:
        step(_started(dev), x, y)
    states = model_state_bytes(net, opt)
    report = memory_report(dev)
    return {"params_bytes": states.params, "grads_bytes": states.grads, "optimizer_bytes": states.optimizer_states,
            "activation_bytes": act.bytes, "peak_allocated_bytes": report.peak_allocated}


def _comm(kind: str, net: Any, opt: Any, step: Any, x: torch.Tensor, y: torch.Tensor, dev: torch.device,
          ctx: Any) -> tuple[int, int, float]:
    """(collective calls, buffer bytes, bus bytes) of one step: lslm's ledger, or CommDebugMode for DTensor.

    Buffer bytes make an all-gather plus a reduce-scatter look twice an all-reduce of the same tensor; bus
    bytes (what a rank sends) count them equal, which is what the wire sees.
    """
    from lslm.runtime.records import bus_factor
    from lslm.tensor_parallel.dtensor_reference import dtensor_comm_counts

    if kind == "lslm":
        start = len(ctx.comm.ledger.records)
        step(_started(dev), x, y)
        recs = ctx.comm.ledger.records[start:]
        return len(recs), sum(r.nbytes for r in recs), sum(r.bus_bytes for r in recs)
    opt.zero_grad(set_to_none=True)
    found = dtensor_comm_counts(net, x, y, optimizer=opt)
    sized = [(op, n) for phases in found["elements"].values() for ops in phases.values()
             for op, per in ops.items() for n in per]
    # fp32 elements; every DTensor collective here runs over the whole tp group
    return len(sized), 4 * sum(n for _, n in sized), sum(4 * n * bus_factor(op, ctx.tp_size) for op, n in sized)


def _whole_model_params(cfg: Any) -> int:
    """Parameters of the whole (unsplit) model, counted on the meta device (no memory)."""
    from lslm.models.gpt import GPT

    with torch.device("meta"):
        return GPT(cfg).num_parameters()


def worker(model: dict[str, Any], batch: int, seq: int, sequence_parallel: bool = True, steps: int = 15,
           warmup: int = 3, threads: int = 1, seed: int = 0, device: str | None = None) -> dict[str, Any]:
    """One rank of the benchmark (see the module doc); rank 0 returns the rows, the others ``{"rank"}``."""
    from lslm.metrics.memory import peak_rss_bytes
    from lslm.models.gpt import GPTConfig
    from lslm.runtime import init_distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    with init_distributed(tp=world, device=device, seed=seed) as ctx:
        torch.set_num_threads(threads)
        dev, ledger, cfg = ctx.device, ctx.comm.ledger, GPTConfig(**model)
        g = torch.Generator().manual_seed(seed)  # the same tokens on every rank and for every entry
        data = [torch.randint(0, cfg.vocab_size, (batch, seq + 1),
                              generator=g).to(dev)  # lslm: cpu-ok (seeded, then moved)
                for _ in range(warmup + steps)]
        built, losses, variants = [], {}, []
        for kind, sp in [(k, sp) for sp in (False, True)[:1 + sequence_parallel] for k in ("lslm", "dtensor")]:
            net, opt, step = _entry(kind, sp, cfg, ctx)
            built.append((kind, sp, net, opt, step))
            name = f"{kind} sp={'on' if sp else 'off'}"
            losses[name] = []
            last: list[Any] = [None]

            def run(timer: StepTimer, i: int, step: Any = step, last: list[Any] = last) -> None:
                last[0] = step(timer, data[i][:, :-1], data[i][:, 1:])

            def after(i: int, name: str = name, last: list[Any] = last) -> None:
                losses[name].append(last[0].item())

            variants.append(Variant(name, run, after))
        timings = run_variants(variants, steps=steps, warmup=warmup, phases=PHASES, device=dev,
                               after_round=lambda _i: ledger.reset())
        x, y = data[0][:, :-1], data[0][:, 1:]
        flops = gpt_step_flops(cfg, batch, seq_len=seq)  # every rank of the group works on the same batch
        rows = []
        for (kind, sp, net, opt, step), (name, t) in zip(built, timings.items()):
            calls, nbytes, bus = _comm(kind, net, opt, step, x, y, dev, ctx)
            twin = f"{'dtensor' if kind == 'lslm' else 'lslm'} sp={'on' if sp else 'off'}"
            rows.append({"variant": kind, "sequence_parallel": sp, "step_ms": t.median() * 1e3,
                         **{f"{p}_ms": t.median(p) * 1e3 for p in PHASES},
                         "step_ms_all": [s * 1e3 for s in t.total_s], "losses": losses[name],
                         "max_loss_diff_vs_other": max(abs(a - b) for a, b in zip(losses[name], losses[twin])),
                         "collectives_per_step": calls, "comm_bytes_per_step": nbytes,
                         "comm_bus_bytes_per_step": bus,
                         "throughput": step_throughput(flops, t.median(), dev, ctx.world_size).to_dict(),
                         **_memory(net, opt, step, x, y, dev)})
        result = {"tp": ctx.tp_size, "model": model, "batch": batch, "seq": seq, "steps": steps, "warmup": warmup,
                  "threads": torch.get_num_threads(), "backend": ctx.backend, "device": str(dev),
                  "num_parameters": _whole_model_params(cfg), "process_peak_rss_bytes": peak_rss_bytes(), "rows": rows}
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def _row(result: dict[str, Any], variant: str, sp: bool = False) -> dict[str, Any]:
    return next(r for r in result["rows"] if r["variant"] == variant and r["sequence_parallel"] == sp)


def ratio(result: dict[str, Any], sp: bool = False) -> float:
    """Median step time of lslm over DTensor at one world size (``sp``: the sequence-parallel pair)."""
    return _row(result, "lslm", sp)["step_ms"] / _row(result, "dtensor", sp)["step_ms"]


def bus_mib(row: dict[str, Any]) -> float | None:
    """One step's bus MiB of a result row; ``None`` for a result written before the field existed."""
    bus = row.get("comm_bus_bytes_per_step")
    return None if bus is None else bus / MIB


def _bus_mib(row: dict[str, Any]) -> str:
    mib = bus_mib(row)
    return "n/a" if mib is None else f"{mib:.2f}"


def print_table(results: dict[int, dict[str, Any]], report: Report | None = None) -> None:
    """One table per world size: times (ms, medians), memory per rank (MiB) and communication per step."""
    out = report.print if report is not None else print
    for n, res in results.items():
        m = res["model"]
        out(f"\n== tp={n} ({res['backend']}, {res['threads']} thread(s)/rank): GPT {res['num_parameters']:,} params "
            f"({m['n_layer']} layers, width {m['n_embd']}, {m['n_head']} heads, vocab {m['vocab_size']}), batch "
            f"{res['batch']} x {res['seq']} tokens, medians of {res['steps']} steps ==")
        out(f"{'variant':<8} {'SP':<3} {'step ms':>8} {'fwd':>7} {'bwd':>7} {'optim':>6} {'vs DT':>6} "
            f"{'params':>7} {'grads':>6} {'optim':>6} {'saved act':>9} {'colls':>5} {'buf MiB':>7} {'bus MiB':>7} "
            f"{'loss diff':>9}")
        for r in res["rows"]:
            other = _row(res, "dtensor", r["sequence_parallel"])["step_ms"]
            out(f"{'lslm' if r['variant'] == 'lslm' else 'DTensor':<8} {'on' if r['sequence_parallel'] else 'off':<3} "
                f"{r['step_ms']:>8.1f} {r['forward_ms']:>7.1f} {r['backward_ms']:>7.1f} {r['optimizer_ms']:>6.1f} "
                f"{r['step_ms'] / other:>5.2f}x {r['params_bytes'] / MIB:>7.2f} {r['grads_bytes'] / MIB:>6.2f} "
                f"{r['optimizer_bytes'] / MIB:>6.2f} {r['activation_bytes'] / MIB:>9.2f} "
                f"{r['collectives_per_step']:>5} {r['comm_bytes_per_step'] / MIB:>7.2f} {_bus_mib(r):>7} "
                f"{r['max_loss_diff_vs_other']:>9.1e}")
        for line in throughput_lines(res["rows"], lambda r: f"{r['variant']} SP "
                                     f"{'on' if r['sequence_parallel'] else 'off'}"):
            out("  " + line)
        out("(times: ms, slowest rank, phases on it; memory: MiB per rank (params, grads, optimizer state, bytes saved "
            f"for backward); colls, buf MiB, bus MiB: one step's collectives, their buffers and what a rank sends "
            f"(2(t-1)/t per all-reduce, (t-1)/t per all-gather or reduce-scatter)"
            f"{'' if all('comm_bus_bytes_per_step' in r for r in res['rows']) else ', n/a: not in this older result'}; "
            f"process peak RSS, all models of the job: "
            f"{res['process_peak_rss_bytes'] / MIB:.0f} MiB)")


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Left: step time per entry and world size, split into phases. Right: memory per rank by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.5), dpi=80)
    labels, times, mems = [], [], []
    for n, res in sorted(results.items()):
        for r in res["rows"]:
            labels.append(f"tp={n}\n{'lslm' if r['variant'] == 'lslm' else 'DTensor'}"
                          f"{' SP' if r['sequence_parallel'] else ''}")
            times.append([r[f"{p}_ms"] for p in PHASES])
            mems.append([r[k] / MIB for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes")])
    for ax, values, names, unit, title in (
            (ax_t, times, ("forward + loss", "backward (+ grad sync)", "optimizer step"), "ms",
             "Step time (median, slowest rank)"),
            (ax_m, mems, ("parameters", "gradients", "optimizer state", "saved activations"), "MiB",
             "Memory per rank")):
        bottom = [0.0] * len(labels)
        for k, name in enumerate(names):
            vals = [max(0.0, v[k]) for v in values]
            ax.bar(range(len(labels)), vals, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel(unit)
        ax.set_ylim(0, 1.3 * max(bottom))  # room for the legend above the bars
        ax.set_title(title)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle("Tensor parallelism: lslm (explicit f/g layers) vs PyTorch DTensor, same GPT and data")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(nprocs: tuple[int, ...] = (2, 4), *, quick: bool = False, model: dict[str, Any] | None = None,
        batch: int | None = None, seq: int | None = None, sequence_parallel: bool = True, steps: int | None = None,
        warmup: int | None = None, threads: int = 1, out_dir: str | Path | None = "bench/results",
        timeout: float = 1200.0, device: str = "cpu") -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each world size (= tp) on ``device``; print the table and write ``tp.txt``,
    ``tp.json`` and ``tp.png`` to ``out_dir`` (``None``: print only).

    ``quick=True``: a tiny model and 3 timed steps, for tests and notebooks (structure,
    memory and counts are meaningful, timings are not). ``model`` overrides the GPT sizes.
    """
    from lslm.launcher.launch import launch

    nprocs = world_sizes(nprocs, 2, "tensor parallelism needs peers")
    if steps is not None:
        at_least("steps", steps, 1)
    if warmup is not None:
        at_least("warmup", warmup, 0)
    at_least("threads", threads, 1)
    model = dict(model or (QUICK_MODEL if quick else BENCH_MODEL))
    batch = at_least("batch", batch, 1) if batch is not None else (QUICK_BATCH if quick else BENCH_BATCH)[0]
    seq = at_least("seq", seq, 1) if seq is not None else (QUICK_BATCH if quick else BENCH_BATCH)[1]
    _check_sizes(model, nprocs, seq)
    env = device_env(device, max(nprocs))
    steps = steps if steps is not None else (3 if quick else 15)
    warmup = warmup if warmup is not None else (1 if quick else 3)
    results: dict[int, dict[str, Any]] = {}
    for n in nprocs:
        res = launch("lslm.bench.tp:worker", nproc=n, timeout=timeout, output="none", model=model, batch=batch,
                     seq=seq, sequence_parallel=sequence_parallel, steps=steps, warmup=warmup, threads=threads,
                     env=env)
        results[n] = res[0]
    with Report("tp", out_dir) as report:
        print_table(results, report)
        if sequence_parallel:
            report.print("lslm / DTensor TP step time with sequence parallelism: "
                         + ", ".join(f"tp={n} {ratio(r, sp=True):.2f}x" for n, r in results.items()))
        report.write(results, plot)
        report.print("lslm / DTensor TP step time: " + ", ".join(f"tp={n} {ratio(r):.2f}x" for n, r in results.items()))
    return results
