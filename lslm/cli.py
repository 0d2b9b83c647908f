"""The ``lslm`` command: ``lslm doctor`` checks a machine, ``lslm bench`` measures, ``lslm launch`` runs a worker."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
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
    from lslm.runtime.launch import LaunchError, launch

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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lslm`` console script."""
    parser = argparse.ArgumentParser(prog="lslm", description="lslm: large-scale LM training, from scratch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_doc = sub.add_parser("doctor", help="check versions, devices, backends and run a 2-process smoke job")
    p_doc.add_argument("--nproc", type=int, default=2)
    p_doc.add_argument("--json", action="store_true", help="print the machine report as JSON and exit")
    p_bench = sub.add_parser("bench", help="run a side-by-side benchmark (prints a table, writes JSON/PNG)")
    p_bench.add_argument("name", choices=("launch", "collectives", "ddp"))
    p_bench.add_argument("--sizes-kib", type=int, nargs="+", default=None,
                         help="collectives: message sizes in KiB (default 4 KiB ... 64 MiB)")
    p_bench.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    p_bench.add_argument("--repeats", type=int, default=5)
    p_bench.add_argument("--out", default=None, help="folder for JSON/PNG (default: bench/results)")
    p_bench.add_argument("--quick", action="store_true",
                         help="ddp: tiny model and few steps (checks structure and bytes; timings meaningless)")
    p_bench.add_argument("--bucket-mb", type=float, default=None,
                         help="ddp: the bucket size every variant uses (MiB; default 4)")
    p_bench.add_argument("--sweep-mb", type=float, nargs="+", default=None,
                         help="ddp: bucket sizes of the sweep (MiB; default 0.25 1 4 16)")
    p_bench.add_argument("--steps", type=int, default=None, help="ddp: timed steps per variant (default 15)")
    p_launch = sub.add_parser("launch", help="run 'package.module:function' on N processes via torchrun")
    p_launch.add_argument("target")
    p_launch.add_argument("--nproc", type=int, default=2)
    p_launch.add_argument("--nnodes", type=int, default=1)
    p_launch.add_argument("--timeout", type=float, default=600.0)
    p_launch.add_argument("--output", choices=("all", "rank0", "none"), default="all")
    p_launch.add_argument("args", nargs="*", help="worker arguments as key=value (values parsed as JSON)")
    ns = parser.parse_args(argv)
    if ns.command == "doctor":
        if ns.json:
            print(json.dumps(doctor_report(), indent=2))
            return 0
        return 0 if doctor(ns.nproc) else 1
    if ns.command == "bench":
        out_dir = ns.out or "bench/results"
        if ns.name == "launch":
            from lslm.bench import launch_overhead

            launch_overhead.main(f"{out_dir}/launch_overhead.json", tuple(ns.nprocs), ns.repeats)
        elif ns.name == "collectives":
            from lslm.bench import collectives

            sizes = tuple(k * 1024 for k in ns.sizes_kib) if ns.sizes_kib else collectives.DEFAULT_SIZES
            collectives.run(tuple(ns.nprocs), sizes, ns.repeats, out_dir=out_dir)
        elif ns.name == "ddp":
            from lslm.bench import ddp

            try:
                ddp.run(tuple(ns.nprocs), quick=ns.quick, steps=ns.steps,
                        bucket_cap_mb=ns.bucket_mb if ns.bucket_mb is not None else ddp.DEFAULT_BUCKET_MB,
                        sweep_mb=tuple(ns.sweep_mb) if ns.sweep_mb else None, out_dir=out_dir)
            except ValueError as exc:
                parser.error(str(exc))
        return 0
    if ns.command == "launch":
        from lslm.runtime.launch import LaunchError, launch

        kwargs = {}
        for item in ns.args:
            key, sep, value = item.partition("=")
            if not sep:
                parser.error(f"worker argument {item!r} is not key=value")
            kwargs[key] = _parse_value(value)
        try:
            results = launch(ns.target, nproc=ns.nproc, nnodes=ns.nnodes, timeout=ns.timeout, output=ns.output,
                             **kwargs)
        except ValueError as exc:
            parser.error(str(exc))
        except LaunchError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(json.dumps(list(results), indent=1, default=str))
        return 0
    return 2  # pragma: no cover - argparse enforces a command


if __name__ == "__main__":
    sys.exit(main())
