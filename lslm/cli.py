"""The ``lslm`` command: ``lslm doctor`` checks a machine, ``lslm bench`` measures, ``lslm launch`` runs a worker,
``lslm plan`` sizes a layout, ``lslm gpu-check`` checks the course on a GPU machine."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import threading
import time
from importlib import metadata
from typing import Any


def _version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor_report() -> dict[str, Any]:
    """Versions, devices, distributed backends and CPU count of this machine (no processes started)."""
    import torch
    import torch.distributed as dist

    report: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {name: _version(name) for name in
                     ("lslm", "torch", "transformers", "datasets", "tokenizers", "jupyterlab", "nbval")},
        "backends": {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
                     "mpi": dist.is_mpi_available()},
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
    }
    if report["cuda_available"]:
        report["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        report["cuda_version"] = torch.version.cuda
    return report


def doctor(nproc: int = 2, timeout: float = 120.0) -> bool:
    """Print the machine report, run an ``nproc``-process smoke job through ``lslm.launch``,
    and end with one ``lslm doctor: OK`` or ``lslm doctor: FAIL (...)`` line. Returns success."""
    from lslm.launcher.launch import LaunchError, launch

    rep = doctor_report()
    print(f"python       {rep['python']}  ({rep['platform']})")
    for name, ver in rep["versions"].items():
        print(f"{name:<12} {ver}")
    print(f"cpu cores    {rep['cpu_count']}")
    gpus = ", ".join(rep["gpus"]) if rep["gpus"] else "none (CPU + gloo will be used)"
    print(f"cuda         {'yes, ' + str(rep.get('cuda_version')) if rep['cuda_available'] else 'no'}; GPUs: {gpus}")
    print("backends     " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in rep["backends"].items()))
    if not rep["backends"]["gloo"]:
        print("lslm doctor: FAIL (this torch build has no gloo backend)")
        return False
    print(f"smoke job    {nproc} processes: init, all_reduce, barrier ...")
    start = time.perf_counter()
    try:
        results = launch("lslm.demos.smoke:worker", nproc=nproc, timeout=timeout, output="none", numel=1024)
    except (LaunchError, ValueError) as exc:
        print(f"lslm doctor: FAIL (smoke job: {str(exc).splitlines()[0]})")
        return False
    wall = time.perf_counter() - start
    ok = all(r["ok"] for r in results)
    backend, device = results[0]["backend"], results[0]["device"]
    if not ok:
        print("lslm doctor: FAIL (all_reduce returned a wrong sum)")
        return False
    print(f"lslm doctor: OK ({nproc} processes, {backend} on {device}, smoke job {wall:.1f} s)")
    return True


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def worker_kwargs(items: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``key=value`` words -> keyword arguments (values parsed as JSON, else kept as strings).

    Anything else ends in ``parser.error`` with what to write instead: an unknown option
    (``--nprocs``), a word without ``=``, a key that is not a Python name, a key given twice.
    """
    kwargs: dict[str, Any] = {}
    for item in items:
        if item.startswith("-"):
            known = ", ".join(s for a in parser._actions for s in a.option_strings if s.startswith("--"))
            parser.error(f"unknown option {item.split('=', 1)[0]!r} (options: {known}; "
                         "worker arguments are key=value)")
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"worker argument {item!r} is not key=value (e.g. numel=1024)")
        if not key.isidentifier():
            parser.error(f"worker argument {item!r}: {key!r} is not a Python parameter name")
        if key in kwargs:
            parser.error(f"worker argument {key!r} is given twice")
        kwargs[key] = _parse_value(value)
    return kwargs


LAUNCH_DESCRIPTION = """\
Run TARGET ('package.module:function') on N processes through torchrun and print
what every rank's function returned, as JSON (exit status 1 if a rank failed, with
the rank that failed first and its traceback). Worker arguments are key=value, the
value parsed as JSON (numel=1024, name=x, sizes=[1,2]); options may come before or
after them. SIGTERM and SIGHUP (timeout, SLURM, a closed terminal) stop every rank
like Ctrl-C does."""

LAUNCH_EPILOG = """\
examples:
  lslm launch lslm.demos.smoke:worker --nproc 4 numel=1024
  lslm launch --nproc 2 --output rank0 lslm.demos.smoke:worker numel=8
  lslm launch lslm.demos.smoke:worker --nnodes 2 --nproc 2   # 2 torchrun agents, c10d rendezvous
  lslm launch lslm.demos.smoke:worker --device cuda --backend nccl   # one GPU per process"""


def _add_launch_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="run 'package.module:function' on N processes via torchrun",
                       description=LAUNCH_DESCRIPTION, epilog=LAUNCH_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help="the worker function, 'package.module:function'")
    p.add_argument("--nproc", type=int, default=2, help="processes per node (default: 2)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="torchrun agents started on this machine, as if on that many nodes (default: 1)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before every rank is stopped (default: 600; inf: no limit)")
    p.add_argument("--output", choices=("all", "rank0", "none"), default="all",
                   help="whose printed lines to show, prefixed [rank r] (default: all)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (sets LSLM_DEVICE; default: automatic)")
    p.add_argument("--backend", choices=("gloo", "nccl", "mpi"), default=None,
                   help="sets LSLM_BACKEND (default: nccl on GPUs, else gloo)")
    p.add_argument("args", nargs="*", metavar="key=value", help="the worker's keyword arguments")
    return p


def _launch_command(ns: argparse.Namespace, parser: argparse.ArgumentParser, extra: list[str]) -> int:
    """``lslm launch``: run the job, print the results as JSON. Exit status 1 if the job failed.

    SIGTERM and SIGHUP (what ``timeout``, SLURM and a closed terminal send) stop the
    job like Ctrl-C does: every rank is stopped, then the exit status is 128 + signal.
    """
    from lslm.launcher.launch import LaunchError, launch

    if "=" in ns.target and ":" not in ns.target.partition("=")[0]:
        parser.error(f"the target ('package.module:function') comes before the worker's key=value arguments, "
                     f"got {ns.target!r} first")
    kwargs = worker_kwargs([*ns.args, *extra], parser)
    env = {k: v for k, v in (("LSLM_DEVICE", ns.device), ("LSLM_BACKEND", ns.backend)) if v}
    received: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt  # launch() stops every rank on its way out

    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may set handlers
    stop_on = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]  # no SIGHUP on Windows
    previous = {s: signal.signal(s, stop) for s in stop_on} if in_main_thread else {}
    try:
        results = launch(ns.target, nproc=ns.nproc, nnodes=ns.nnodes, timeout=ns.timeout, output=ns.output,
                         env=env, **kwargs)
    except ValueError as exc:
        parser.error(str(exc))
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        signum = received[0] if received else signal.SIGINT
        print(f"lslm launch: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print(json.dumps(list(results), indent=1, default=str))
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``lslm`` parser and its sub-command parsers by name (``doctor``, ``bench``, ``launch``, ``plan``,
    ``gpu-check``)."""
    from lslm.bench import cli as bench_cli  # light: the benches themselves are imported when run
    from lslm.bench import gpu_check
    from lslm.plan import cli as plan_cli

    parser = argparse.ArgumentParser(prog="lslm", description="lslm: large-scale LM training, from scratch",
                                     epilog="run `lslm COMMAND --help` for a command's options and examples")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,bench,launch,plan,gpu-check}")
    p_doc = sub.add_parser("doctor", help="check versions, devices, backends and run a 2-process smoke job",
                           description="Print versions, devices and backends, run a small smoke job through "
                                       "lslm.launch, end with 'lslm doctor: OK' or 'lslm doctor: FAIL (...)'.")
    p_doc.add_argument("--nproc", type=int, default=2, help="processes of the smoke job (default: 2)")
    p_doc.add_argument("--json", action="store_true", help="print the machine report as JSON and exit")
    p_bench = sub.add_parser("bench", help="run a side-by-side benchmark (prints a table, writes TXT/JSON/PNG)",
                             description="Side-by-side benchmarks on the harness's bench runner; each prints a "
                                         "table and writes NAME.txt, NAME.json and NAME.png.")
    bench_cli.add_arguments(p_bench)
    p_launch = _add_launch_parser(sub)
    p_plan = sub.add_parser("plan", help="memory, communication and time of a layout (or --search for the best)",
                            description="The lslm.plan calculator: per-device memory by owner, communication per "
                                        "axis and time per step of a model on a layout, each number with its "
                                        "formula; --search ranks the layouts that fit.",
                            epilog=plan_cli.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan_cli.add_arguments(p_plan)
    p_gpu = sub.add_parser("gpu-check", help="on a GPU machine: CUDA tests, every recipe on CUDA, doctor, "
                                             "calibration; one JSON (make gpu-check)",
                           description=gpu_check.__doc__.split("\n\n")[0].split(": ", 1)[-1])
    gpu_check.add_arguments(p_gpu)
    return parser, {"doctor": p_doc, "bench": p_bench, "launch": p_launch, "plan": p_plan, "gpu-check": p_gpu}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lslm`` console script."""
    from lslm.bench import cli as bench_cli

    parser, commands = build_parser()
    # parse_known_args: `lslm launch T --nproc 4 numel=8` puts key=value after an option,
    # which argparse leaves over instead of adding to the `args` positional; launch takes
    # them as worker arguments, every other command refuses what it does not know.
    ns, extra = parser.parse_known_args(argv)
    if ns.command == "launch":
        return _launch_command(ns, commands["launch"], extra)
    if ns.command == "bench":
        if extra:
            ns.bench_parser.error(bench_cli.explain_unknown(ns.name, extra))
        return bench_cli.run(ns, parser)
    if extra:
        commands[ns.command].error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command == "plan":
        from lslm.plan import cli as plan_cli

        return plan_cli.run(ns, commands["plan"])
    if ns.command == "gpu-check":
        from lslm.bench import gpu_check

        return gpu_check.run(ns, commands["gpu-check"])
    if ns.command == "doctor":
        if ns.nproc < 1:
            commands["doctor"].error(f"--nproc must be >= 1, got {ns.nproc}")
        if ns.json:
            print(json.dumps(doctor_report(), indent=2))
            return 0
        return 0 if doctor(ns.nproc) else 1
    return 2  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":
    sys.exit(main())
