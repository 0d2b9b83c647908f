"""lslm.harness: what every recipe and every benchmark shares.

* :mod:`~lslm.harness.config_cli` - config dataclasses: field checks and a command line generated from the fields;
* :mod:`~lslm.harness.timer` - a step timer that is right on CPU and on CUDA (events, or synchronise);
* :mod:`~lslm.harness.recipe` - ``build(cfg, ctx) -> Built`` and the training loop that times, counts and reports it;
* :mod:`~lslm.harness.entry` - one rank under torchrun, several runs in one job, or a launch from a notebook;
* :mod:`~lslm.harness.bench_runner` - variants interleaved, critical path over ranks, medians;
* :mod:`~lslm.harness.throughput` - tokens/s, TFLOP/s, MFU and HFU of a timed step (recipes and benches);
* :mod:`~lslm.harness.report` - the one writer of a bench's ``.txt`` (what it printed), ``.json`` and ``.png``.
"""

from lslm.harness.bench_runner import Timing, Variant, critical_path, gather_ranks, run_variants
from lslm.harness.config_cli import check_fields, config_parser, option, parse_config
from lslm.harness.entry import (
    Recipe,
    add_trace_option,
    entry_points,
    launch_recipe,
    recipe_main,
    run_in_context,
    run_many,
    run_or_launch,
    run_rank,
)
from lslm.harness.recipe import (
    REPORT_LABEL,
    Built,
    gather_summaries,
    summarize,
    train_loop,
    write_run_log,
)
from lslm.harness.report import Report
from lslm.harness.throughput import step_throughput, throughput_lines
from lslm.harness.timer import Marks, StepTimer, timer_mode

__all__ = [
    "REPORT_LABEL", "Built", "Marks", "Recipe", "Report", "StepTimer", "Timing", "Variant", "add_trace_option",
    "check_fields", "config_parser", "critical_path", "entry_points", "gather_ranks", "gather_summaries",
    "launch_recipe", "option", "parse_config", "recipe_main", "run_in_context", "run_many", "run_or_launch", "run_rank",
    "run_variants", "step_throughput", "throughput_lines",
    "summarize", "timer_mode", "train_loop", "write_run_log",
]
