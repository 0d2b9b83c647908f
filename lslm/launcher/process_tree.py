"""Keep a launch's process tree tied to its launcher: no orphans, whatever way the launcher ends.

The tree is launcher -> torchrun agent(s) -> rank workers. Each process is tied to
its parent:

* **Parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG)``): the kernel signals a
  process the moment its parent dies, even when the parent was SIGKILLed and ran no
  clean-up. Careful: it comes once per *thread* of the dying parent (each thread's
  exit re-parents the child), so its handler must act only once. Agents turn it
  into one SIGTERM (torchrun then stops its workers itself); workers ask for
  SIGKILL (nobody is left to report to, and a repeat is harmless).
* **A watcher thread** that polls ``os.getppid()``, where ``prctl`` is missing (macOS).

The launcher itself kills whatever is left (:func:`kill_tree`) on every exit path,
and :func:`deferred_signals` keeps a second Ctrl-C from interrupting that clean-up.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import psutil

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Returns whether it worked. The setting survives ``exec`` and is cleared by ``fork``,
    so every process in the tree sets its own.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # the running program's symbols include libc's prctl
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - no libc / no prctl
        return False


def watch_parent(parent_pid: int, on_death: Callable[[], None], period_s: float = 0.25) -> None:
    """Call ``on_death()`` from a daemon thread once this process's parent is no longer ``parent_pid``.

    An orphan is re-parented (to init or a sub-reaper), so ``getppid()`` changing is the
    portable sign that the parent died.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        on_death()

    threading.Thread(target=watch, daemon=True, name="lslm-parent-watch").start()


def die_with_parent(parent_pid: int, sig: int, on_death: Callable[[], None] | None = None) -> None:
    """Tie this process's life to ``parent_pid``: the parent-death signal ``sig``, else a watcher.

    If the parent is already gone (it died before we got here), act at once. The
    watcher is only the fallback where ``prctl`` is missing: a second signal could
    interrupt the clean-up the first one started (torchrun's agent stops its workers
    on SIGTERM). ``on_death`` defaults to sending ``sig`` to ourselves.
    """
    action = on_death or (lambda: os.kill(os.getpid(), sig))
    armed = set_parent_death_signal(sig)
    if os.getppid() != parent_pid:  # died between our start and the prctl above
        action()
    elif not armed:
        watch_parent(parent_pid, action)


def is_alive(proc: psutil.Process) -> bool:
    """True while ``proc`` runs. A zombie (dead, not yet reaped by its parent) counts as dead,
    and so does a recycled pid (``psutil.Process`` compares the creation time)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendants(pids: list[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants that exist now (children first)."""
    found: list[psutil.Process] = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            found += root.children(recursive=True)
            found.append(root)
        except psutil.Error:
            continue
    return found


def kill_tree(pids: list[int], grace_s: float = 2.0, extra: list[psutil.Process] = ()) -> None:
    """SIGTERM ``pids``, their descendants and ``extra``; SIGKILL whatever is alive after ``grace_s``.

    The tree is listed before anything is signalled: once an agent dies its workers are
    re-parented and can no longer be found from it. ``extra`` are processes known by other
    means (the workers' pid files), which catches workers whose agent is already gone.
    """
    victims = descendants(pids)
    seen = {p.pid for p in victims}
    victims += [p for p in extra if p.pid not in seen and is_alive(p)]
    for v in victims:
        with contextlib.suppress(psutil.Error):
            v.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(victims, timeout=grace_s)
    for v in alive:
        with contextlib.suppress(psutil.Error):
            v.kill()
    psutil.wait_procs(alive, timeout=grace_s)


@contextlib.contextmanager
def deferred_signals(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold back ``signums`` while the block runs (clean-up), then deliver the first one that came.

    Only the main thread can change signal handlers; elsewhere this does nothing.
    A second Ctrl-C during clean-up would otherwise leave half the tree running.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {}
    for s in signums:
        with contextlib.suppress(ValueError, OSError):
            previous[s] = signal.signal(s, lambda num, _frame: pending.append(num))
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: a handler installed from C, which Python cannot restore
                signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])
