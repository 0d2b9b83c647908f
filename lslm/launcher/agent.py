"""The torchrun agent that ``lslm.launch`` starts: ``torch.distributed.run``, tied to the launcher's life.

``python -m lslm.launcher.agent --parent PID --launch-dir DIR -- <torchrun arguments>``
arms a parent-death signal (see :mod:`lslm.launcher.process_tree`) and then runs
torchrun in this same process. If the launcher dies without cleaning up (a notebook
kernel restarted or SIGKILLed), the agent gets one SIGTERM, torchrun's own handler
stops every worker, and the agent removes the launch's temporary folder, which the
dead launcher can no longer do.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import signal
import sys
import time

from lslm.launcher.process_tree import die_with_parent

AGENT_PID_ENV = "LSLM_AGENT_PID"  # workers read it to know which parent to watch


def main(argv: list[str] | None = None) -> None:
    """Parse our two options, tie this process to ``--parent``, then run torchrun with the rest."""
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m lslm.launcher.agent", description=__doc__)
    parser.add_argument("--parent", type=int, required=True, help="pid of the launcher this agent dies with")
    parser.add_argument("--launch-dir", default=None, help="folder to remove if the launcher dies first")
    ns = parser.parse_args(argv[:split])
    torchrun_args = argv[split + 1:]

    # The kernel sends the parent-death signal once per thread of the dying launcher (each
    # exit re-parents us), and a second SIGTERM would cut torchrun's clean-up short. So the
    # kernel sends SIGUSR2, and we turn the first one into a single SIGTERM: torchrun handles
    # that by stopping its workers before exiting.
    dying: list[int] = []

    def on_parent_death(_signum: int, _frame: object) -> None:
        if not dying:
            dying.append(1)
            signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGUSR2, on_parent_death)
    die_with_parent(ns.parent, signal.SIGUSR2)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # torchrun copies its environment into each worker's
    sys.argv = ["torch.distributed.run", *torchrun_args]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    finally:
        # The parent-death signal comes as the launcher's threads exit, so it can arrive (and
        # torchrun finish its clean-up) while getppid() still names the dying launcher: give
        # it a moment to be gone. Only on this path; a normal exit leaves the folder to it.
        deadline = time.monotonic() + (3.0 if dying else 0.0)
        while os.getppid() == ns.parent and time.monotonic() < deadline:
            time.sleep(0.02)
        if ns.launch_dir and os.getppid() != ns.parent:
            shutil.rmtree(ns.launch_dir, ignore_errors=True)  # the launcher is gone: nobody else will


if __name__ == "__main__":
    main()
