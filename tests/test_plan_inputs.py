"""Bad input to the calculator: each case refused with a ValueError naming the argument, before any work.

In process and cheap: the command line through ``lslm.cli.main`` (argparse's error: exit code 2, a message, no
traceback), the dataclasses directly. ``lslm.plan.estimate`` and ``search`` are replaced by functions that fail,
so a case that reached them (did work before refusing) fails the test.
"""

from __future__ import annotations

import math

import pytest

from lslm.cli import main
from lslm.plan import Hardware, Layout, Link, hardware_presets, model_presets
from lslm.plan import cli as plan_cli
from lslm.plan.search import why_none_fit

LLAMA = ["plan", "--model", "llama3-8b"]


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calculator's work, replaced: a refused input must never reach it."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the calculator ran before the input was refused")

    monkeypatch.setattr(plan_cli, "estimate", fail)
    monkeypatch.setattr(plan_cli, "search", fail)


@pytest.mark.parametrize(("argv", "message"), [
    (LLAMA + ["--devices", "8", "--tp", "0"], "--tp must be an int >= 1, got 0"),
    (LLAMA + ["--devices", "-8"], "--devices must be an int >= 1, got -8"),
    (LLAMA + ["--devices", "8", "--search", "--top", "0"], "--top must be an int >= 1"),
    (LLAMA + ["--devices", "8", "--search", "--search-cp", "0"], "--search-cp sizes must be ints >= 1"),
    (["plan", "--model", "gpt3-175b", "--devices", "1", "--hbm-gb", "inf"], "--hbm-gb must be a finite number > 0"),
    (LLAMA + ["--devices", "8", "--hbm-gb", "nan"], "--hbm-gb must be a finite number > 0"),
    (LLAMA + ["--devices", "8", "--peak-tflops", "inf"], "--peak-tflops must be a finite number > 0, got inf"),
    (LLAMA + ["--devices", "8", "--peak-tflops", "0"], "--peak-tflops must be a finite number > 0"),
    (LLAMA + ["--devices", "8", "--intra-gbps", "inf"], "--intra-gbps must be a finite number > 0"),
    (LLAMA + ["--devices", "8", "--inter-alpha-us", "-1"], "--inter-alpha-us must be a finite number >= 0"),
    (LLAMA + ["--devices", "8", "--efficiency", "1.5"], "--efficiency is the fraction of peak reached"),
    (["plan", "--layers", "100000", "--hidden", "1024", "--heads", "16", "--vocab", "50304", "--seq", "2048"],
     "(--layers 100000 --hidden 1024 --heads 16 --vocab 50304) take 2.52 TB as bf16 weights alone"),
    (["plan", "--model", "gpt3-175b", "--devices", "1"], "no layout fits. Give at least 5 devices"),
    (["plan", "--model", "gpt3-175b", "--devices", "2", "--search"], "(--model gpt3-175b)"),
])
def test_cli_refuses_with_the_flag_named(argv: list[str], message: str, no_work: None,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.startswith("usage: lslm plan")


H100 = hardware_presets()["h100-sxm"]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Layout(bucket_mb=math.inf), "Layout.bucket_mb must be finite and > 0"),
    (lambda: Layout(dp=-8), "Layout.dp must be an int >= 1"),
    (lambda: Hardware("x", {"bf16": math.inf}), "Hardware.peak_flops['bf16'] must be finite and > 0"),
    (lambda: Hardware("x", hbm_bytes=math.inf), "Hardware.hbm_bytes must be finite and > 0"),
    (lambda: Hardware("x", optimizer_Bps=math.inf), "Hardware.optimizer_Bps must be finite and > 0"),
    (lambda: Link(1e-6, math.inf), "Link.bandwidth_Bps must be finite and > 0"),
])
def test_dataclasses_refuse_non_finite_values(build: object, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        build()  # type: ignore[operator]
    assert message in str(exc.value)


@pytest.mark.parametrize(("devices", "says"), [
    (7, "dp = devices / (tp x cp x pp) in {7}, and no dp x micro-batch"),
    (100_000, "in {3125, 6250, 12500, 25000, 50000, 100000}, and no dp x micro-batch"),
])
def test_search_that_finds_nothing_says_the_batch_does_not_divide(devices: int, says: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(LLAMA + ["--devices", str(devices), "--search", "--flash"]) == 1
    out = capsys.readouterr().out
    assert "global batch of 512 sequences" in out and says in out, out


def test_search_over_memory_names_the_closest_layout() -> None:
    model = model_presets()["gpt3-175b"]
    why = why_none_fit(model, H100, 8)
    assert why.startswith("every one of the 480 layouts that run is over memory; the closest, dp 1 x tp 8 x pp 1")
    assert "needs 394.49 GB on its most loaded device, 83.75 GB usable" in why
