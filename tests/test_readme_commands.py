"""Every command shown in README.md runs, so the README cannot drift from the code.

The README's fenced ``bash`` blocks are parsed here; each command found must appear in
exactly one of three tables, so a command added to the README, or changed, fails
:func:`test_every_readme_command_is_accounted_for` until it is given a decision:

* ``AS_WRITTEN``: run exactly as written (the cheap ones).
* ``SMALLEST``: a long command, run with its smallest settings, an explicit substitution:
  options appended to the README's command (argparse keeps the last value of a repeated
  option) or its placeholders filled in.
* ``SKIP``: commands a test cannot run, each with the reason and what covers it instead.

Program names are mapped to the interpreter running this test (``PROGRAMS``), so the test
works from any environment, not only ``.venv``; ``lslm`` runs in-process through
``lslm.cli:main``, the console script's entry point (checked against pyproject.toml).
Every command runs in a temporary folder, so relative outputs (``runs/``, ``results/``,
``bench/results/``) never touch the repository. The README's Python block runs too, and
inline code that looks like a command must be a fenced command or be listed in
``INLINE_MENTIONS``; every package folder of ``lslm`` must be in the README's package table.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lslm.runtime.startup import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHELL_FENCES = ("bash", "sh", "shell", "console")

#: README program -> argv prefix of this interpreter. ``lslm`` is run in-process (see module doc).
PROGRAMS = {
    "python": [sys.executable],
    ".venv/bin/python": [sys.executable],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}

LAUNCH_SMOKE = "lslm launch lslm.demos.smoke:worker --nproc 4 numel=1024"
TRAIN = "python -m lslm.recipes.train --steps 50 --out runs/baseline.json"
DDP = "python -m lslm.recipes.ddp --nproc 2 --variant bucketed --model gpt"
TORCHRUN_DDP = "torchrun --nproc-per-node 2 -m lslm.recipes.ddp --variant bucketed --model gpt"
TP = "python -m lslm.recipes.tp --nproc 2 --tp 2 --sequence-parallel"
PP = "python -m lslm.recipes.pipeline --nproc 2 --pp 2 --schedule 1f1b --microbatches 4"
PRECISION = "python -m lslm.recipes.ddp --nproc 2 --precision fp16"
ZERO = "python -m lslm.recipes.zero --nproc 2 --stage 2"
THREE_D = "python -m lslm.recipes.three_d --nproc 4 --tp 2 --pp 2 --schedule 1f1b --sequence-parallel"
MULTI_NODE = (".venv/bin/python -m torch.distributed.run --nnodes=N --nproc-per-node=GPUS_PER_NODE "
              "--rdzv-backend=c10d --rdzv-endpoint=HOST_OF_NODE_0:29500 --rdzv-id=myjob "
              "-m lslm.launcher.worker --target lslm.demos.smoke:worker --args-file args.json --result-dir results/")

PLAN = "lslm plan --model gpt3-175b --devices 1024 --tp 8 --pp 8 --zero 1 --sp --recompute selective"
PLAN_SEARCH = "lslm plan --model llama3-8b --devices 8 --search --flash"

#: run exactly as written
PLAN_VALIDATE = "lslm plan --validate"
GPU_CHECK_DRY_RUN = "lslm gpu-check --dry-run"
AS_WRITTEN = {LAUNCH_SMOKE, "lslm launch --help", "lslm bench ddp --help", PLAN, PLAN_SEARCH, PLAN_VALIDATE,
              GPU_CHECK_DRY_RUN}

#: README command -> (options appended, or {placeholder: value}); why this is the smallest meaningful run
SMALLEST: dict[str, tuple[str | dict[str, str], str]] = {
    TRAIN: ("--steps 2", "50 steps of the baseline: 2 show the loop, the log and the JSON written"),
    DDP: ("--steps 2", "30 DDP steps: 2 show the launch, the sync and the result"),
    TORCHRUN_DDP: ("--steps 2", "as above, started by torchrun instead of by the recipe"),
    TP: ("--steps 2", "30 tensor-parallel steps: 2 show the launch, the layers' traffic and the result"),
    PP: ("--steps 2", "30 pipeline-parallel steps: 2 show the launch, the schedule's traffic and the result"),
    PRECISION: ("--steps 2", "30 fp16 DDP steps: 2 show the half model, the loss scale and the result"),
    ZERO: ("--steps 2", "30 ZeRO-2 steps: 2 show the launch, the reduce-scatters and all-gathers, the result"),
    THREE_D: ("--steps 2", "30 steps of TP+SP inside a 2-stage pipeline: 2 show the launch, the traffic per axis and "
                           "the result"),
    "lslm bench collectives": ("--nprocs 2 --sizes-kib 4 --repeats 1",
                               "full sweep (4 KiB-64 MiB, 2 and 4 processes) takes minutes"),
    "lslm bench launch": ("--nprocs 1 --repeats 1", "5 repeats at 2 and 4 processes take a minute"),
    "lslm bench ddp": ("--quick --nprocs 2 --steps 1 --sweep-mb 1", "the full bench takes minutes"),
    "lslm bench tp": ("--quick --nprocs 2 --steps 1", "the full bench takes a minute"),
    "lslm bench pipeline": ("--quick --nprocs 2 --microbatches 4", "the full bench takes minutes"),
    "lslm bench zero": ("--quick --nprocs 2 --steps 1", "the full bench takes minutes"),
    "python -m lslm.bench.ledger": ("--calls 20 --rounds 1", "15 rounds of 2,000 calls take seconds; 1 of 20 show "
                                                              "the table and the files written"),
    "python -m lslm.bench.init_memory": ("--quick --sizes 2", "an 8.4 M-parameter GPT at 1, 2 and 4 ranks takes a "
                                                              "minute; a tiny one at 2 shows the table and files"),
    "python -m lslm.bench.zero_offload": ("--quick --steps 2", "an 86.7 M-parameter GPT six times takes minutes; "
                                                               "a tiny one shows the table"),
    MULTI_NODE: ({"N": "2", "GPUS_PER_NODE": "1", "HOST_OF_NODE_0:29500": "127.0.0.1:{port}"},
                 "two 'nodes' on this machine: the line runs twice at once, one process each, "
                 "a free port on localhost as node 0's endpoint"),
}

_MAKE_DRY_RUN = "dry-run only (`make -n`, checked below: the target exists)"
#: README command -> why a test cannot run it, and what covers it instead
SKIP = {
    "lslm bench cp": "the default run takes half a minute; tests/test_bench_cp.py runs the bench at cp = 2 and checks "
                     "its exact counts",
    "python -m lslm.demos.pld --out bench/results/pld": "trains two GPTs for 200 steps (a minute); "
                                                         "tests/test_layer_drop.py runs the same demo for 3 steps",
    "make lab": (f"serves JupyterLab until stopped; tests/test_setup.py starts and queries it and "
                 f"tests/test_browser.py opens every notebook in it; {_MAKE_DRY_RUN}"),
    "make test": f"is the whole suite, this test included; {_MAKE_DRY_RUN}",
    "make lab PORT=9999": f"as `make lab`; {_MAKE_DRY_RUN}",
    "make doctor": f"runs `lslm doctor`, which tests/test_setup.py runs; {_MAKE_DRY_RUN}",
    "make gpu-check": f"needs a GPU (without one it exits 0 at once); tests/test_gpu_check.py runs its no-GPU exit and "
                      f"its dry run, which this test also runs as written; {_MAKE_DRY_RUN}",
    'make gpu-check GPU_CHECK_ARGS="--only calibrate:recompute"':
        f"needs a GPU, as `make gpu-check`; tests/test_gpu_check.py runs `--only calibrate:recompute` as a dry run; "
        f"{_MAKE_DRY_RUN}",
    "make notebooks": f"re-executes every notebook in place (minutes, rewrites committed files); nbval runs "
                      f"them under `make test`; {_MAKE_DRY_RUN}",
    "make clean": f"deletes the environment this test runs in; {_MAKE_DRY_RUN}",
    "make lint": f"ruff and lint-imports over the repository, the first step of `make test`; {_MAKE_DRY_RUN}",
    "make test-portability": f"reruns part of the suite three times under ATEN_CPU_CAPABILITY (~40 min); those tests "
                             f"run once under `make test`; {_MAKE_DRY_RUN}",
    'make test PYTEST_ARGS="tests/test_launch.py -x"': f"runs tests/test_launch.py, part of the suite; "
                                                       f"{_MAKE_DRY_RUN}",
    'make lab TORCH_INDEX="--index-url https://download.pytorch.org/whl/cu126"':
        f"installs a CUDA build of torch from the network; {_MAKE_DRY_RUN}",
    "conda env create -f environment.yml && conda activate lslm":
        "creates a conda environment from the network; tests/test_setup.py checks environment.yml "
        "mirrors pyproject.toml",
}

#: inline code in the prose that looks like a command but is not a fenced one -> what covers it
INLINE_MENTIONS = {
    "lslm doctor": "`make doctor` runs it; tests/test_setup.py::test_lslm_doctor_says_ok",
    "lslm gpu-check": "`make gpu-check` runs it; tests/test_gpu_check.py (no GPU: the exit, and the dry run)",
    "source .venv/bin/activate": "activates the environment; this test runs inside it already",
    ".venv/bin/lslm": "a program name: the console script the `lslm ...` commands run",
    "python -m torch.distributed.run": "prose saying what `lslm.launch` runs (torchrun), not a command",
    "srun --ntasks-per-node=1": "SLURM, needs a cluster",
    "scontrol show hostnames $SLURM_JOB_NODELIST | head -1": "SLURM, needs a cluster",
}
_COMMAND_WORDS = ("lslm ", "make ", "python ", "torchrun ", ".venv/bin/", "srun ", "sbatch ", "scontrol ",
                  "conda ", "pip ", "source ")

#: the README's Python block -> (replacement, why)
PYTHON_SUBSTITUTION = {"nproc=4": ("nproc=2", "the same job as the shell line, which runs at 4 processes")}


# -- parsing -------------------------------------------------------------------------------------
def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block of a Markdown text."""
    return [(m.group(1).strip().lower(), m.group(2)) for m in re.finditer(r"^```([^\n]*)\n(.*?)^```", text,
                                                                             re.MULTILINE | re.DOTALL)]


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes that starts a word)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_commands(text: str) -> list[str]:
    """Every command in the fenced shell blocks: continuation lines joined, comments and blanks dropped,
    whitespace runs collapsed to one space."""
    commands = []
    for lang, body in fenced_blocks(text):
        if lang not in SHELL_FENCES:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            command = " ".join(_strip_comment(line).split())
            if command:
                commands.append(command)
    return commands


def _inline_code(text: str) -> list[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return [" ".join(span.split()) for span in re.findall(r"`([^`\n]+)`", prose)]


def _argv(command: str, port: int | None = None) -> list[str]:
    """The command as it is run here: substitutions applied, the program mapped to this interpreter."""
    extra, _why = SMALLEST.get(command, ("", ""))
    if isinstance(extra, dict):
        for placeholder, value in extra.items():
            word = rf"(?<![\w]){re.escape(placeholder)}(?![\w])"  # N, not the N of NODE
            assert re.search(word, command), f"placeholder {placeholder} is not in {command!r}"
            command = re.sub(word, value.format(port=port), command)
    elif extra:
        command = f"{command} {extra}"
    words = shlex.split(command)
    return words if words[0] == "lslm" else PROGRAMS[words[0]] + words[1:]


# -- running ----------------------------------------------------------------------------------
@pytest.fixture()
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary working folder; subprocesses find lslm even when it is not installed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LSLM_LAUNCHER", raising=False)  # as a learner runs them: through torchrun
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    yield tmp_path


def _run_lslm(argv: list[str]) -> tuple[int, str]:
    """``lslm ARGS`` through the console script's entry point; exit status and standard output."""
    from lslm.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            rc = main(argv[1:])
        except SystemExit as exc:  # --help, or an argparse error
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, out.getvalue()


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


def _last_json(stdout: str) -> list[dict]:
    """The JSON list ``lslm launch`` prints after the ranks' streamed lines."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "[")
    return json.loads("\n".join(lines[start:]))


# -- the tests ---------------------------------------------------------------------------------
def test_every_readme_command_is_accounted_for() -> None:
    commands = shell_commands(README.read_text())
    tables = {"AS_WRITTEN": AS_WRITTEN, "SMALLEST": set(SMALLEST), "SKIP": set(SKIP)}
    for command in commands:
        owners = [name for name, table in tables.items() if command in table]
        assert len(owners) == 1, (f"README command {command!r} must be in exactly one of AS_WRITTEN, SMALLEST, "
                                  f"SKIP of this test (found in {owners or 'none'})")
    stale = set().union(*tables.values()) - set(commands)
    assert not stale, f"no longer in README.md, remove from this test: {sorted(stale)}"
    assert all(why for _extra, why in SMALLEST.values()) and all(SKIP.values()), "every decision says why"


def test_inline_commands_are_fenced_or_listed() -> None:
    text = README.read_text()
    fenced = shell_commands(text)
    loose = {span for span in _inline_code(text) if span.startswith(_COMMAND_WORDS)
             and not any(command.startswith(span) for command in fenced)}
    assert loose <= set(INLINE_MENTIONS), (f"inline commands neither in a fenced block nor in INLINE_MENTIONS: "
                                           f"{sorted(loose - set(INLINE_MENTIONS))}")
    assert set(INLINE_MENTIONS) <= set(_inline_code(text)), "stale INLINE_MENTIONS"


def test_readme_package_table_names_every_package() -> None:
    table = next(body for lang, body in fenced_blocks(README.read_text()) if "lslm/runtime/" in body)
    packages = sorted(p.parent.name for p in (ROOT / "lslm").glob("*/__init__.py"))
    missing = [name for name in packages if f"lslm/{name}/" not in table]
    assert not missing, f"README's package table misses: {missing}"
    listed = re.findall(r"^lslm/(\w+)/", table, re.MULTILINE)
    assert set(listed) <= set(packages), f"README lists packages that do not exist: {set(listed) - set(packages)}"


def test_lslm_console_script_is_lslm_cli_main() -> None:
    assert 'lslm = "lslm.cli:main"' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("command", [c for c in SKIP if c.startswith("make ")])
def test_make_commands_name_existing_targets(command: str) -> None:
    # -n prints what make would do without doing it: an unknown target fails here.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under make test
    out = subprocess.run(["make", "-n", *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr


def test_launch_smoke_as_written(in_tmp: Path) -> None:
    rc, out = _run_lslm(shlex.split(LAUNCH_SMOKE))
    assert rc == 0, out
    results = _last_json(out)
    assert [r["rank"] for r in results] == [0, 1, 2, 3] and all(r["ok"] for r in results)


def test_help_commands_as_written(in_tmp: Path) -> None:
    rc, out = _run_lslm(shlex.split("lslm launch --help"))
    assert rc == 0 and "examples:" in out
    assert LAUNCH_SMOKE in out  # the help's first example is the README's command
    rc, out = _run_lslm(shlex.split("lslm bench ddp --help"))
    assert rc == 0 and "--bucket-mb" in out and "--sweep-mb" in out
    assert "--repeats" not in out and "--sizes-kib" not in out  # only ddp's own options


def test_plan_commands_as_written(in_tmp: Path) -> None:
    rc, out = _run_lslm(shlex.split(PLAN))
    assert rc == 0 and "-- roofline" in out, out
    rc, out = _run_lslm(shlex.split(PLAN_SEARCH))
    assert rc == 0 and "fastest layouts that fit" in out, out


def test_gpu_check_dry_run_as_written(in_tmp: Path) -> None:
    rc, out = _run_lslm(shlex.split(GPU_CHECK_DRY_RUN))
    assert rc == 0 and "lslm gpu-check: OK" in out, out
    assert len(list((in_tmp / "runs" / "gpu-check").glob("gpu-check_dry-run_*.json"))) == 1


def test_python_block(in_tmp: Path) -> None:
    (code,) = [body for lang, body in fenced_blocks(README.read_text()) if lang == "python"]
    for old, (new, _why) in PYTHON_SUBSTITUTION.items():
        assert old in code
        code = code.replace(old, new)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own snippet
    assert [r["rank"] for r in scope["results"]] == [0, 1] and all(r["ok"] for r in scope["results"])


def test_recipes_smallest(in_tmp: Path) -> None:
    out = _run(_argv(TRAIN), in_tmp)  # first and alone: it fills the corpus cache the launches then read
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(json.loads((in_tmp / "runs" / "baseline.json").read_text())["losses"]) == 2
    # The launches are independent (each on a free port, none writes a file): two at a time, so that one's
    # single-process phases (its interpreter starting, torchrun's agent starting) overlap the other's ranks.
    commands = (DDP, TORCHRUN_DDP, TP, PP, ZERO, THREE_D)
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(lambda command: _run(_argv(command), in_tmp), commands))
    for command, out in zip(commands, outs):
        assert out.returncode == 0, f"{command}\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("name", ["collectives", "launch", "ddp", "tp", "pipeline", "zero"])
def test_bench_smallest(name: str, in_tmp: Path) -> None:
    rc, out = _run_lslm(_argv(f"lslm bench {name}"))
    assert rc == 0, out
    stem = {"launch": "launch_overhead"}.get(name, name)
    for suffix in ("txt", "json", "png"):
        assert (in_tmp / "bench" / "results" / f"{stem}.{suffix}").is_file()


def test_multi_node_line_on_two_local_nodes(in_tmp: Path) -> None:
    (in_tmp / "args.json").write_text("{}")  # the README's example arguments
    argv = _argv(MULTI_NODE, port=free_port())
    nodes = [subprocess.Popen(argv, cwd=in_tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)[-4000:]
    results = [json.loads((in_tmp / "results" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in results] == [2, 2] and all(r["ok"] for r in results)
    assert sorted(r["node_rank"] for r in results) == [0, 1]  # one rank per "node"
