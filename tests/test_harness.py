"""lslm.harness: configs and their command line, the step timer, the training loop, the run log, the writer.

Pure unit tests: no process is started. The two tests that need a process group run a
one-rank gloo world inside the test process. Timings are never asserted; the timer is
driven by a fake clock where its numbers matter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import pytest
import torch

from lslm.harness import (
    Built,
    Marks,
    Recipe,
    Report,
    StepTimer,
    check_fields,
    config_parser,
    option,
    parse_config,
    run_or_launch,
    summarize,
    timer_mode,
    train_loop,
)
from lslm.harness import entry as harness_entry


@dataclass
class Demo:
    """A config with every supported field kind."""

    steps: int = option(3, help="how many steps", ge=1)
    lr: float = option(0.5, help="learning rate", gt=0)
    name: str = option("x", help="a name")
    out: str | None = option(None, help="where to write")
    fast: bool = option(False, help="go fast")
    careful: bool = True
    mode: Literal["a", "b"] = "a"
    kind: str = option("red", choices=("red", "blue"), help="a colour")
    log_every: int = 1
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_fields(self)


# -- configs and their command line ------------------------------------------------------
def test_parser_types_bools_choices_and_help() -> None:
    parser = config_parser(Demo, prog="demo")
    ns = parser.parse_args(["--steps", "7", "--lr", "1e-3", "--name", "y", "--out", "o.json", "--fast",
                            "--no-careful", "--mode", "b", "--kind", "blue"])
    assert vars(ns) == dict(steps=7, lr=1e-3, name="y", out="o.json", fast=True, careful=False, mode="b",
                            kind="blue", log_every=1, seed=0, device="cpu")
    assert vars(parser.parse_args([])) == vars(parser.parse_args([])) and parser.parse_args([]).out is None
    text = parser.format_help()
    assert "--log-every" in text and "how many steps (default: 3)" in text and "--no-fast" in text
    for bad in (["--mode", "c"], ["--kind", "green"], ["--steps", "1.5"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_parse_config_returns_the_config_and_extra_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="demo")
    parser.add_argument("--nproc", type=int, default=2)
    cfg, extra = parse_config(Demo, ["--steps", "4", "--nproc", "3"], parser=parser)
    assert cfg == Demo(steps=4) and extra == {"nproc": 3}
    with pytest.raises(SystemExit) as info:  # the config's own check, as an argparse error
        parse_config(Demo, ["--lr", "-1"], prog="demo")
    assert info.value.code == 2 and "Demo.lr must be > 0, got -1.0" in capsys.readouterr().err


def test_check_fields_names_the_field() -> None:
    for kwargs, match in ((dict(steps=0), r"Demo.steps must be >= 1"), (dict(steps=True), "steps must be of type int"),
                          (dict(steps=2.0), "steps must be of type int"), (dict(lr="1"), "lr must be of type float"),
                          (dict(mode="c"), "unknown mode 'c'"), (dict(kind="green"), r"unknown kind 'green'; expected"),
                          (dict(name=None), "name must be of type str, got None"), (dict(fast=1), "Demo.fast")):
        with pytest.raises(ValueError, match=match):
            Demo(**kwargs)
    assert Demo(lr=2, out="x").lr == 2  # an int is a fine float; None or str for `str | None`


def test_unsupported_field_type_is_a_type_error() -> None:
    @dataclass
    class Bad:
        sizes: list[int] | None = None

    with pytest.raises(TypeError, match="unsupported config field type"):
        config_parser(Bad)


def test_recipe_configs_generate_their_command_lines() -> None:
    from lslm.data_parallel.ddp import VARIANTS
    from lslm.recipes.ddp import DDPConfig
    from lslm.recipes.train import TrainConfig

    ns = config_parser(DDPConfig).parse_args(["--variant", "fused", "--record-timeline", "--no-record-timeline",
                                              "--batch-size", "4", "--bucket-cap-mb", "0.5"])
    assert (ns.variant, ns.record_timeline, ns.batch_size, ns.bucket_cap_mb) == ("fused", False, 4, 0.5)
    assert "{" + ",".join(VARIANTS) + "}" in config_parser(DDPConfig).format_help()
    with pytest.raises(SystemExit):
        config_parser(DDPConfig).parse_args(["--variant", "nope"])
    with pytest.raises(ValueError, match="TrainConfig.batch_size must be >= 1"):
        TrainConfig(batch_size=0)


# -- the step timer ----------------------------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_timer_marks_on_a_fake_clock() -> None:
    clock = FakeClock()
    timer = StepTimer("cpu", clock=clock)
    assert timer.mode == "host"
    timer.start()
    clock.t += 0.25
    timer.mark("forward_end")
    clock.t += 0.5
    timer.mark("forward_end")  # marked again (e.g. per micro-batch): the later one counts
    clock.t += 1.0
    m = timer.stop()
    assert list(m.times) == ["start", "forward_end", "end"]
    assert (m["start"], m.span("start", "forward_end"), m.total) == (100.0, 0.75, 1.75)
    with pytest.raises(RuntimeError):
        timer.mark("x")  # stopped
    timer.start()
    with pytest.raises(ValueError, match="set by start"):
        timer.mark("end")
    assert isinstance(timer.stop(), Marks)


def test_timer_never_touches_cuda_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: object, **k: object) -> None:
        raise AssertionError("torch.cuda used on the CPU path")

    for name in ("synchronize", "Event", "current_stream", "is_available"):
        monkeypatch.setattr(torch.cuda, name, boom)
    for mode in ("auto", "host", "sync", "events"):
        assert timer_mode("cpu", mode) == "host"
        timer = StepTimer(torch.device("cpu"), mode=mode)
        timer.start()
        timer.mark("a")
        assert timer.stop().total >= 0
    assert timer_mode("cuda:0") == "events" and timer_mode("cuda:0", "sync") == "sync"
    with pytest.raises(ValueError, match="timer mode"):
        timer_mode("cpu", "fast")


# -- the training loop -------------------------------------------------------------------
def _linear_technique(cfg: Demo, ctx: object = None, clock: FakeClock | None = None) -> Built:
    torch.manual_seed(cfg.seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(1)

    def batches():
        while True:
            x = torch.randn(8, 4, generator=gen)
            yield x, x.sum(1, keepdim=True)

    def step(batch, timer: StepTimer) -> torch.Tensor:
        if clock is not None:
            clock.t += 0.002
        loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
        timer.mark("forward_end")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if clock is not None:
            clock.t += 0.001
        return loss

    def per_step(m: Marks) -> dict[str, float]:
        return {"compute_s": m.span("start", "forward_end")}

    return Built(model, opt, step, batches(), torch.device("cpu"), per_step=per_step, info={"answer": 42},
                 log=lambda now: f"  compute {now['compute_s']:.3f}")


def test_train_loop_serial_record_and_summary(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lslm.harness import recipe as R
    from lslm.harness import write_run_log

    clock = FakeClock()
    monkeypatch.setattr(R, "StepTimer", lambda device: StepTimer(device, clock=clock))
    cfg = Demo(steps=5, lr=0.1)
    rec = train_loop(cfg, _linear_technique(cfg, clock=clock))
    assert rec["losses"] == rec["local_losses"] and len(rec["losses"]) == 5 and rec["losses"][-1] < rec["losses"][0]
    assert rec["step_s"] == pytest.approx([0.003] * 5) and rec["compute_s"] == pytest.approx([0.002] * 5)
    assert (rec["num_parameters"], rec["world_size"], rec["rank"], rec["answer"]) == (5, 1, 0, 42)
    assert rec["memory"]["model_state"]["params"] == 5 * 4 and rec["config"]["steps"] == 5
    s = summarize(rec)
    assert s["step_ms"] == pytest.approx(3.0) and s["compute_ms"] == pytest.approx(2.0) and s["peak_rss_mib"] > 0
    write_run_log(tmp_path / "log.json", rec, [{**s, "rank": 0}])
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["losses"] == rec["losses"] and log["ranks"][0]["rank"] == 0 and "local_losses" not in log
    # Bitwise reproducible: the same config trains the same losses.
    assert train_loop(cfg, _linear_technique(cfg))["losses"] == rec["losses"]


def test_serial_baseline_runs_on_the_harness(capsys: pytest.CaptureFixture[str]) -> None:
    from lslm.metrics.flops import gpt_step_flops
    from lslm.recipes.train import TrainConfig, train

    cfg = TrainConfig(steps=2, n_layer=1, batch_size=2, block_size=16)
    rec = train(cfg)
    assert rec["step_times_s"] == rec["step_s"] and len(rec["losses"]) == 2 and rec["tokens_per_step"] == 32
    # The harness's throughput line: tokens/s, achieved TFLOP/s, MFU against the CPU's measured matmul rate, or on a
    # GPU (the baseline picks cuda:0 where there is one: make gpu-check runs this file there) the datasheet peak.
    line = next(x for x in capsys.readouterr().out.splitlines() if "throughput (train, median step)" in x)
    peak_source = "fp32 matmul measured" if rec["device"].startswith("cpu") else "datasheet peak"
    for field in ("tokens/s ", " TFLOP/s achieved", ", MFU ", peak_source):
        assert field in line, line
    tp = rec["throughput"]
    assert tp["devices"] == 1 and tp["mfu"] == gpt_step_flops(cfg.model_config(), 2).model / (
        tp["step_s"] * tp["peak_flops"])


@pytest.fixture
def one_rank_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from lslm.runtime.startup import free_port

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LSLM_DEVICE", "cpu")
    monkeypatch.setenv("LSLM_BACKEND", "gloo")


def _at_most_two(cfg: Demo, world_size: int) -> None:
    if world_size > 2:
        raise ValueError("too many processes")


_FAKE = Recipe("tests.test_harness", Demo, _linear_technique, check=_at_most_two)


def test_run_or_launch_runs_this_rank_under_torchrun(one_rank_torchrun_env: None, tmp_path) -> None:
    cfg = Demo(steps=3, out=str(tmp_path / "run.json"))
    [rec] = run_or_launch(_FAKE, cfg, nproc=8)  # nproc is ignored: torchrun's world size counts
    assert rec["backend"] == "gloo" and rec["world_size"] == 1 and len(rec["losses"]) == 3
    assert rec["losses"] == pytest.approx(rec["local_losses"])  # one rank: the all-reduced mean is its own loss
    log = json.loads((tmp_path / "run.json").read_text())  # rank 0 wrote every rank's summary
    assert [r["rank"] for r in log["ranks"]] == [0] and log["ranks"][0]["step_ms"] > 0


def test_run_or_launch_launches_outside_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    calls = []
    monkeypatch.setattr(harness_entry, "launch_recipe", lambda recipe, nproc, **kw: calls.append((nproc, kw)) or [])
    run_or_launch(_FAKE, Demo(steps=2), nproc=2)
    assert calls == [(2, {**Demo(steps=2).__dict__})]
    with pytest.raises(ValueError, match="too many processes"):  # checked before anything starts
        run_or_launch(_FAKE, Demo(), nproc=3)


# -- the writer --------------------------------------------------------------------------
def test_report_writes_txt_json_png_together(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    def plot(data: dict, path) -> None:
        path.write_bytes(b"png:" + json.dumps(data, sort_keys=True).encode())

    with Report("demo", tmp_path / "out") as report:
        report.print("\n== table ==")
        report.print("a  1")
        report.write({2: {"x": 1.5}}, plot)
        report.print("last line")
    printed = capsys.readouterr().out
    out = tmp_path / "out"
    assert (out / "demo.txt").read_text() == printed
    assert printed.splitlines()[-2] == f"wrote {out / 'demo.txt'}, {out / 'demo.json'} and {out / 'demo.png'}"
    assert json.loads((out / "demo.json").read_text()) == {"2": {"x": 1.5}}
    assert (out / "demo.png").read_bytes().startswith(b"png:")
    with Report("none", None) as report:  # print only
        report.write({1: 2}, plot)
        report.print("x")
    assert capsys.readouterr().out == "x\n" and not (tmp_path / "none.txt").exists()
    with pytest.raises(KeyError), Report("failed", tmp_path) as report:
        report.print("half a table")
        raise KeyError("bench failed")
    assert not (tmp_path / "failed.txt").exists()  # a failed bench keeps the previous results
