"""lslm.runtime: the runtime every technique hangs on.

* :func:`init_distributed` - join the process group, choose device/backend, seed.
* :class:`ParallelContext` - this rank's grid coordinates and tp/dp/pp groups.
* :class:`RankGrid` - the pure rank layout (tensor parallel innermost).
* :class:`Comm` / :class:`CommLedger` - recorded collectives and p2p.
* :func:`launch` - start a torchrun job from a notebook, get results or a clear error.
* :func:`rank_print` / :func:`progress` - rank-0 printing and progress bars.
"""

from lslm.runtime.context import ParallelContext
from lslm.runtime.grid import Coords, RankGrid, resolve_sizes
from lslm.runtime.launch import LaunchError, LaunchResults, LaunchTimeout, launch, torchrun_command
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
    "Comm", "CommLedger", "CommRecord", "Coords", "LaunchError", "LaunchResults", "LaunchTimeout",
    "ParallelContext", "RankEnv", "RankGrid", "bus_factor", "choose_device_and_backend", "free_port",
    "init_distributed", "launch", "progress", "rank_print", "resolve_sizes", "seed_everything", "synchronize",
    "torchrun_command",
]
