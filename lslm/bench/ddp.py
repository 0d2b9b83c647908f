"""``lslm bench ddp``: naive, fused, bucketed and torch DDP on the same model, same data, one run.

For each world size one job is launched. In it every rank builds one model copy per
*entry* (same seed, same weights): the four variants at the same bucket size, a
``local`` entry that trains without any communication (each rank alone on its
share: the floor every variant is compared with), and the bucket-size sweep
(``bucketed``, and ``torch`` too unless ``sweep_torch=False``, at each size of
``sweep_mb``). Entries run **round-robin**, one step each in turn, so slow drifts of
the machine hit all of them alike; every step starts after a barrier and is timed
on every rank; a step costs what its *slowest* rank took (all-reduce MAX), and we
report medians over the timed steps after ``warmup`` untimed rounds. Every entry
sees the same batch at the same step.

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

The last printed line is the bucketed / torch DDP step-time ratio per world size.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lslm.bench.results import write_results
from lslm.data_parallel.ddp import GRAD_LABEL, cap_bytes
from lslm.runtime.startup import synchronize

MIB = 1024 * 1024
#: 4 blocks of width 256: 3.7 M parameters, 14.1 MiB of fp32 gradients; forward +
#: backward of 2 x 64 tokens takes ~60 ms on one core, so on gloo the all-reduce is
#: a sizeable part of the step (communication matters) and the bench stays short.
BENCH_MODEL = dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=256)
QUICK_MODEL = dict(vocab_size=1024, block_size=32, n_layer=2, n_head=2, n_embd=64)
DEFAULT_BUCKET_MB = 4.0
DEFAULT_SWEEP_MB = (0.25, 1.0, 4.0, 16.0)
QUICK_SWEEP_MB = (0.25, 1.0)
MAIN_VARIANTS = ("naive", "fused", "bucketed", "torch")


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


def _critical_path(every: torch.Tensor) -> torch.Tensor:
    """``every[rank, entry, step, (step, compute, exposed, optimizer)]`` -> ``[entry, step, 4]``.

    Step time: the slowest rank's. Compute, exposed and optimizer: those of the rank
    whose forward + backward took longest (the last to reach the all-reduces): its
    wait is communication, not waiting for slower peers.
    """
    crit = every[..., 1].argmax(dim=0)  # [entry, step]
    out = torch.gather(every, 0, crit[None, ..., None].expand(1, *crit.shape, 4))[0]
    out[..., 0] = every[..., 0].amax(dim=0)
    return out


def worker(model: dict[str, Any], batch_per_rank: int = 2, bucket_cap_mb: float = DEFAULT_BUCKET_MB,
           sweep_mb: list[float] | None = None, sweep_torch: bool = True, steps: int = 15, warmup: int = 3,
           threads: int = 1, comm_repeats: int = 7, seed: int = 0) -> dict[str, Any]:
    """One rank of the benchmark (see the module doc); rank 0 returns the rows, the others ``{"rank"}``."""
    from torch.utils.data import DataLoader

    from lslm.data.dataset import token_blocks
    from lslm.data.sampler import make_sampler
    from lslm.data_parallel.ddp import make_ddp
    from lslm.models.gpt import GPT, GPTConfig
    from lslm.recipes.ddp import model_loss
    from lslm.runtime import init_distributed

    with init_distributed(seed=seed) as ctx:
        torch.set_num_threads(threads)
        n, dev = ctx.world_size, ctx.device
        entries: list[tuple[str, float]] = [(v, bucket_cap_mb) for v in MAIN_VARIANTS] + [("local", bucket_cap_mb)]
        for mb in sweep_mb or []:
            for v in ("bucketed", "torch") if sweep_torch else ("bucketed",):
                if (v, mb) not in entries:
                    entries.append((v, mb))

        # The same batches for every entry: step i of every entry sees batch i.
        blocks = token_blocks(model["block_size"], model["vocab_size"])
        sampler = make_sampler(blocks, "baseline", rank=ctx.rank, world_size=n, seed=seed)
        loader = iter(DataLoader(blocks, batch_size=batch_per_rank, sampler=sampler, drop_last=True))
        data = [next(loader)["input_ids"].to(dev) for _ in range(warmup + steps)]

        runs = []
        for variant, mb in entries:
            torch.manual_seed(seed)
            net = GPT(GPTConfig(**model)).to(dev)
            ddp = None if variant == "local" else make_ddp(net, ctx, variant=variant, bucket_cap_mb=mb)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=False)
            runs.append((variant, mb, net, ddp, opt))

        def one_step(net: Any, ddp: Any, opt: Any, block: torch.Tensor) -> dict[str, float]:
            x, y = block[:, :-1], block[:, 1:]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = model_loss(ddp if ddp is not None else net, x, y)
            tf = time.perf_counter()
            loss.backward()
            synchronize(dev)
            t1 = time.perf_counter()
            if ddp is not None:
                ddp.finish_grad_sync()
            synchronize(dev)
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            synchronize(dev)
            return {"t0": t0, "forward_end": tf, "backward_end": t1, "sync_end": t2, "step_end": time.perf_counter()}

        ledger = ctx.comm.ledger
        times = torch.zeros(len(entries), steps, 4, dtype=torch.float64)  # step, compute, exposed, optimizer
        grad_bytes_seen = [[0] * steps for _ in entries]
        for it in range(warmup + steps):
            for e, (_variant, _mb, net, ddp, opt) in enumerate(runs):
                start = len(ledger.records)
                m = one_step(net, ddp, opt, data[it])
                if it >= warmup:
                    s = it - warmup
                    times[e, s] = torch.tensor([m["step_end"] - m["t0"], m["backward_end"] - m["t0"],
                                                m["sync_end"] - m["backward_end"], m["step_end"] - m["sync_end"]],
                                               dtype=torch.float64)
                    grad_bytes_seen[e][s] = ledger.total_bytes("all_reduce", label=GRAD_LABEL, since=start)
            ledger.reset()  # keep the ledger small; every step was counted above

        # One more (untimed) step of the main bucketed entry with its timeline on, for the overlap plot.
        main_b = entries.index(("bucketed", bucket_cap_mb))
        _, _, bnet, bddp, bopt = runs[main_b]
        bddp.record_timeline = True
        bddp.reset_timeline()
        timeline = {**one_step(bnet, bddp, bopt, data[-1]), "events": list(bddp.timeline)}
        bddp.record_timeline = False

        # Every rank's times to every rank, then per step: the step costs what its slowest rank
        # took; the split is read on the critical-path rank (the one with the longest compute).
        every = [torch.empty_like(times) for _ in range(n)]
        dist.all_gather(every, times)
        times = _critical_path(torch.stack(every))

        # C: the bucketed entry's buckets all-reduced alone, one after another.
        numel = dict((name, p.numel()) for name, p in bnet.named_parameters())
        bufs = [torch.randn(sum(numel[nm] for nm in names), device=dev) for names in bddp.buckets]
        comm_t = torch.zeros(comm_repeats, dtype=torch.float64)
        for _ in range(2):  # warm-up
            for b in bufs:
                dist.all_reduce(b)
        for i in range(comm_repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for b in bufs:
                dist.all_reduce(b)
            synchronize(dev)
            comm_t[i] = time.perf_counter() - t0
        dist.all_reduce(comm_t, op=dist.ReduceOp.MAX)
        torch_hook = _torch_hook_bytes(model, ctx, bucket_cap_mb, data[0])

        gathered: list[Any] = [None] * n  # every rank's timeline, for the plot
        dist.all_gather_object(gathered, timeline)

        rows = []
        num_params = sum(p.numel() for p in bnet.parameters())
        for e, (variant, mb, _net, ddp, _) in enumerate(runs):
            med = [statistics.median(times[e, :, k].tolist()) for k in range(4)]
            seen = grad_bytes_seen[e]
            grad_bytes = int(ddp.grad_bytes) if ddp is not None else 0
            rows.append({
                "world_size": n, "variant": variant, "bucket_mb": mb,
                "num_buckets": len(ddp.buckets) if variant in ("naive", "fused", "bucketed") else None,
                "step_ms": med[0] * 1e3, "compute_ms": med[1] * 1e3, "exposed_ms": med[2] * 1e3,
                "optimizer_ms": med[3] * 1e3, "step_ms_all": (times[e, :, 0] * 1e3).tolist(),
                "grad_bytes": grad_bytes, "ledger_bytes_per_step": seen,
                "ledger_exact": variant in ("naive", "fused", "bucketed") and all(b == grad_bytes for b in seen)
                and grad_bytes == 4 * num_params,
            })
        comm_alone = statistics.median(comm_t.tolist())
        main = rows[main_b]
        result = {
            "world_size": n, "num_parameters": num_params, "grad_bytes": 4 * num_params, "model": model,
            "batch_per_rank": batch_per_rank, "bucket_cap_mb": bucket_cap_mb, "steps": steps, "warmup": warmup,
            "threads": torch.get_num_threads(), "rows": rows,
            "bucket_bytes": [4 * b.numel() for b in bufs], "comm_alone_ms": comm_alone * 1e3,
            "hidden_fraction": 1 - main["exposed_ms"] / (comm_alone * 1e3),
            "torch_hook_bytes_per_step": [b for b, _ in torch_hook],
            "torch_hook_exact": all(b == 4 * num_params for b, _ in torch_hook),
            "torch_num_buckets": torch_hook[-1][1],  # after its re-plan from the first iteration
            "timeline": gathered,
        }
    return {"rank": ctx.rank, **(result if ctx.rank == 0 else {})}


def _row(rows: list[dict[str, Any]], variant: str, mb: float) -> dict[str, Any]:
    return next(r for r in rows if r["variant"] == variant and r["bucket_mb"] == mb)


def ratio(result: dict[str, Any], a: str = "bucketed", b: str = "torch") -> float:
    """Median step time of variant ``a`` over ``b`` at the common bucket size."""
    mb = result["bucket_cap_mb"]
    return _row(result["rows"], a, mb)["step_ms"] / _row(result["rows"], b, mb)["step_ms"]


def print_table(results: dict[int, dict[str, Any]]) -> None:
    """The main comparison, the sweep and the hidden fraction, per world size."""
    for n, res in results.items():
        mb = res["bucket_cap_mb"]
        local = _row(res["rows"], "local", mb)["step_ms"]
        print(f"\n== {n} processes (gloo, {res['threads']} thread(s)/rank): GPT {res['num_parameters']:,} params, "
              f"{res['grad_bytes'] / MIB:.1f} MiB of gradients, {res['batch_per_rank']} x "
              f"{res['model']['block_size']} tokens per rank, medians of {res['steps']} steps ==")
        print(f"{'variant':<9} {'bucket MiB':>10} {'buckets':>7} {'step ms':>8} {'compute':>8} {'exposed':>8} "
              f"{'optim':>6} {'vs local':>8} {'vs torch':>8}  ledger bytes/step")
        torch_ms = _row(res["rows"], "torch", mb)["step_ms"]
        for r in res["rows"]:
            if r["bucket_mb"] != mb:
                continue
            if r["variant"] in ("naive", "fused", "bucketed"):
                led = f"{r['ledger_bytes_per_step'][0]:,} = grads {r['ledger_exact']}"
            elif r["variant"] == "torch":
                led = (f"{res['torch_hook_bytes_per_step'][0]:,} = grads {res['torch_hook_exact']} "
                       "(comm-hook copy)")
            else:
                led = "no communication"
            nb = res["torch_num_buckets"] if r["variant"] == "torch" else r["num_buckets"]
            print(f"{r['variant']:<9} {r['bucket_mb']:>10g} {'-' if nb is None else nb:>7} {r['step_ms']:>8.1f} "
                  f"{r['compute_ms']:>8.1f} {r['exposed_ms']:>8.1f} {r['optimizer_ms']:>6.1f} "
                  f"{r['step_ms'] / local:>7.2f}x {r['step_ms'] / torch_ms:>7.2f}x  {led}")
        print(f"bucket-size sweep: {'bucket MiB':>10} {'buckets':>7} {'bucketed ms':>11} {'torch ms':>9} "
              f"{'ratio':>6}")
        for m in sorted({r["bucket_mb"] for r in res["rows"] if r["variant"] == "bucketed"}):
            b = _row(res["rows"], "bucketed", m)
            t = next((r for r in res["rows"] if r["variant"] == "torch" and r["bucket_mb"] == m), None)
            tail = f"{t['step_ms']:>9.1f} {b['step_ms'] / t['step_ms']:>5.2f}x" if t else f"{'-':>9} {'-':>6}"
            print(f"{'':<18} {m:>10g} {b['num_buckets']:>7} {b['step_ms']:>11.1f} {tail}")
        naive = _row(res["rows"], "naive", mb)["step_ms"]
        buck = _row(res["rows"], "bucketed", mb)["step_ms"]
        exposed = _row(res["rows"], "bucketed", mb)["exposed_ms"]
        print(f"hidden fraction (bucketed, {mb:g} MiB buckets): 1 - exposed {exposed:.1f} ms"
              f" / all-reduce alone {res['comm_alone_ms']:.1f} ms = {res['hidden_fraction']:.2f}; "
              f"bucketed is {naive / buck:.2f}x faster than naive ({naive - buck:.1f} ms per step)")


def plot(results: dict[int, dict[str, Any]], path: Path) -> None:
    """Step-time breakdown per variant, the bucket sweep and the rank timelines, one row per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lslm.plot.ddp import plot_bucket_sweep, plot_step_breakdown, plot_timeline

    worlds = sorted(results)
    fig, axes = plt.subplots(len(worlds), 3, figsize=(16, 4.2 * len(worlds)), dpi=80, squeeze=False)
    for row, n in zip(axes, worlds):
        plot_step_breakdown(results[n], ax=row[0])
        plot_bucket_sweep(results[n], ax=row[1])
        plot_timeline(results[n]["timeline"], ax=row[2],
                      title=f"bucketed, {results[n]['bucket_cap_mb']:g} MiB buckets, {n} processes: one step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(nprocs: tuple[int, ...] = (2, 4), *, quick: bool = False, model: dict[str, Any] | None = None,
        steps: int | None = None,
        warmup: int | None = None, bucket_cap_mb: float = DEFAULT_BUCKET_MB,
        sweep_mb: tuple[float, ...] | None = None, sweep_torch: bool = True, threads: int = 1,
        out_dir: str | Path | None = "bench/results", timeout: float = 1200.0) -> dict[int, dict[str, Any]]:
    """Launch the benchmark at each world size, print the table, write ``ddp.json`` + ``ddp.png``.

    ``quick=True``: a tiny model, 3 timed steps, a two-point sweep, for tests and
    notebooks (structure and exact bytes are meaningful, timings are not). ``model``
    overrides the GPT sizes (``GPTConfig`` fields).
    """
    from lslm.runtime.launch import launch

    for mb in (bucket_cap_mb, *(sweep_mb or ())):
        cap_bytes(mb)  # before any process starts
    for n in nprocs:
        if not isinstance(n, int) or n < 2:
            raise ValueError(f"world sizes must be ints >= 2 (data parallelism needs peers), got {n!r}")
    model = dict(model or (QUICK_MODEL if quick else BENCH_MODEL))
    steps = steps if steps is not None else (3 if quick else 15)
    warmup = warmup if warmup is not None else (1 if quick else 3)
    sweep = list(sweep_mb if sweep_mb is not None else (QUICK_SWEEP_MB if quick else DEFAULT_SWEEP_MB))
    results: dict[int, dict[str, Any]] = {}
    for n in nprocs:
        res = launch("lslm.bench.ddp:worker", nproc=n, timeout=timeout, output="none", model=model,
                     bucket_cap_mb=bucket_cap_mb, sweep_mb=sweep, sweep_torch=sweep_torch, steps=steps,
                     warmup=warmup, threads=threads, env={"LSLM_BACKEND": "gloo", "LSLM_DEVICE": "cpu"})
        results[n] = res[0]
    print_table(results)
    if out_dir is not None:
        write_results(results, out_dir, "ddp", plot)
    print("bucketed / torch DDP step time (target <= 1.10): "
          + ", ".join(f"{n} processes {ratio(r):.2f}x" for n, r in results.items()))
    return results
