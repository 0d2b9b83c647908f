"""The ``lslm`` command line: its help, and bad input refused before any process starts (no launch here)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from lslm.bench import checks
from lslm.bench.cli import BENCH_OPTIONS
from lslm.cli import main

launch_module = importlib.import_module("lslm.launcher.launch")  # the attribute of that name is the function


@pytest.fixture()
def no_launch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace the launcher: a call is recorded (and returns one fake result); tests assert none happened."""
    calls: list[Any] = []

    def fake(target: Any, **kw: Any) -> list[dict[str, Any]]:
        calls.append((target, kw))
        return [{"ok": True}]

    # Import launch_overhead before patching: imported after, it would bind the fake as its `launch`, and
    # monkeypatch would then "restore" the fake there, leaking it into later tests (lslm bench launch).
    from lslm.bench import launch_overhead

    monkeypatch.setattr(launch_module, "launch", fake)
    monkeypatch.setattr(launch_overhead, "launch", fake)
    return calls


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# -- lslm bench -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "launch", "--nprocs", "0"], "argument --nprocs: must be an integer >= 1, got 0"),
    (["bench", "collectives", "--nprocs", "-2"], "argument --nprocs: must be an integer >= 1, got -2"),
    (["bench", "ddp", "--nprocs", "1"], "must be an integer >= 2 (data parallelism needs peers), got 1"),
    (["bench", "ddp", "--nprocs", "two"], "argument --nprocs: expected an integer, got 'two'"),
    (["bench", "ddp", "--nprocs", "2", "2"], "world sizes (nprocs) must not repeat"),
    (["bench", "launch", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["bench", "collectives", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["bench", "ddp", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["bench", "collectives", "--sizes-kib", "4", "-4"], "argument --sizes-kib: must be an integer >= 1, got -4"),
    (["bench", "collectives", "--sizes-kib", "0"], "argument --sizes-kib: must be an integer >= 1, got 0"),
    (["bench", "ddp", "--bucket-mb", "-1"], "argument --bucket-mb: must be a finite number of MiB > 0, got -1"),
    (["bench", "ddp", "--sweep-mb", "1", "0"], "argument --sweep-mb: must be a finite number of MiB > 0, got 0"),
    (["bench", "ddp", "--bucket-mb", "nan"], "must be a finite number of MiB > 0"),
    (["bench", "ddp", "--repeats", "3"], "--repeats is an option of `lslm bench launch / collectives / pipeline / cp`, "
                                         "not of `lslm bench ddp`"),
    (["bench", "launch", "--quick"], "--quick is an option of `lslm bench ddp / tp / pipeline / zero / cp`, "
                                     "not of `lslm bench launch`"),
    (["bench", "launch", "--device", "cpu"], "--device is an option of `lslm bench collectives / ddp / tp / "
                                             "pipeline / zero / cp`"),
    (["bench", "collectives", "--steps", "2"], "--steps is an option of `lslm bench ddp / tp / zero`"),
    (["bench", "launch", "--frobnicate"], "unknown option --frobnicate for `lslm bench launch`"),
    (["bench", "ddp", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["bench", "tp", "--nprocs", "1"], "must be an integer >= 2 (tensor parallelism needs peers), got 1"),
    (["bench", "tp", "--nprocs", "3"], "n_head=8 does not split over tp=3"),
    (["bench", "ddp", "--no-sp"], "--no-sp is an option of `lslm bench tp`, not of `lslm bench ddp`"),
    (["bench"], "required: {launch,collectives,ddp,tp,pipeline,zero,cp}"),
    (["bench", "cp", "--nprocs", "1"], "must be an integer >= 2 (context parallelism needs peers), got 1"),
    (["bench", "cp", "--nprocs", "3"], "sequence length 1024 is not divisible by 2·cp = 6"),
    (["bench", "cp", "--nprocs", "16"], "n_head = 8 is not divisible by cp = 16"),
    (["bench", "cp", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got 0"),
    (["bench", "cp", "--steps", "2"], "--steps is an option of `lslm bench ddp / tp / zero`, not of `lslm bench cp`"),
    (["bench", "zero", "--nprocs", "1"], "must be an integer >= 2 (ZeRO partitions over data-parallel peers), got 1"),
    (["bench", "zero", "--entries", "deepspeed"], "unknown entries ['deepspeed']"),
    (["bench", "pipeline", "--nprocs", "1"], "must be an integer >= 2 (a pipeline needs at least two stages), got 1"),
    (["bench", "pipeline", "--microbatches", "0"], "argument --microbatches: must be an integer >= 1, got 0"),
    (["bench", "pipeline", "--steps", "2"], "--steps is an option of `lslm bench ddp / tp / zero`, not of "
                                            "`lslm bench pipeline`"),
])
def test_bench_refuses_bad_settings_before_any_launch(argv: list[str], message: str, no_launch: list[Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(argv, capsys)
    assert message in err, err
    assert err.startswith("usage: lslm bench")  # the bench's own usage line, not the generic one
    assert no_launch == []


def test_each_bench_help_lists_its_own_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert BENCH_OPTIONS["ddp"] == {"--nprocs", "--steps", "--quick", "--bucket-mb", "--sweep-mb", "--out",
                                    "--device", "--trace"}
    assert BENCH_OPTIONS["launch"] == {"--nprocs", "--repeats", "--out"}
    assert BENCH_OPTIONS["collectives"] == {"--nprocs", "--sizes-kib", "--repeats", "--out", "--device", "--trace"}
    assert BENCH_OPTIONS["tp"] == {"--nprocs", "--steps", "--quick", "--no-sp", "--out", "--device", "--trace"}
    assert BENCH_OPTIONS["cp"] == {"--nprocs", "--repeats", "--quick", "--out", "--device", "--trace"}
    assert BENCH_OPTIONS["pipeline"] == {"--nprocs", "--microbatches", "--repeats", "--warmup", "--quick", "--out",
                                         "--device", "--n-embd", "--batch", "--trace"}
    every = set().union(*BENCH_OPTIONS.values())
    for name, own in BENCH_OPTIONS.items():
        with pytest.raises(SystemExit) as exc:
            main(["bench", name, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        assert text.startswith(f"usage: lslm bench {name}") and f"lslm bench {name} " in text  # an example
        assert all(opt in text for opt in own), name
        assert not any(opt in text for opt in every - own), name
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(f"    {name} " in text for name in BENCH_OPTIONS)


def test_bench_python_api_checks_before_any_launch(no_launch: list[Any]) -> None:
    from lslm.bench import collectives, ddp, launch_overhead

    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        launch_overhead.measure((2,), repeats=0)
    with pytest.raises(ValueError, match="world sizes"):
        launch_overhead.measure((0,))
    with pytest.raises(ValueError, match="nprocs is empty"):
        collectives.run((), out_dir=None)
    with pytest.raises(ValueError, match=r"message sizes \(bytes\) must be an integer >= 1, got -4"):
        collectives.run((2,), sizes=(-4,), out_dir=None)
    with pytest.raises(ValueError, match="sizes is empty"):
        collectives.run((2,), sizes=(), out_dir=None)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        collectives.run((2,), sizes=(4096,), repeats=0, out_dir=None)
    with pytest.raises(ValueError, match="steps must be an integer >= 1, got 0"):
        ddp.run((2,), quick=True, steps=0, out_dir=None)
    with pytest.raises(ValueError, match="warmup must be an integer >= 0, got -1"):
        ddp.run((2,), quick=True, warmup=-1, out_dir=None)
    with pytest.raises(ValueError, match=r"data parallelism needs peers"):
        ddp.run((1, 2), quick=True, out_dir=None)
    assert no_launch == []


def test_checks_helpers() -> None:
    assert checks.world_sizes([2, 4]) == (2, 4)
    assert checks.at_least("steps", 3, 1) == 3
    for bad in (True, 1.5, "2", 0):
        with pytest.raises(ValueError, match="steps must be an integer >= 1"):
            checks.at_least("steps", bad, 1)
    with pytest.raises(ValueError, match=r"integers >= 2 \(why\), got 1"):
        checks.world_sizes([1], 2, "why")


# -- lslm launch -------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["launch", "pkg.mod:fn", "--nproc", "4", "numel=1024", "tag=x"],
    ["launch", "pkg.mod:fn", "numel=1024", "--nproc", "4", "tag=x"],
    ["launch", "--nproc", "4", "pkg.mod:fn", "numel=1024", "tag=x"],
    ["launch", "pkg.mod:fn", "numel=1024", "tag=x", "--nproc=4"],
])
def test_launch_takes_options_before_or_after_worker_arguments(argv: list[str], no_launch: list[Any],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    ((target, kw),) = no_launch
    assert target == "pkg.mod:fn" and kw["nproc"] == 4 and kw["numel"] == 1024 and kw["tag"] == "x"
    assert '"ok": true' in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["launch", "pkg.mod:fn", "--nprocs", "4"], "unknown option '--nprocs' (options: --help, --nproc"),
    (["launch", "pkg.mod:fn", "numel"], "worker argument 'numel' is not key=value"),
    (["launch", "pkg.mod:fn", "n=1", "n=2"], "worker argument 'n' is given twice"),
    (["launch", "pkg.mod:fn", "1n=1"], "'1n' is not a Python parameter name"),
    (["launch", "numel=3", "pkg.mod:fn"], "the target ('package.module:function') comes before"),
    (["launch", "pkg.mod:fn", "--output", "some"], "argument --output: invalid choice"),
    (["doctor", "--verbose"], "unrecognized arguments: --verbose"),
])
def test_launch_refuses_bad_command_lines(argv: list[str], message: str, no_launch: list[Any],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(argv, capsys)
    assert message in err, err
    assert err.startswith(f"usage: lslm {argv[0]}")
    assert no_launch == []


def test_launch_help_explains_and_shows_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["launch", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "key=value" in text and "options may come before or" in text and "examples:" in text
    for help_text in ("processes per node", "torchrun agents", "seconds before every rank is stopped",
                      "whose printed lines", "sets LSLM_DEVICE", "sets LSLM_BACKEND"):  # every option explained
        assert help_text in " ".join(text.split()), help_text


def test_bench_pipeline_width_and_batch_reach_the_bench(monkeypatch) -> None:
    from lslm.bench import pipeline

    seen: dict = {}
    monkeypatch.setattr(pipeline, "run", lambda *a, **kw: seen.update(args=a, **kw))
    main(["bench", "pipeline", "--nprocs", "2", "--microbatches", "8", "--n-embd", "256", "--batch", "32"])
    assert seen["args"] == ((2,), (8,)) and seen["batch"] == 32
    assert seen["model"] == dict(pipeline.BENCH_MODEL, n_embd=256)
    main(["bench", "pipeline", "--nprocs", "2"])
    assert seen["model"] is None and seen["batch"] is None  # the bench's own defaults


# -- lslm plan ---------------------------------------------------------------------------------------
def test_plan_prints_the_traced_table_and_searches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gpt3-175b", "--devices", "1024", "--tp", "8", "--pp", "8", "--zero", "1",
                 "--sp", "--recompute", "selective"]) == 0
    out = capsys.readouterr().out
    assert "dp 16 x tp 8 x pp 8, ZeRO-1, SP, recompute selective" in out  # dp derived from --devices
    for section in ("-- parameters", "-- memory", "-- communication", "-- time", "-- roofline"):
        assert section in out, section
    assert "Korthikanti" in out and "ZeRO §5.4" in out  # every number names its source
    assert "link 450 GB/s, alpha 5 µs" in out  # the preset's NVLink for tp
    main(["plan", "--model", "gpt3-175b", "--devices", "1024", "--tp", "8", "--pp", "8", "--intra-gbps", "100",
          "--intra-alpha-us", "2"])
    assert "link 100 GB/s, alpha 2 µs" in capsys.readouterr().out
    assert main(["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000", "--seq", "128",
                 "--global-batch", "16", "--devices", "4", "--search", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "the 2 fastest layouts that fit" in out and "  1. dp " in out and "  2. dp " in out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "examples:" in text and "lslm plan --model llama3-8b --devices 8 --search --flash" in text
    for option in ("--model", "--hardware", "--peak-tflops", "--devices", "--zero", "--sp", "--recompute",
                   "--search", "--flash", "--validate", "--results"):
        assert option in text, option


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "--model", "gpt3-175b", "--devices", "1024", "--tp", "3"], "not a multiple of tp x pp x cp = 3"),
    (["plan", "--model", "gpt3-175b", "--dp", "2", "--tp", "5"], "heads must split evenly over tp=5"),
    (["plan", "--model", "gpt3-175b", "--dp", "2", "--devices", "8"], "= 2 devices, but 8 were given"),
    (["plan", "--layers", "4"], "give --model PRESET or the model's shape: missing --hidden --heads --vocab --seq"),
    (["plan", "--model", "llama3-8b", "--search"], "--search needs --devices"),
    (["plan", "--model", "gpt2-small", "--sp"], "needs tp > 1"),
    (["plan", "--model", "gpt2-small", "--hardware", "cpu-box"], "no compute rate for bf16"),
    (["plan", "--model", "gpt2-small", "--zero", "4"], "argument --zero: invalid choice"),
    (["plan", "--model", "gpt2-small", "--inter-gbps", "0"], "--inter-gbps must be a finite number > 0"),
    (["plan", "--model", "gpt2-small", "--results", "bench/results"], "--results goes with --validate"),
    (["plan", "--validate", "--results", "no/such/folder"], "lacks tp.json, pipeline.json, zero.json"),
])
def test_plan_refuses_bad_input_with_what_to_change(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(argv, capsys)
    assert message in err, err
    assert err.startswith("usage: lslm plan")
