"""lslm.runtime: the runtime every technique hangs on.

* :func:`init_distributed` - join the process group, choose device/backend, seed
  (its module doc says where gloo and NCCL differ, and which RNG streams are shared).
* :class:`ParallelContext` - this rank's grid coordinates, ``ctx.group(*axes)`` for
  any axis combination, ``ctx.mesh`` (a torch DeviceMesh over the same grid).
* :class:`RankGrid` - the pure rank layout over the named axes ``pp, dp, cp, tp``
  (tensor parallel innermost).
* :class:`Comm` / :class:`CommLedger` - recorded collectives and p2p: bytes, axis, label,
  issue times, and completion times when a timeline asks for them (``ledger.timed()``).
* :func:`rank_print` / :func:`progress` - rank-0 printing and progress bars.
* :func:`lslm.runtime.fake_world.fake_world` - this process as rank ``r`` of ``N`` on torch's fake backend
  (real sharding and records, no peers): the at-scale byte checks run in one process.

Launching jobs (``lslm.launch``) is :mod:`lslm.launcher`, a layer above this one; atomic file writes are
:mod:`lslm.runtime.files`.
"""

from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import AXES, Coords, RankGrid, resolve_sizes
from lslm.runtime.ledger import Comm, CommLedger, CommRecord, bus_factor
from lslm.runtime.printing import progress, rank_print
from lslm.runtime.startup import (
                               RankEnv,
                               choose_device_and_backend,
                               free_port,
                               init_distributed,
                               seed_everything,
                               synchronize,
)

__all__ = [
    "AXES", "Comm", "CommLedger", "CommRecord", "Coords", "ParallelContext", "RankEnv", "RankGrid", "bus_factor",
    "choose_device_and_backend", "free_port", "init_distributed", "progress", "rank_print", "resolve_sizes",
    "seed_everything", "synchronize",
]
