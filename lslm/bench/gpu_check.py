"""``lslm gpu-check`` (``make gpu-check``): everything the course claims about GPUs, checked on this machine.

On a machine with one or more CUDA GPUs it runs, in order, each step with its own time limit
(the plan is :func:`plan_steps`; the test selections are :data:`CUDA_TESTS` and :data:`NCCL_TESTS`):

1. the tests with a CUDA branch (allocator, timers, devices, backend rules) on the GPU machine;
2. the NCCL cases of the multi-process tests (``-k nccl``: those whose process count fits the GPUs);
3. every recipe at ``--nproc 1`` on CUDA + NCCL (``--device cuda``, so nothing falls back to the CPU
   silently): the serial baseline, DDP bucketed and torch, fp16 and bf16, ZeRO stages 1 and 3, TP,
   pipeline and 3D at size 1; with N >= 2 GPUs also bucketed DDP at ``--nproc N``;
4. ``lslm doctor`` (its 2-process smoke job: NCCL with two GPUs, CPU + gloo with one);
5. the calibration measurements of :mod:`lslm.bench.calibrate` (GEMM, flash attention, AdamW, the course GPT, and
   the course GPT under each recomputation mode, with the dtype its replays' matmuls ran in: the step fails when
   any ran in fp32 under autocast).

``--only`` runs a subset (``--only calibrate:recompute``: the recomputation runs alone, about a minute on an H200,
for a GPU lent for a few minutes); the file's name then ends in the steps chosen.

It writes one JSON, ``<out>/gpu-check_<gpu>_<YYYY-MM-DD>.json`` (default ``bench/results/gpu/``, e.g.
``gpu-check_h200_2026-12-01.json``; the prefix keeps it from overwriting the calibration data committed beside it
under ``<gpu>_<date>.json``), for a developer to commit: the machine, every step's command, pass/fail,
return code, duration and output tail, and the calibration rows under the shared file's field names
(``gemm``, ``attention``, ``adamw``, ``gpt``, ``device``, ``torch``, ``peak_bf16_dense``). It is designed to
take under five minutes. Exit status 1 when a step failed.

Without a GPU it says so and exits 0 (nothing to check). ``--dry-run`` runs on any machine: it prints
every step with its command (checking each recipe's settings for its process count, no process
started) and runs the calibration code at tiny sizes on the CPU, writing the same JSON (default
``runs/gpu-check/``), so the GPU path's plan, measurements and file are tested without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["CALIBRATIONS", "CUDA_TESTS", "NCCL_TESTS", "RECIPES_AT_ONE", "Step", "gpu_slug", "main", "plan_steps",
           "run_check", "select_steps"]

#: tests with a CUDA branch that run in one process (allocator figures, event timers, device rules, models)
CUDA_TESTS = ("tests/test_memory.py", "tests/test_backend.py", "tests/test_harness.py", "tests/test_models.py",
              "tests/test_ledger.py", "tests/test_bench_runner.py", "tests/test_data_parallel_single.py",
              "tests/test_step_memory.py", "tests/test_trace.py::test_a_cuda_step_trace_holds_its_kernels_and_parses")
#: multi-process tests parametrised over backends (tests/helpers.py): their "nccl" cases run where GPUs suffice
NCCL_TESTS = ("tests/test_collectives.py", "tests/test_context.py", "tests/test_recipe_ddp.py",
              "tests/test_precision_scaler.py", "tests/test_tp_random.py", "tests/test_tp_hf.py",
              "tests/test_tp_notebook_demos.py", "tests/test_tp_clip_checkpoint.py", "tests/test_pipeline_executor.py",
              "tests/test_pipeline_2bw.py", "tests/test_pipeline_torch_reference.py", "tests/test_context_parallel.py",
              "tests/test_cp_compose.py", "tests/test_expert_parallel.py", "tests/test_activation_theory.py")
#: (step name, recipe module, flags) of the recipes run at one process
RECIPES_AT_ONE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("train", "lslm.recipes.train", ()),
    ("ddp-bucketed", "lslm.recipes.ddp", ("--variant", "bucketed")),
    ("ddp-torch", "lslm.recipes.ddp", ("--variant", "torch")),
    ("ddp-fp16", "lslm.recipes.ddp", ("--precision", "fp16")),
    ("ddp-bf16", "lslm.recipes.ddp", ("--precision", "bf16")),
    ("zero-1", "lslm.recipes.zero", ("--stage", "1")),
    ("zero-3", "lslm.recipes.zero", ("--stage", "3")),
    ("tp", "lslm.recipes.tp", ("--tp", "1")),
    ("pipeline", "lslm.recipes.pipeline", ("--pp", "1")),
    ("three_d", "lslm.recipes.three_d", ("--tp", "1", "--pp", "1")),
)
RECIPE_STEPS = 5
#: the in-process calibration parts (:mod:`lslm.bench.calibrate`), in order
CALIBRATIONS = ("gemm", "attention", "adamw", "gpt", "recompute")


@dataclass
class Step:
    """One step of the check: a command (``argv``, run from the repository root) or an in-process ``calibrate:*``."""

    name: str
    argv: list[str] = field(default_factory=list)
    timeout_s: float = 120.0
    ok: bool | None = None  # None: not run (dry run)
    returncode: int | None = None
    duration_s: float | None = None
    output_tail: str = ""
    note: str = ""

    @property
    def command(self) -> str:
        """The step as one shell-readable line (``python`` for this interpreter)."""
        if not self.argv:
            part = self.name.split(":", 1)[1]
            return f"(in process) lslm.bench.calibrate.{'gpt_recompute' if part == 'recompute' else part}"
        return " ".join(["python", *self.argv[1:]] if self.argv[0] == sys.executable else self.argv)


def gpu_slug(name: str) -> str:
    """A file-name part from a device name: ``"NVIDIA H200"`` -> ``"h200"``, ``"NVIDIA A100-SXM4-80GB"`` ->
    ``"a100-sxm4-80gb"``."""
    name = re.sub(r"^(nvidia|amd)\s+", "", name.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def _recipe_argv(module: str, flags: Sequence[str], nproc: int | None) -> list[str]:
    launch = ["--nproc", str(nproc)] if nproc is not None else []  # the serial baseline has no --nproc
    return [sys.executable, "-m", module, *launch, "--steps", str(RECIPE_STEPS), "--device", "cuda", *flags]


def _check_recipe(module: str, flags: Sequence[str], nproc: int) -> None:
    """Raise ValueError when the flags are not valid for ``nproc`` ranks (the recipe's own check, no process)."""
    import importlib

    from lslm.harness import parse_config

    recipe = getattr(importlib.import_module(module), "RECIPE", None)
    if recipe is None:  # the serial baseline
        from lslm.recipes.train import TrainConfig

        parse_config(TrainConfig, list(flags))
        return
    cfg, _ = parse_config(recipe.config, list(flags))
    recipe.validate(cfg, nproc)


def plan_steps(n_gpus: int, root: Path | None) -> list[Step]:
    """Every step of a check on a machine with ``n_gpus`` GPUs, in order (``root``: the repository, None when
    the tests are not there, e.g. a non-editable install: the test steps are left out)."""
    py = sys.executable
    steps = []
    if root is not None:
        pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
        steps.append(Step("tests:cuda", [*pytest, *CUDA_TESTS], timeout_s=150))
        steps.append(Step("tests:nccl", [*pytest, "-k", "nccl", *NCCL_TESTS], timeout_s=150))
    for name, module, flags in RECIPES_AT_ONE:
        _check_recipe(module, flags, 1)
        steps.append(Step(f"recipe:{name}", _recipe_argv(module, flags, None if name == "train" else 1), 90))
    if n_gpus >= 2:
        _check_recipe("lslm.recipes.ddp", ("--batch-size", str(8 * n_gpus)), n_gpus)
        steps.append(Step(f"recipe:ddp-bucketed-x{n_gpus}",
                          _recipe_argv("lslm.recipes.ddp", ("--batch-size", str(8 * n_gpus)), n_gpus), 120))
    steps.append(Step("doctor", [py, "-m", "lslm.cli", "doctor"], timeout_s=120))
    steps += [Step(f"calibrate:{part}", timeout_s=0) for part in CALIBRATIONS]
    return steps


def select_steps(steps: list[Step], only: Sequence[str]) -> list[Step]:
    """The steps named in ``only`` (a whole name, e.g. ``calibrate:recompute``, or the part before its colon,
    e.g. ``calibrate``), in plan order; ``only`` empty: every step. ValueError naming the choices otherwise."""
    if not only:
        return steps
    names = {s.name: {s.name, s.name.split(":", 1)[0]} for s in steps}  # what selects each step
    unknown = [o for o in only if not any(o in keys for keys in names.values())]
    if unknown:
        raise ValueError(f"--only {','.join(unknown)}: no such step; choose among "
                         f"{', '.join(names)} (or a prefix before the colon)")
    return [s for s in steps if names[s.name] & set(only)]


def _run_command(step: Step, root: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))  # this checkout's lslm
    start = time.perf_counter()
    try:
        done = subprocess.run(step.argv, cwd=root, env=env, capture_output=True, text=True, timeout=step.timeout_s)
        step.returncode, output = done.returncode, done.stdout + done.stderr
        # pytest's 5 is "no test selected": with fewer GPUs than any NCCL case needs, every case is deselected
        step.ok = done.returncode == 0 or (done.returncode == 5 and step.name.startswith("tests:"))
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        step.ok, step.note = False, f"timed out after {step.timeout_s:.0f} s"
    step.duration_s = time.perf_counter() - start
    step.output_tail = output[-2000:]


def _calibrate(step: Step, device: torch.device, sizes: dict[str, Any], peak: float | None,
               record: dict[str, Any]) -> None:
    from lslm.bench import calibrate

    part = step.name.split(":", 1)[1]
    start = time.perf_counter()
    try:
        if part == "gpt":
            record[part] = calibrate.gpt(device, sizes, peak, repeats=sizes["repeats"])
        elif part == "recompute":
            record[part] = calibrate.gpt_recompute(device, sizes, peak, repeats=sizes["recompute_repeats"])
        else:
            record[part] = getattr(calibrate, part)(device, sizes[part], repeats=sizes["repeats"])
        errors = [row["error"] for row in record[part] if "error" in row]
        # a replay outside the forward's autocast runs its matmuls in fp32: the run would time the wrong thing
        fp32 = [f"{row['name']} {row['recompute']}" for row in record[part]
                if row.get("matmul_flops_by_dtype", {}).get("float32")]
        step.ok = not errors and not fp32
        if not step.ok:
            step.output_tail = "; ".join(errors + [f"{r}: matmuls ran in float32 under autocast" for r in fp32])
    except Exception as exc:  # noqa: BLE001 - one failed part is recorded; the others still run
        record[part] = f"FAILED: {type(exc).__name__}: {exc}"
        step.ok, step.output_tail = False, record[part]
    step.duration_s = time.perf_counter() - start


def _machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if device.type == "cuda":
        info.update(device=torch.cuda.get_device_name(device), gpu_count=torch.cuda.device_count(),
                    cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        info.update(device="cpu (dry run)", gpu_count=0, cuda=None, nccl=None)
    return info


def run_check(out_dir: str | Path, *, dry_run: bool = False, root: Path | None = None,
              date: datetime.date | None = None, only: Sequence[str] = ()) -> tuple[Path, dict[str, Any]]:
    """Plan and run the check (``dry_run``: plan only, calibrations tiny on the CPU); write and return the JSON.
    ``only``: run just these steps (:func:`select_steps`); the file's name then ends in them.

    Needs a GPU unless ``dry_run`` (ValueError otherwise: :func:`main` checks first).
    """
    from lslm.bench.calibrate import SIZES, peak_flops

    root = root if root is not None else _repo_root()
    gpus = 0 if dry_run else torch.cuda.device_count()
    if not dry_run and gpus == 0:
        raise ValueError("lslm gpu-check needs a CUDA GPU; use dry_run=True to exercise the plan on the CPU")
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    record: dict[str, Any] = {**_machine(device), "date": (date or datetime.date.today()).isoformat(),
                              "dry_run": dry_run}
    peak = None if dry_run else peak_flops(record["device"])
    record["peak_bf16_dense"] = peak
    steps = select_steps(plan_steps(gpus if not dry_run else 2, root), only)  # a dry run plans for two GPUs
    record["only"] = list(only)
    sizes = SIZES["tiny" if dry_run else "gpu"]
    total = time.perf_counter()
    for i, step in enumerate(steps, 1):
        if step.argv and not dry_run:
            _run_command(step, root)
        elif not step.argv:
            _calibrate(step, device, sizes, peak, record)
        status = "plan" if step.ok is None else ("ok" if step.ok else "FAIL")
        took = f" {step.duration_s:6.1f} s" if step.duration_s is not None else ""
        print(f"[{i:2d}/{len(steps)}] {status:4s}{took}  {step.name:<24} {step.command}", flush=True)
        if step.ok is False:
            last = step.output_tail.strip().splitlines()[-1:] or [""]
            print("      " + (step.note or last[0])[:300], flush=True)
    record["total_s"] = time.perf_counter() - total
    record["steps"] = [{**asdict(s), "command": s.command} for s in steps]
    for s in record["steps"]:
        del s["argv"]
    record["passed"] = all(s.ok is not False for s in steps)
    name = "dry-run" if dry_run else gpu_slug(record["device"])
    part = "".join("_" + re.sub(r"[^a-z0-9]+", "-", o.lower()) for o in only)
    path = Path(out_dir) / f"gpu-check_{name}_{record['date']}{part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path, record


def _repo_root() -> Path | None:
    """The checkout this lslm comes from, if its tests are there (an editable install or PYTHONPATH=.)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "tests" / "helpers.py").is_file() else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``lslm gpu-check``'s options."""
    parser.add_argument("--dry-run", action="store_true",
                        help="any machine: list every step with its command and run the calibrations tiny on the CPU")
    parser.add_argument("--only", default="",
                        help="comma-separated steps to run (e.g. calibrate:recompute, or calibrate for every "
                             "calibration); default every step")
    parser.add_argument("--out", default=None,
                        help="folder of the JSON (default: bench/results/gpu, or runs/gpu-check for --dry-run)")


def run(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``lslm gpu-check`` from parsed options; the exit status (0 without a GPU: nothing to check; a bad
    ``--only`` is ``parser``'s usage error, on any machine)."""
    only = [o.strip() for o in ns.only.split(",") if o.strip()]
    try:
        select_steps(plan_steps(2, _repo_root()), only)
    except ValueError as exc:
        parser.error(str(exc))
    if not ns.dry_run and not torch.cuda.is_available():  # the only CUDA call on a machine without a GPU
        print("lslm gpu-check needs a CUDA GPU and this machine has none: nothing to check (exit 0). "
              "`lslm gpu-check --dry-run` shows the plan and runs the calibration code on the CPU.")
        return 0
    out = ns.out or ("runs/gpu-check" if ns.dry_run else "bench/results/gpu")
    path, record = run_check(out, dry_run=ns.dry_run, only=only)
    failed = [s["name"] for s in record["steps"] if s["ok"] is False]
    print(f"lslm gpu-check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'OK'} in {record['total_s']:.0f} s; "
          f"wrote {path}")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lslm.bench.gpu_check [--dry-run] [--only STEPS] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="lslm gpu-check", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    sys.exit(main())
