"""What went wrong in a launched job, told root cause first.

When one rank fails, its peers usually fail a moment later (often *earlier* by
the clock) with "connection closed by peer": they lost the rank that failed. And
torchrun adds its own shutdown noise ("closing signal SIGTERM", a ``SignalException``
traceback, a failure summary). This module turns what the launcher collected, one
:class:`RankFailure` per rank, into a :class:`LaunchError` that leads with the
rank that failed first for a reason of its own, its traceback, and then lists the
other ranks' errors as consequences.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

# Messages of a rank that only lost a peer: gloo, NCCL and the TCP store say it in these words.
_PEER_LOST = re.compile(
    r"connection (closed|reset) by (remote )?peer|broken pipe|connection refused|ECONNRESET|EPIPE"
    r"|failed to recv, got 0 bytes|remote process exited|NCCL communicator was aborted|ncclRemoteError",
    re.IGNORECASE)
# A signal the job's own shutdown sends (torchrun's agent, or our clean-up): a consequence.
_SHUTDOWN_SIGNALS = {s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None}
# torchrun's failure summary ("rank : 1 (local_rank: 1)" then "exitcode : -9 (pid: 123)") and its log line
# "failed (exitcode: -9) local_rank: 1 (pid: 123)". Keyed by pid, which our workers also report.
_SUMMARY_ENTRY = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*(\d+)\)")
_AGENT_LOG_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")
# Lines of torchrun's agent logger, e.g. "W1123 15:01:30.635000 6947 .../elastic/multiprocessing/api.py:1028] ...".
_AGENT_LOG_LINE = re.compile(r"^[DIWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S*torch/distributed/\S+\] ")
_AGENT_EXCEPTIONS = ("SignalException", "ChildFailedError")
_MAX_LISTED = 8  # consequences listed one per line in the message
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ")  # "[/__w/.../pair.cc:553] " in C++ errors


@dataclass
class RankFailure:
    """How one rank failed. ``time`` is when (the rank's clock for an exception, the
    launcher's for a death it noticed); ``secondary`` marks a consequence of another
    rank's failure (a lost peer, a shutdown signal)."""

    rank: int
    time: float
    summary: str  # one line: "RuntimeError: boom" or "was killed by signal 9 (SIGKILL)"
    traceback: str = ""
    exitcode: int | None = None  # negative: killed by that signal
    pid: int | None = None
    secondary: bool = False
    raised: bool = False  # it raised a Python exception (else it died: a signal, os._exit, a native crash)

    @property
    def signal(self) -> int | None:
        """The signal that ended the rank, if one did."""
        return -self.exitcode if self.exitcode is not None and self.exitcode < 0 else None


class LaunchError(RuntimeError):
    """A launched job failed.

    ``rank`` is the rank that failed first (None if no rank is to blame), ``traceback``
    its Python traceback (or the crash dump of a rank killed by a fatal signal),
    ``signal`` the signal that killed it (None if it raised), ``failures`` every
    rank's failure, root cause first, and ``output`` the job's full output.
    """

    def __init__(self, message: str, rank: int | None = None, traceback: str = "", output: str = "", *,
                 signal: int | None = None, failures: Iterable[RankFailure] = (), shown: str | None = None) -> None:
        self.rank = rank
        self.traceback = traceback
        self.output = output
        self.signal = signal
        self.failures = list(failures)
        text = message
        if traceback:
            label = "traceback" if not self.failures or self.failures[0].raised else "crash dump (faulthandler)"
            text += f"\n\n--- {label} of rank {rank} ---\n{traceback.rstrip()}"
        others = [f for f in self.failures if f.rank != rank]
        if others:
            listed = [_one_line(f) for f in others[:_MAX_LISTED]]
            if len(others) > _MAX_LISTED:
                listed.append(f"... and {len(others) - _MAX_LISTED} more ranks (err.failures has them all)")
            text += "\n\n--- then, as consequences ---\n" + "\n".join(listed)
        if shown is None and not traceback:
            shown = clean_tail(output)  # nothing else to go on: the end of the job's output
        if shown:
            text += f"\n\n--- last output{'' if rank is None else f' of rank {rank}'} ---\n{shown.rstrip()}"
        super().__init__(text)


class LaunchTimeout(LaunchError):
    """The job ran past its ``timeout`` and was killed."""


def _one_line(f: RankFailure, width: int = 160) -> str:
    text = f"rank {f.rank}: " + _SOURCE_LOCATION.sub("", f.summary)
    return text if len(text) <= width else text[:width - 3] + "..."


def is_peer_lost(messages: Iterable[str]) -> bool:
    """True if any of these exception messages says the rank merely lost a peer."""
    return any(_PEER_LOST.search(m) for m in messages)


def signal_name(signum: int) -> str:
    """``"SIGKILL"`` for 9; ``"signal 42"`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def death_summary(exitcode: int | None) -> str:
    """One line for a rank that ended without a Python traceback, e.g. ``"was killed by signal 9 (SIGKILL)"``."""
    if exitcode is None:
        return "died"
    if exitcode < 0:
        return f"was killed by signal {-exitcode} ({signal_name(-exitcode)})"
    return f"exited with code {exitcode}"


def death_hint(exitcode: int | None) -> str:
    """The usual reasons for such an end, for the learner reading the error."""
    if exitcode is None:
        return "a signal (e.g. the out-of-memory killer's SIGKILL) or a crash in native code"
    if exitcode < 0:
        return {signal.SIGKILL: "the out-of-memory killer, or a `kill -9`",
                signal.SIGSEGV: "a crash in native code (see the crash dump)",
                signal.SIGBUS: "a crash in native code (see the crash dump)",
                signal.SIGABRT: "an abort in native code (see the crash dump)",
                signal.SIGTERM: "a shutdown request"}.get(-exitcode, "a signal sent to it")
    return "os._exit, or a native library ended the process"


def exit_codes_from_output(text: str) -> tuple[dict[int, int], dict[int, int]]:
    """Exit codes torchrun reported: ``({pid: exitcode}, {rank: exitcode})``.

    Read from the agent's failure summary and its "failed (exitcode: ...)" log line,
    the only place a worker killed by a signal is described (it wrote nothing itself).
    """
    by_pid: dict[int, int] = {}
    by_rank: dict[int, int] = {}
    for rank, code, pid in _SUMMARY_ENTRY.findall(text):
        by_pid[int(pid)] = int(code)
        by_rank[int(rank)] = int(code)
    for code, pid in _AGENT_LOG_FAILED.findall(text):
        by_pid.setdefault(int(pid), int(code))
    return by_pid, by_rank


def apply_exit_codes(failures: dict[int, RankFailure], pids: dict[int, int], output: str, when: float) -> None:
    """Fill in the exit code of every rank that died silently; add ranks only torchrun saw fail.

    ``pids`` maps rank to the pid its worker reported; ``when`` is the time given to a
    failure known only from torchrun's summary (it prints whole seconds only).
    """
    by_pid, by_rank = exit_codes_from_output(output)
    for rank, f in failures.items():
        if f.exitcode is None and not f.raised:
            code = by_pid.get(pids.get(rank, -1), by_rank.get(rank))
            if code is not None:
                f.exitcode = code
                f.summary = death_summary(code)
                f.secondary = f.secondary or (f.signal in _SHUTDOWN_SIGNALS)
    for rank, code in by_rank.items():
        if rank not in failures:
            failures[rank] = RankFailure(rank, when, death_summary(code), exitcode=code,
                                         secondary=-code in _SHUTDOWN_SIGNALS)


def apply_rank_exit_codes(failures: dict[int, RankFailure], codes: dict[int, int | None],
                          finished: set[int], when: float) -> None:
    """Exit codes known per rank (ranks the launcher started itself, no torchrun in between): fill in the code of
    every rank that died silently, and add a rank that ended with a non-zero code but neither wrote its result
    (``finished``) nor is named yet. ``when`` is the time given to those."""
    for rank, code in codes.items():
        if code in (0, None):
            continue
        f = failures.get(rank)
        if f is None:
            if rank not in finished:
                failures[rank] = RankFailure(rank, when, death_summary(code), exitcode=code,
                                             secondary=-code in _SHUTDOWN_SIGNALS)
        elif f.exitcode is None and not f.raised:
            f.exitcode = code
            f.summary = death_summary(code)
            f.secondary = f.secondary or (f.signal in _SHUTDOWN_SIGNALS)


def order_failures(failures: Iterable[RankFailure]) -> list[RankFailure]:
    """Root cause first: a rank that failed for its own reason before one that lost a peer, then by time.

    Time, never the rank number or a file name ("rank10" sorts before "rank2").
    """
    return sorted(failures, key=lambda f: (f.secondary, f.time, f.rank))


def clean_tail(output: str | list[str], n: int = 40, rank: int | None = None) -> str:
    """The last ``n`` lines worth showing: without torchrun's agent logging, its
    ``SignalException`` / ``ChildFailedError`` tracebacks and failure summary.

    With ``rank``, only that rank's lines (and unprefixed lines that are not torchrun's).
    """
    lines = output.splitlines() if isinstance(output, str) else list(output)
    kept: list[str] = []
    block: list[str] = []  # an unprefixed traceback being read, kept unless it is the agent's
    skip_summary = 0  # "=" borders left to pass in torchrun's failure summary
    for line in lines:
        if skip_summary and not line.startswith("[rank "):  # a rank's line: the summary is over, whatever it said
            if line and set(line) == {"="}:
                skip_summary -= 1
            continue
        skip_summary = 0
        if block:
            block.append(line)
            if line and not line[0].isspace() and not line.startswith("Traceback"):
                if any(name in line for name in _AGENT_EXCEPTIONS):
                    skip_summary = 2 if "ChildFailedError" in line else 0
                else:
                    kept += block
                block = []
            continue
        if _AGENT_LOG_LINE.match(line):
            continue
        if line.startswith("Traceback (most recent call last):"):
            block = [line]
            continue
        if rank is not None and line.startswith("[rank ") and not line.startswith(f"[rank {rank}]"):
            continue
        kept.append(line)
    kept += block
    return "\n".join(kept[-n:])


def build_error(failures: dict[int, RankFailure], world_size: int, target: str, output: list[str]) -> LaunchError:
    """The error to raise: the root-cause rank in the first line, with its traceback or crash dump."""
    ordered = order_failures(failures.values())
    text = "\n".join(output)
    root = ordered[0]
    if root.raised:
        message = f"rank {root.rank} of {world_size} failed first running {target}: {root.summary.splitlines()[0]}"
        shown: str | None = ""
    else:
        message = (f"rank {root.rank} of {world_size} {root.summary} while running {target}, without raising "
                   f"a Python exception: {death_hint(root.exitcode)}")
        shown = clean_tail(text, n=20, rank=root.rank)
    return LaunchError(message, rank=root.rank, traceback=root.traceback, output=text, signal=root.signal,
                       failures=ordered, shown=shown)
