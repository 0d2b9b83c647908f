"""lslm.launcher: start a torchrun job from a notebook, a script or ``lslm launch``, and fail loudly when it fails.

It sits just above :mod:`lslm.runtime` (it needs a free port and the device checks; the runtime knows nothing of it):

* :mod:`.launch` - :func:`launch` runs ``python -m torch.distributed.run`` on a free port and returns every rank's
  result (:class:`LaunchResults`); :func:`torchrun_command` is the command line it runs;
* :mod:`.launch_checks` - bad arguments refused before any process starts;
* :mod:`.launch_errors` - :class:`LaunchError` naming the rank that failed first, :class:`LaunchTimeout`;
* :mod:`.process_tree` - killing the whole tree, deferring signals during clean-up, parent-death signals;
* :mod:`.agent` / :mod:`.worker` - the two processes per rank (``python -m lslm.launcher.agent`` runs torchrun and
  dies with the launcher; ``python -m lslm.launcher.worker`` runs the target function and writes its result);
* :mod:`.streams` - the job's output, streamed and kept.

``lslm.launch``, ``lslm.LaunchError`` and ``lslm.LaunchTimeout`` are these same objects.
"""

from lslm.launcher.launch import LaunchResults, launch, torchrun_command
from lslm.launcher.launch_errors import LaunchError, LaunchTimeout

__all__ = ["LaunchError", "LaunchResults", "LaunchTimeout", "launch", "torchrun_command"]
