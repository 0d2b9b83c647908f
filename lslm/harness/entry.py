"""Starting a recipe: one rank under torchrun, several runs in one job, or a launch from a shell or notebook.

A :class:`Recipe` names the module that holds the launch targets (its module-level
``worker(**cfg)`` and ``compare(runs, **common)`` call :func:`run_rank` and :func:`run_many`),
the config class, ``build`` and the world-size check. The same recipe then runs

* under torchrun: ``torchrun --nproc-per-node=4 -m lslm.recipes.ddp --steps 30``
  (:func:`run_or_launch` sees ``RANK`` in the environment and runs this rank);
* from a shell: ``python -m lslm.recipes.ddp --nproc 4 --steps 30`` (it calls :func:`lslm.launch`);
* from a notebook: ``recipe.run(4, steps=30)`` (:func:`launch_recipe`).

Settings are checked for the world size before any process starts (``ValueError``; on the
command line an argparse error).

**Traces.** Every recipe takes ``--trace DIR`` (``trace="DIR"`` from a notebook): the last two steps
run under ``torch.profiler`` and every rank writes ``DIR/<run name>-rank<r>.json``, Chrome-trace JSON
with the ledger's collectives named in it (:mod:`lslm.metrics.trace`; analyse it with
:mod:`lslm.metrics.overlap`, draw it with :func:`lslm.plot.trace.plot_trace`). It is a harness
option, not a config field: it changes what is recorded, never what is trained.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lslm.harness.config_cli import parse_config
from lslm.harness.recipe import Built, gather_summaries, summarize, train_loop, write_run_log
from lslm.runtime.context import ParallelContext
from lslm.runtime.startup import RankEnv, init_distributed

__all__ = ["Recipe", "add_trace_option", "entry_points", "launch_recipe", "recipe_main", "run_in_context", "run_many",
           "run_or_launch", "run_rank"]


@dataclass(frozen=True)
class Recipe:
    """A recipe as the harness sees it (see :mod:`lslm.harness.recipe`).

    ``module`` is the import path whose ``worker`` / ``compare`` functions are the launch
    targets; ``check(cfg, world_size)`` raises ``ValueError`` for settings that cannot run
    on ``world_size`` processes; ``grid(cfg)``, if given, returns the axis sizes the process
    group is built with (``{"tp": 2}``: :func:`~lslm.runtime.init_distributed`'s arguments;
    default: every rank data-parallel).
    """

    module: str
    config: type
    build: Callable[[Any, ParallelContext | None], Built]
    check: Callable[[Any, int], Any] | None = None
    description: str = ""
    grid: Callable[[Any], dict[str, Any]] | None = None

    def sizes(self, cfg: Any) -> dict[str, Any]:
        """The grid axis sizes for ``cfg`` (``{}``: every rank data-parallel)."""
        return self.grid(cfg) if self.grid is not None else {}

    def validate(self, cfg: Any, world_size: int) -> None:
        """Raise ``ValueError`` when ``cfg`` cannot run on ``world_size`` processes."""
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if self.check is not None:
            self.check(cfg, world_size)


def _device(cfg: Any) -> str | None:
    return None if cfg.device == "auto" else cfg.device  # "auto": init_distributed chooses (CUDA + NCCL or CPU + gloo)


def run_rank(recipe: Recipe, trace: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """One rank of a launched run: join the process group, build, train, and (rank 0) write ``cfg.out``.

    Returns this rank's record (:func:`~lslm.harness.recipe.train_loop`). With ``out`` set,
    every rank's :func:`~lslm.harness.recipe.summarize` is gathered and rank 0 writes the run log.
    With ``trace`` (a folder), every rank writes a profiler trace of the last steps there.
    """
    cfg = recipe.config(**kwargs)
    with init_distributed(**recipe.sizes(cfg), device=_device(cfg), seed=cfg.seed) as ctx:
        result = train_loop(cfg, recipe.build(cfg, ctx), ctx, trace=trace)
        if cfg.out:
            ranks = gather_summaries(ctx, summarize(result))
            if ctx.rank == 0:
                write_run_log(cfg.out, result, ranks)
        return result


def run_many(recipe: Recipe, runs: Sequence[dict[str, Any]], trace: str | None = None,
             **common: Any) -> list[dict[str, Any]]:
    """Several runs one after another in *one* process group (no start-up cost per run).

    Run ``i`` uses ``config(**common, **runs[i])``, each from the same seed; returns this
    rank's record of each run. The ledger is emptied between runs; ``out`` is ignored. The
    process group has the first run's grid; a recipe whose runs need other grids builds
    their groups inside it. With ``trace``, run ``i`` writes ``<trace>/<run name>-<i>-rank<r>.json``.
    """
    cfgs = [recipe.config(**{**common, **r, "out": None}) for r in runs]
    with init_distributed(**recipe.sizes(cfgs[0]), device=_device(cfgs[0]), seed=cfgs[0].seed) as ctx:
        return run_in_context(recipe, ctx, runs, trace=trace, **common)


def run_in_context(recipe: Recipe, ctx: ParallelContext, runs: Sequence[dict[str, Any]], trace: str | None = None,
                   **common: Any) -> list[dict[str, Any]]:
    """:func:`run_many`'s runs in a process group that is already up (``ctx``), e.g. a job that runs other
    experiments in the same processes; each run is checked for ``ctx``'s world size first. Every rank calls it.
    With ``trace`` (a folder), run ``i`` writes its profiler traces there as ``<run name>-<i>-rank<r>.json``."""
    records = []
    for i, r in enumerate(runs):
        cfg = recipe.config(**{**common, **r, "out": None})
        recipe.validate(cfg, ctx.world_size)
        ctx.comm.ledger.reset()
        built = recipe.build(cfg, ctx)
        records.append(train_loop(cfg, built, ctx, trace=trace, trace_name=f"{built.name}-{i}"))
    return records


def launch_recipe(recipe: Recipe, nproc: int, *, runs: Sequence[dict[str, Any]] | None = None,
                  timeout: float = 600.0, output: str = "rank0", **kwargs: Any) -> Any:
    """Check the settings for ``nproc`` ranks, then :func:`lslm.launch` the recipe.

    Without ``runs``: ``worker`` with ``config(**kwargs)``; the result is one record per rank.
    With ``runs``: ``compare``, and ``result[rank][i]`` is run ``i``'s record.
    """
    from lslm.launcher.launch import launch

    trace = kwargs.pop("trace", None)
    traced = {"trace": str(trace)} if trace else {}
    for extra in runs or [{}]:
        recipe.validate(recipe.config(**{**kwargs, **extra}), nproc)
    if runs is not None:
        return launch(f"{recipe.module}:compare", nproc=nproc, timeout=timeout, output=output, runs=list(runs),
                      **traced, **kwargs)
    return launch(f"{recipe.module}:worker", nproc=nproc, timeout=timeout, output=output,
                  **traced, **asdict(recipe.config(**kwargs)))


def run_or_launch(recipe: Recipe, cfg: Any, nproc: int, trace: str | None = None,
                  **launch_kwargs: Any) -> list[dict[str, Any]]:
    """Under torchrun (``RANK`` set): run this rank and return ``[its record]``; otherwise launch ``nproc`` ranks.

    The settings are checked for the world size first either way. ``trace``: a folder for profiler traces.
    """
    env = RankEnv.from_environ()
    recipe.validate(cfg, env.world_size if env is not None else nproc)
    if env is not None:
        return [run_rank(recipe, trace=trace, **asdict(cfg))]
    traced = {"trace": trace} if trace else {}
    return list(launch_recipe(recipe, nproc, **traced, **launch_kwargs, **asdict(cfg)))


def add_trace_option(parser: argparse.ArgumentParser) -> None:
    """The ``--trace DIR`` flag every recipe's command line has (see the module doc)."""
    parser.add_argument("--trace", default=None, metavar="DIR",
                        help="profile the last two steps with torch.profiler; every rank writes "
                             "DIR/<run>-rank<r>.json (Chrome trace: Perfetto, chrome://tracing)")


def recipe_main(recipe: Recipe, argv: Sequence[str] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """The command line of a recipe: flags from its config plus ``--nproc``; returns ``(cfg, records)``.

    Bad settings (for the config or for the world size) exit with an argparse error
    before any process starts.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {recipe.module}", description=recipe.description)
    parser.add_argument("--nproc", type=int, default=2,
                        help="processes to launch when not started by torchrun (default: 2)")
    add_trace_option(parser)
    cfg, extra = parse_config(recipe.config, argv, parser=parser)
    env = RankEnv.from_environ()
    try:
        recipe.validate(cfg, env.world_size if env is not None else extra["nproc"])
    except ValueError as exc:
        parser.error(str(exc))
    return cfg, run_or_launch(recipe, cfg, extra["nproc"], trace=extra.get("trace"))


def entry_points(recipe: Recipe) -> tuple[Callable[..., dict[str, Any]], Callable[..., list[dict[str, Any]]],
                                           Callable[..., Any]]:
    """A recipe module's three public functions, ``worker, compare, run = entry_points(RECIPE)``.

    * ``worker(**cfg)``: one rank of a launched run (:func:`run_rank`); every rank returns its
      record (``losses`` is the global per-step loss on every rank), rank 0 writes ``out``;
    * ``compare(runs, **common)``: several runs one after another in one process group
      (:func:`run_many`); run ``i`` is ``config(**common, **runs[i])``;
    * ``run(nproc, *, runs=None, timeout=600.0, output="rank0", **cfg)``: validate the settings
      for ``nproc`` ranks, then launch ``worker`` (one record per rank) or, with ``runs``,
      ``compare`` (``result[rank][i]`` is run ``i``'s record); bad settings raise ``ValueError``
      before any process starts.

    ``worker`` and ``compare`` are the launch targets ``"<recipe.module>:worker"`` / ``":compare"``.
    """
    name = recipe.config.__name__

    def worker(**kwargs: Any) -> dict[str, Any]:
        return run_rank(recipe, **kwargs)

    def compare(runs: list[dict[str, Any]], **common: Any) -> list[dict[str, Any]]:
        return run_many(recipe, runs, **common)

    def run(nproc: int = 2, *, runs: list[dict[str, Any]] | None = None, timeout: float = 600.0,
            output: str = "rank0", **kwargs: Any) -> Any:
        return launch_recipe(recipe, nproc, runs=runs, timeout=timeout, output=output, **kwargs)

    worker.__doc__ = f"One rank of a launched run; ``kwargs`` are :class:`{name}` fields. Returns this rank's record."
    compare.__doc__ = f"Several runs in one process group; run ``i`` is ``{name}(**common, **runs[i])``."
    run.__doc__ = (f"Validate ``{name}(**kwargs)`` for ``nproc`` ranks, then launch: one record per rank, or with "
                   f"``runs`` ``result[rank][i]`` for run ``i``.")
    for fn in (worker, compare, run):
        fn.__module__ = recipe.module
        fn.__qualname__ = fn.__name__
    return worker, compare, run
