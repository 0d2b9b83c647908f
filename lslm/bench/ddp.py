"""``lslm bench ddp``: naive, fused, bucketed, buffered and torch DDP on the same model, same data, one run.

For each world size one job is launched. In it every rank builds one model copy per
*entry* (same seed, same weights): the five variants at the same bucket size, a
``local`` entry that trains without any communication (each rank alone on its
share: the floor every variant is compared with), and the bucket-size sweep
(``bucketed``, and ``torch`` too unless ``sweep_torch=False``, at each size of
``sweep_mb``). The entries are variants of the bench runner
(:func:`lslm.harness.run_variants`): they run **round-robin**, one step each in turn,
so slow drifts of the machine hit all of them alike; every step starts after a barrier
and is timed on every rank (a :class:`~lslm.harness.StepTimer`: CUDA events on GPUs,
where NCCL runs asynchronously); a step costs what its *slowest* rank took, and we
report medians over the timed steps after ``warmup`` untimed rounds. Every entry sees
the same batch at the same step. The device is a parameter (``"cpu"``: gloo, ``"cuda"``:
NCCL); the table, ``ddp.json`` and ``ddp.png`` are written together (:class:`lslm.harness.Report`).

``buffered`` is bucketed DDP on the gradient buffer, the layout the DDP recipe trains
bucketed DDP with: :func:`~lslm.data_parallel.grad_sync.attach_grad_buffers` gives the model one fp32
buffer of ``main_grad`` views, bucketed at the same cap, and
:class:`~lslm.data_parallel.ddp.BucketedDDP` all-reduces each bucket of it in place (no
copy into bucket buffers and back). ``bucketed`` is the same wrapper on a plain model,
copying ``.grad`` in and out. Every entry steps through a
:class:`~lslm.precision.PlainOptimizer` (clip to norm 1, then AdamW), which hands the
buffered entry's ``main_grad`` to AdamW as ``.grad`` during the step.

Per step and rank: ``compute`` = forward + backward, ``exposed`` = time in
``finish_grad_sync()``, ``optimizer`` = clip + AdamW step, ``step`` = all of it.
A step's ``step`` time is its slowest rank's; ``compute``, ``exposed`` and
``optimizer`` are read on its *critical-path* rank, the one whose forward +
backward took longest: the other ranks' waits include waiting for that rank's
gradients (skew, which on an oversubscribed CPU is large), its wait does not.
(For ``torch`` the all-reduces run inside backward, so its ``compute`` includes
them and ``exposed`` is ~0; compare its *step* with the others, and with ``local``.)

**Hidden fraction** of the bucketed variant (at the common bucket size)::

    hidden = 1 - E / C

* ``E``: median over steps of the bucketed entry's exposed time (critical-path rank);
* ``C``: median over repeats of the time to all-reduce buffers of exactly its
  buckets' sizes, one after another, blocking, with nothing else running
  (barrier first, slowest rank): the communication the step would expose if it
  overlapped nothing.

``hidden = 1`` means all communication ran behind backward; ``0`` means none did
(negative: the sync took longer than communicating alone, e.g. because compute
and communication fought over the CPU cores). Its caveat: communication that
overlaps backward also slows backward down on a machine with few cores; that cost
appears in ``compute`` and in ``step - local``, not in ``E``.

**Bytes.** For the lslm variants the comm ledger (label ``"ddp-grad"``) must show,
in *every* timed step, exactly the gradient bytes (``4 x number of parameters`` in
fp32) all-reduced; ``ledger_exact`` records that. torch's C++ reducer bypasses the
ledger, so after timing a separate torch DDP copy gets a comm hook that
all-reduces each of its buckets through the ledger, and its bytes per step are
checked the same way (``torch_hook_bytes``).

The last two printed lines are the buffered / torch and (last) the bucketed / torch DDP
step-time ratios per world size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lslm.bench.checks import at_least, world_sizes
from lslm.bench.ddp_report import plot, print_table, ratio
from lslm.bench.devices import device_env
from lslm.data_parallel.ddp import GRAD_LABEL, cap_bytes
from lslm.harness import Report, StepTimer, Variant, run_variants, step_throughput
from lslm.metrics.flops import gpt_step_flops
from lslm.precision import PlainOptimizer
from lslm.runtime.startup import synchronize

__all__ = ["BENCH_MODEL", "DEFAULT_BUCKET_MB", "DEFAULT_SWEEP_MB", "QUICK_MODEL", "plot", "print_table", "ratio",
           "run", "worker"]

#: 4 blocks of width 256: 3.7 M parameters, 14.1 MiB of fp32 gradients; forward +
#: backward of 2 x 64 tokens takes ~60 ms on one core, so on gloo the all-reduce is
#: a sizeable part of the step (communication matters) and the bench stays short.
BENCH_MODEL = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=256)
QUICK_MODEL = dict(vocab_size=1024, block_size=32, n_layer=2, n_head=2, n_embd=64)
DEFAULT_BUCKET_MB = 4.0
DEFAULT_SWEEP_MB = (0.25, 1.0, 4.0, 16.0)
QUICK_SWEEP_MB = (0.25, 1.0)
MAIN_VARIANTS = ("naive", "fused", "bucketed", "buffered", "torch")
#: The entries whose every all-reduce goes through the ledger (torch's reducer does not).
LEDGER_VARIANTS = ("naive", "fused", "bucketed", "buffered")
#: The phases of a step, as spans between the marks :func:`_one_step` sets; "compute" picks the critical rank.
PHASES = {"compute": ("start", "backward_end"), "exposed": ("backward_end", "sync_end"),
          "optimizer": ("sync_end", "end")}


def _torch_hook_bytes(model_cfg: dict[str, Any], ctx: Any, bucket_cap_mb: float, batch: torch.Tensor,
                      steps: int = 3) -> list[tuple[int, int]]:
    """(bytes, all-reduce calls) per step of torch DDP's reducer, counted by routing its buckets through the ledger."""
    from lslm.data_parallel.ddp import make_ddp
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.recipes.ddp import model_loss

    torch.manual_seed(0)
    model = GPT(GPTConfig(**model_cfg)).to(ctx.device)
    ddp = make_ddp(model, ctx, variant="torch", bucket_cap_mb=bucket_cap_mb)
    ddp.use_ledger_comm_hook()  # a DDP comm hook: SUM all-reduce through ctx.comm, then divide
    ledger, out = ctx.comm.ledger, []
    x, y = batch[:, :-1], batch[:, 1:]
    for _ in range(steps):  # the first iteration uses one bucket; torch re-plans after it
        start = len(ledger.records)
        model.zero_grad(set_to_none=True)
        model_loss(ddp, x, y).backward()
        ddp.finish_grad_sync()
        synchronize(ctx.device)
        out.append((ledger.total_bytes("all_reduce", label=GRAD_LABEL, since=start),
                    ledger.calls("all_reduce", label=GRAD_LABEL, since=start)))
    return out


def _one_step(net: Any, ddp: Any, opt: PlainOptimizer, block: torch.Tensor, timer: StepTimer) -> None:
    """One training step between the timer's start and stop, marking forward, backward and sync ends.

    ``opt`` is a :class:`~lslm.precision.PlainOptimizer`: it zeroes ``.grad`` or the gradient
    buffers, whichever hold the gradients, and clips whichever it finds before AdamW's step.
    """
    from lslm.recipes.ddp import model_loss

    x, y = block[:, :-1], block[:, 1:]
    opt.zero_grad()
    loss = model_loss(ddp if ddp is not None else net, x, y)
    timer.mark("forward_end")
    loss.backward()
    timer.mark("backward_end")
    if ddp is not None:
        ddp.finish_grad_sync()
    timer.mark("sync_end")
    opt.step(1.0)  # clip to a global norm of 1, then AdamW


def _build(variant: str, model: dict[str, Any], ctx: Any, bucket_cap_mb: float,
           seed: int) -> tuple[Any, Any, PlainOptimizer]:
    """One entry's model (the same weights for every entry), its DDP wrapper (None for ``local``) and optimizer."""
    from lslm.data_parallel.ddp import make_ddp
    from lslm.data_parallel.grad_sync import attach_grad_buffers
    from lslm.models.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    net = GPT(GPTConfig(**model)).to(ctx.device)
    if variant == "buffered":  # gradients in fp32 buffers bucketed at the same cap, reduced in place
        attach_grad_buffers(net, ctx, bucket_cap_mb=bucket_cap_mb)
    kind = "bucketed" if variant == "buffered" else variant
    ddp = None if variant == "local" else make_ddp(net, ctx, variant=kind, bucket_cap_mb=bucket_cap_mb)
    return net, ddp, PlainOptimizer(net, torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False))


def _entries(bucket_cap_mb: float, sweep_mb: list[float] | None, sweep_torch: bool) -> list[tuple[str, float]]:
    entries = [(v, bucket_cap_mb) for v in MAIN_VARIANTS] + [("local", bucket_cap_mb)]
    for mb in sweep_mb or []:
        for v in ("bucketed", "torch") if sweep_torch else ("bucketed",):
            if (v, mb) not in entries:
                entries.append((v, mb))
    return entries


def worker(model: dict[str, Any], batch_per_rank: int = 2, bucket_cap_mb: float = DEFAULT_BUCKET_MB,
           sweep_mb: list[float] | None = None, sweep_torch: bool = True, steps: int = 15, warmup: int = 3,
           threads: int = 1, comm_repeats: int = 7, seed: int = 0, device: str | None = None) -> dict[str, Any]:
    """One rank of the benchmark (see the module doc); rank 0 returns the rows, the others ``{"rank"}``."""
    from torch.utils.data import DataLoader

    from lslm.data.dataset import token_blocks
    from lslm.data.sampler import make_sampler
    from lslm.runtime import init_distributed

    with init_distributed(device=device, seed=seed) as ctx:
        torch.set_num_threads(threads)
        n, dev, ledger = ctx.world_size, ctx.device, ctx.comm.ledger
        entries = _entries(bucket_cap_mb, sweep_mb, sweep_torch)

        # The same batches for every entry: step i of every entry sees batch i.
        blocks = token_blocks(model["block_size"], model["vocab_size"])
        sampler = make_sampler(blocks, "baseline", rank=ctx.rank, world_size=n, seed=seed)
        loader = iter(DataLoader(blocks, batch_size=batch_per_rank, sampler=sampler, drop_last=True))
        data = [next(loader)["input_ids"].to(dev) for _ in range(warmup + steps)]

        runs, variants = [], []
        for variant, mb in entries:
            net, ddp, opt = _build(variant, model, ctx, mb, seed)
            runs.append((variant, mb, net, ddp, opt))
            start = [0]  # the ledger's length when this entry's step began

            def run(timer: StepTimer, i: int, net: Any = net, ddp: Any = ddp, opt: Any = opt,
                    start: list[int] = start) -> None:
                start[0] = len(ledger.records)
                _one_step(net, ddp, opt, data[i], timer)

            def grad_bytes_seen(i: int, start: list[int] = start) -> int:
                return ledger.total_bytes("all_reduce", label=GRAD_LABEL, since=start[0])

            variants.append(Variant(f"{variant} {mb:g}", run, grad_bytes_seen))
        # Round-robin, barrier, slowest rank per step, phases on the rank with the longest compute.
        timings = list(run_variants(variants, steps=steps, warmup=warmup, phases=PHASES, critical="compute",
                                    device=dev, after_round=lambda _i: ledger.reset()).values())

        main_b = entries.index(("bucketed", bucket_cap_mb))
        _, _, bnet, bddp, bopt = runs[main_b]
        # The same steps from the same weights: the buffered entry must have done bucketed's arithmetic.
        fnet = runs[entries.index(("buffered", bucket_cap_mb))][2]
        buffered_diff = max((a - b).abs().max().item() for a, b in zip(fnet.parameters(), bnet.parameters()))

        # One more (untimed) step of the main bucketed entry with its timeline on, for the overlap plot.
        bddp.record_timeline = True
        bddp.reset_timeline()
        dist.barrier()
        timer = StepTimer(dev)
        timer.start()
        _one_step(bnet, bddp, bopt, data[-1], timer)
        m = timer.stop()
        timeline = {"t0": m["start"], "forward_end": m["forward_end"], "backward_end": m["backward_end"],
                    "sync_end": m["sync_end"], "step_end": m["end"], "events": list(bddp.timeline)}
        bddp.record_timeline = False

        # C: the bucketed entry's buckets all-reduced alone, one after another (same runner rules).
        numel = dict((name, p.numel()) for name, p in bnet.named_parameters())
        bufs = [torch.randn(sum(numel[nm] for nm in names), device=dev) for names in bddp.buckets]

        def comm_alone(timer: StepTimer, i: int) -> None:
            for b in bufs:
                dist.all_reduce(b)

        alone = run_variants([Variant("comm alone", comm_alone)], steps=comm_repeats, warmup=2, device=dev)
        comm_alone_s = alone["comm alone"].median()
        torch_hook = _torch_hook_bytes(model, ctx, bucket_cap_mb, data[0])

        gathered: list[Any] = [None] * n  # every rank's timeline, for the plot
        dist.all_gather_object(gathered, timeline)

        rows = []
        num_params = sum(p.numel() for p in bnet.parameters())
        flops = gpt_step_flops(bnet.config, batch_per_rank * n)  # the global batch: every rank's rows
        for (variant, mb, _net, ddp, _), t in zip(runs, timings):
            grad_bytes = int(ddp.grad_bytes) if ddp is not None else 0
            rows.append({
                "world_size": n, "variant": variant, "bucket_mb": mb,
                "num_buckets": len(ddp.buckets) if variant in LEDGER_VARIANTS else None,
                "step_ms": t.median() * 1e3, "compute_ms": t.median("compute") * 1e3,
                "exposed_ms": t.median("exposed") * 1e3, "optimizer_ms": t.median("optimizer") * 1e3,
                "step_ms_all": [x * 1e3 for x in t.total_s],
                "grad_bytes": grad_bytes, "ledger_bytes_per_step": t.extra,
                "ledger_exact": variant in LEDGER_VARIANTS and all(b == grad_bytes for b in t.extra)
                and grad_bytes == 4 * num_params,
                "throughput": step_throughput(flops, t.median(), dev, n).to_dict(),
            })
        main = rows[main_b]
        result = {
            "world_size": n, "num_parameters": num_params, "grad_bytes": 4 * num_params, "model": model,
            "batch_per_rank": batch_per_rank, "bucket_cap_mb": bucket_cap_mb, "steps": steps, "warmup": warmup,
            "threads": torch.get_num_threads(), "backend": ctx.backend, "device": str(dev), "rows": rows,
            "bucket_bytes": [4 * b.numel() for b in bufs], "comm_alone_ms": comm_alone_s * 1e3,
            "hidden_fraction": 1 - main["exposed_ms"] / (comm_alone_s * 1e3),
            "torch_hook_bytes_per_step": [b for b, _ in torch_hook],
            "torch_hook_exact": all(b == 4 * num_params for b, _ in torch_hook),
            "torch_num_buckets": torch_hook[-1][1],  # after its re-plan from the first iteration
            "buffered_vs_bucketed_max_weight_diff": buffered_diff,
            "timeline": gathered,
        }
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def run(nprocs: tuple[int, ...] = (2, 4), *, quick: bool = False, model: dict[str, Any] | None = None,
        steps: int | None = None, warmup: int | None = None, bucket_cap_mb: float = DEFAULT_BUCKET_MB,
        sweep_mb: tuple[float, ...] | None = None, sweep_torch: bool = True, threads: int = 1,
        out_dir: str | Path | None = "bench/results", timeout: float = 1200.0,
        device: str = "cpu") -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each world size on ``device``; print the table and write ``ddp.txt``
    (the printed text), ``ddp.json`` and ``ddp.png`` to ``out_dir`` (``None``: print only).

    ``quick=True``: a tiny model, 3 timed steps, a two-point sweep, for tests and
    notebooks (structure and exact bytes are meaningful, timings are not). ``model``
    overrides the GPT sizes (``GPTConfig`` fields).
    """
    from lslm.launcher.launch import launch

    for mb in (bucket_cap_mb, *(sweep_mb or ())):
        cap_bytes(mb)  # before any process starts
    nprocs = world_sizes(nprocs, 2, "data parallelism needs peers")
    if steps is not None:
        at_least("steps", steps, 1)
    if warmup is not None:
        at_least("warmup", warmup, 0)
    at_least("threads", threads, 1)
    env = device_env(device, max(nprocs))
    model = dict(model or (QUICK_MODEL if quick else BENCH_MODEL))
    steps = steps if steps is not None else (3 if quick else 15)
    warmup = warmup if warmup is not None else (1 if quick else 3)
    sweep = list(sweep_mb if sweep_mb is not None else (QUICK_SWEEP_MB if quick else DEFAULT_SWEEP_MB))
    results: dict[int, dict[str, Any]] = {}
    for n in nprocs:
        res = launch("lslm.bench.ddp:worker", nproc=n, timeout=timeout, output="none", model=model,
                     bucket_cap_mb=bucket_cap_mb, sweep_mb=sweep, sweep_torch=sweep_torch, steps=steps,
                     warmup=warmup, threads=threads, env=env)
        results[n] = res[0]
    with Report("ddp", out_dir) as report:
        print_table(results, report)
        report.write(results, plot)
        report.print("buffered / torch DDP step time: "
                     + ", ".join(f"{n} processes {ratio(r, 'buffered'):.2f}x" for n, r in results.items()))
        report.print("bucketed / torch DDP step time (target <= 1.10): "
                     + ", ".join(f"{n} processes {ratio(r):.2f}x" for n, r in results.items()))
    return results
