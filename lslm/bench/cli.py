"""``lslm bench launch|collectives|ddp|tp|pipeline|zero|cp``: the bench part of ``lslm`` (see :mod:`lslm.cli`).

Each bench is its own sub-command with only the options it uses, so ``lslm bench ddp --help``
lists ddp's options and an option of another bench is an error that names the bench it
belongs to, never silently ignored. Values are checked by argparse types (the rules of
:mod:`lslm.bench.checks`), so a bad value stops the command before any process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import textwrap
from collections.abc import Callable, Iterator

from lslm.bench.devices import BENCH_DEVICES

__all__ = ["BENCH_OPTIONS", "add_arguments", "explain_unknown", "run"]

_RAW = argparse.RawDescriptionHelpFormatter


def _int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}{f' ({why})' if why else ''}, "
                                             f"got {value}")
        return value
    return parse


def _positive_mib(text: str) -> float:
    """An argparse type: a bucket size in MiB, a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of MiB > 0, got {text}")
    return value


def _nprocs(p: argparse.ArgumentParser, minimum: int, why: str = "") -> None:
    p.add_argument("--nprocs", type=_int_at_least(minimum, why), nargs="+", default=[2, 4], metavar="N",
                   help="world sizes to measure, one launch each (default: 2 4)")


def _out(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"folder for {name}.txt, .json and .png, created if missing (default: bench/results)")


def _device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=BENCH_DEVICES, default="cpu",
                   help="cpu (gloo, comparable with the committed results), cuda (NCCL, one GPU per process) "
                        "or auto (default: cpu)")
    # Every bench that measures on a device runs lslm.harness.run_variants, which traces when asked.
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="profile the last timed round with torch.profiler; every rank writes "
                        "DIR/bench<k>-n<world>-rank<r>.json (Chrome trace: Perfetto, chrome://tracing)")


def _launch_options(p: argparse.ArgumentParser) -> None:
    _nprocs(p, 1)
    p.add_argument("--repeats", type=_int_at_least(1), default=5, metavar="R",
                   help="launches per world size and job; the table shows their median (default: 5)")
    _out(p, "launch_overhead")


def _collectives_options(p: argparse.ArgumentParser) -> None:
    _nprocs(p, 1)
    p.add_argument("--sizes-kib", type=_int_at_least(1), nargs="+", default=None, metavar="KIB",
                   help="message sizes in KiB (default: 4 64 1024 16384 65536, i.e. 4 KiB ... 64 MiB)")
    p.add_argument("--repeats", type=_int_at_least(1), default=5, metavar="R",
                   help="timed calls per (collective, size); the table shows their median (default: 5)")
    _out(p, "collectives")
    _device(p)


def _ddp_options(p: argparse.ArgumentParser) -> None:
    _nprocs(p, 2, "data parallelism needs peers")
    p.add_argument("--steps", type=_int_at_least(1), default=None,
                   help="timed training steps per variant (default: 15; 3 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps, two-point sweep: checks structure and bytes, timings meaningless")
    p.add_argument("--bucket-mb", type=_positive_mib, default=None, metavar="MIB",
                   help="bucket size every variant uses (MiB; default: 4)")
    p.add_argument("--sweep-mb", type=_positive_mib, nargs="+", default=None, metavar="MIB",
                   help="bucket sizes of the bucketed sweep (MiB; default: 0.25 1 4 16; 0.25 1 with --quick)")
    _out(p, "ddp")
    _device(p)


def _tp_options(p: argparse.ArgumentParser) -> None:
    _nprocs(p, 2, "tensor parallelism needs peers")
    p.add_argument("--steps", type=_int_at_least(1), default=None,
                   help="timed training steps per entry (default: 15; 3 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps: checks structure, memory and counts, timings meaningless")
    p.add_argument("--no-sp", action="store_true",
                   help="leave out the sequence-parallel pair (lslm and DTensor, each with SP)")
    _out(p, "tp")
    _device(p)


def _pipeline_options(p: argparse.ArgumentParser) -> None:
    _nprocs(p, 2, "a pipeline needs at least two stages")
    p.add_argument("--microbatches", type=_int_at_least(1), nargs="+", default=[4, 8], metavar="M",
                   help="numbers of micro-batches to measure at each world size (default: 4 8)")
    p.add_argument("--repeats", type=_int_at_least(1), default=None, metavar="R",
                   help="timed steps per schedule and implementation; the table shows their median (default: 15, "
                        "where one run's time-model errors stopped moving by the step-to-step noise; 1 with --quick)")
    p.add_argument("--warmup", type=_int_at_least(0), default=None, metavar="W",
                   help="untimed rounds first (default: 2; 1 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, one timed step: checks structure, counts and bubbles, timings meaningless")
    p.add_argument("--n-embd", type=_int_at_least(1), default=None, metavar="C",
                   help="model width (default: 128): more compute per action, against the same per-message costs")
    p.add_argument("--batch", type=_int_at_least(1), default=None, metavar="B",
                   help="rows per step, split into the micro-batches (default: 16)")
    _out(p, "pipeline")
    _device(p)


def _zero_options(p: argparse.ArgumentParser) -> None:
    _nprocs(p, 2, "ZeRO partitions over data-parallel peers")
    p.add_argument("--steps", type=_int_at_least(1), default=None,
                   help="timed training steps per entry (default: 10; 2 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny model, few steps: checks structure, memory and counts, timings meaningless")
    p.add_argument("--entries", nargs="+", default=None, metavar="ENTRY",
                   help="which entries to run (default: all: ddp zero1 zero2 zero3 zero3-offload zero3-disk "
                        "torch-zero1 fsdp2 fsdp2-offload deepspeed1 deepspeed2 deepspeed3 deepspeed3-offload; "
                        "DeepSpeed's are skipped, with the reason, where it cannot run)")
    _out(p, "zero")
    _device(p)


def _cp_options(p: argparse.ArgumentParser) -> None:
    _nprocs(p, 2, "context parallelism needs peers")
    p.add_argument("--repeats", type=_int_at_least(1), default=None, metavar="R",
                   help="timed rounds of every variant; the table shows their median (default: 10; 2 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, few rounds: checks bytes against the formula, activations; timings meaningless")
    _out(p, "cp")
    _device(p)


#: name -> (one-line help, what it measures, its options, an example)
_BENCHES: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None], str]] = {
    "launch": ("start-up cost of a trivial job (lslm.launch wall time)",
               "Wall time of lslm.launch for an 'echo' job (workers import lslm and return) and a 'smoke' "
               "job (a gloo group, one 4 KiB all-reduce), median of --repeats launches per world size.",
               _launch_options, "lslm bench launch --nprocs 2 --repeats 3"),
    "collectives": ("every lslm collective next to torch.distributed's, and the alpha-beta fit",
                    "Times every lslm collective and torch.distributed's own at each message size and world "
                    "size (medians of --repeats), prints algorithm and bus bandwidth (the nccl-tests "
                    "definitions) and fits the alpha-beta cost model.",
                    _collectives_options, "lslm bench collectives --nprocs 2 --sizes-kib 4 1024 --repeats 3"),
    "ddp": ("naive, fused, bucketed (also on the gradient buffer) and torch DDP on one GPT, plus a bucket-size sweep",
            "Trains naive, fused, bucketed and torch DDP, bucketed DDP on the gradient buffer (buffered: "
            "main_grad reduced in place) and a no-communication floor on the same GPT and data, round-robin "
            "in one launch per world size; sweeps the bucket size, reports the fraction of all-reduce time "
            "hidden behind backward and checks all-reduced bytes against gradient bytes.",
            _ddp_options, "lslm bench ddp --quick --nprocs 2"),
    "tp": ("lslm tensor parallelism next to PyTorch DTensor's on one GPT, with and without SP",
           "Trains the same GPT tensor-parallel with lslm's layers and with DTensor (parallelize_module, "
           "loss_parallel), with and without sequence parallelism, round-robin in one launch per world size "
           "(= tp); reports step time and its phases, memory per rank, collectives per step, and the "
           "lslm / DTensor step-time ratio.",
           _tp_options, "lslm bench tp --quick --nprocs 2 --steps 2"),
    "pipeline": ("lslm pipeline schedules next to torch.distributed.pipelining's on one GPT",
                 "Runs GPipe, 1F1B, interleaved 1F1B (v=2), ZB-H1 and DualPipeV with lslm's executor and the "
                 "matching torch.distributed.pipelining schedules on the same GPT stages and data, round-robin "
                 "in one launch per world size (= pipeline size), at each number of micro-batches; reports step "
                 "times, the lslm / torch ratio, and lslm's measured bubble fraction next to the simulated one.",
                 _pipeline_options, "lslm bench pipeline --quick --nprocs 2 --microbatches 4"),
    "zero": ("lslm's ZeRO stages 1-3 (and CPU offload) next to torch DDP, ZeroRedundancyOptimizer, FSDP2 and "
             "DeepSpeed",
             "Trains the same GPT with torch DDP, lslm's ZeroOptimizer at stages 1, 2, 3 and 3 with CPU offload, "
             "torch's ZeroRedundancyOptimizer, FSDP2 fully_shard (with and without CPUOffloadPolicy) and "
             "DeepSpeed's ZeRO engine at stages 1-3 (3 also with CPU offload), round-robin in one launch per world "
             "size; reports step time and its phases, model-state bytes per rank by owner, lslm's reduce-scatter "
             "and all-gather bytes per step, and the lslm / peer step-time ratios (stage 1 / "
             "ZeroRedundancyOptimizer, stage 3 / FSDP2, stage 3 / DeepSpeed stage 3).",
             _zero_options, "lslm bench zero --quick --nprocs 2"),
    "cp": ("ring attention (contiguous, zig-zag) and Ulysses next to full attention, alone and in a GPT block",
           "Runs causal attention forward + backward as full single-process attention, ring attention (contiguous "
           "and zig-zag layouts) and Ulysses, alone and inside one GPT block, round-robin in one launch per world "
           "size (= cp); reports step time, bytes sent per rank from the ledger (checked equal to "
           "lslm.context_parallel.cp_traffic), bytes saved for backward per rank, and the step-time ratios to full "
           "attention.",
           _cp_options, "lslm bench cp --quick --nprocs 2"),
}


def _option_strings(add: Callable[[argparse.ArgumentParser], None]) -> set[str]:
    probe = argparse.ArgumentParser(add_help=False)
    add(probe)
    return {s for action in probe._actions for s in action.option_strings}


#: every bench's own options, to tell a user whose option they passed
BENCH_OPTIONS: dict[str, set[str]] = {name: _option_strings(spec[2]) for name, spec in _BENCHES.items()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add one sub-command per bench to ``p`` (the ``lslm bench`` parser), each with its own options."""
    sub = p.add_subparsers(dest="name", required=True, metavar="{launch,collectives,ddp,tp,pipeline,zero,cp}",
                           title="benches", description="run `lslm bench NAME --help` for the options of one")
    for name, (short, long, add, example) in _BENCHES.items():
        sp = sub.add_parser(name, help=short, description=textwrap.fill(long, 80), formatter_class=_RAW,
                            epilog=f"example (a small run):\n  {example}")
        add(sp)
        sp.set_defaults(bench_parser=sp)


def explain_unknown(name: str, extra: list[str]) -> str:
    """The error for arguments ``lslm bench NAME`` does not take: say which bench an option belongs to."""
    for item in extra:
        option = item.split("=", 1)[0]
        if not option.startswith("-"):
            continue
        owners = [other for other, opts in BENCH_OPTIONS.items() if option in opts]
        if owners:
            return (f"{option} is an option of `lslm bench {' / '.join(owners)}`, not of `lslm bench {name}` "
                    f"(its options: {', '.join(sorted(BENCH_OPTIONS[name]))}; see `lslm bench {name} --help`)")
        return f"unknown option {option} for `lslm bench {name}` (see `lslm bench {name} --help`)"
    return f"unexpected arguments {' '.join(extra)} for `lslm bench {name}` (see `lslm bench {name} --help`)"


def run(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the bench ``ns.name`` with the parsed flags; bad settings end in ``parser.error`` before any launch."""
    parser = getattr(ns, "bench_parser", parser)  # the bench's own parser, for its usage line
    out_dir = ns.out or "bench/results"
    trace = getattr(ns, "trace", None)
    with _tracing(trace):
        return _run(ns, parser, out_dir)


@contextlib.contextmanager
def _tracing(folder: str | None) -> Iterator[None]:
    """Set :data:`lslm.harness.bench_runner.TRACE_ENV` for the processes launched inside (and restore it)."""
    if not folder:
        yield
        return
    from lslm.harness.bench_runner import TRACE_ENV

    before = os.environ.get(TRACE_ENV)
    os.environ[TRACE_ENV] = os.path.abspath(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TRACE_ENV, None)
        else:
            os.environ[TRACE_ENV] = before


def _run(ns: argparse.Namespace, parser: argparse.ArgumentParser, out_dir: str) -> int:
    try:
        if ns.name == "launch":
            from lslm.bench import launch_overhead

            launch_overhead.main(out_dir, tuple(ns.nprocs), ns.repeats)
        elif ns.name == "collectives":
            from lslm.bench import collectives

            sizes = tuple(k * 1024 for k in ns.sizes_kib) if ns.sizes_kib else collectives.DEFAULT_SIZES
            collectives.run(tuple(ns.nprocs), sizes, ns.repeats, out_dir=out_dir, device=ns.device)
        elif ns.name == "pipeline":
            from lslm.bench import pipeline

            model = None if ns.n_embd is None else dict(pipeline.QUICK_MODEL if ns.quick else pipeline.BENCH_MODEL,
                                                        n_embd=ns.n_embd)
            pipeline.run(tuple(ns.nprocs), tuple(ns.microbatches), quick=ns.quick, repeats=ns.repeats,
                         warmup=ns.warmup, out_dir=out_dir, device=ns.device, model=model, batch=ns.batch)
        elif ns.name == "zero":
            from lslm.bench import zero

            zero.run(tuple(ns.nprocs), quick=ns.quick, steps=ns.steps, out_dir=out_dir, device=ns.device,
                     **({"entries": tuple(ns.entries)} if ns.entries else {}))
        elif ns.name == "cp":
            from lslm.bench import cp

            cp.run(tuple(ns.nprocs), quick=ns.quick, steps=ns.repeats, out_dir=out_dir, device=ns.device)
        elif ns.name == "tp":
            from lslm.bench import tp

            tp.run(tuple(ns.nprocs), quick=ns.quick, steps=ns.steps, sequence_parallel=not ns.no_sp,
                   out_dir=out_dir, device=ns.device)
        else:
            from lslm.bench import ddp

            ddp.run(tuple(ns.nprocs), quick=ns.quick, steps=ns.steps,
                    bucket_cap_mb=ns.bucket_mb if ns.bucket_mb is not None else ddp.DEFAULT_BUCKET_MB,
                    sweep_mb=tuple(ns.sweep_mb) if ns.sweep_mb else None, out_dir=out_dir, device=ns.device)
    except ValueError as exc:
        parser.error(str(exc))
    return 0
