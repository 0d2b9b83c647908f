"""Pipeline schedules as data: one instruction list per rank, shared by the executor and the simulator.

A schedule is decided *before* anything runs: for each rank, the ordered list of what it
does to which micro-batch on which (virtual) stage. The executor
(:mod:`lslm.pipeline.executor`) runs such a list on real processes, the simulator
(:mod:`lslm.pipeline.simulator`) plays it with cost ratios, and tests check both against
the same rules (a micro-batch's forward before its backward, dependencies across stages,
no deadlock).

Compute kinds (torch.distributed.pipelining uses the same letters):

* ``F`` - forward of micro-batch ``mb`` through stage ``stage``;
* ``B`` - full backward: input gradient and weight gradients together;
* ``I`` - backward for the **input** gradient only (zero-bubble's "B", Qi et al. 2023, section 2);
* ``W`` - the deferred **weight** gradients of an earlier ``I`` (zero-bubble's "W").

Communication kinds, named from the point of view of ``stage`` (as torch does):

* ``SEND_F`` - send stage ``stage``'s output of ``mb`` to stage ``stage + 1``;
* ``RECV_F`` - receive stage ``stage``'s input of ``mb`` from stage ``stage - 1``;
* ``SEND_B`` - send the gradient of stage ``stage``'s input of ``mb`` to stage ``stage - 1``;
* ``RECV_B`` - receive the gradient of stage ``stage``'s output of ``mb`` from stage ``stage + 1``.

Stages are *virtual* stages, numbered from the first layers to the last over the whole
model (``0 .. num_stages - 1``); ``stage_to_rank`` says which rank holds each (a loop for
interleaved 1F1B, a V for DualPipeV). Adjacent stages on the same rank hand tensors over
locally and need no communication actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "DEFAULT_COSTS", "Action", "format_actions", "parse_action"]

COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")

#: Relative time of each compute kind, the one default of the simulator and of the timed comm plan: a full
#: backward costs two forwards (one matmul for the input gradient, one for the weight gradient), and the
#: zero-bubble split gives each half one forward's cost.
DEFAULT_COSTS: dict[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True, order=True)
class Action:
    """One instruction: ``kind`` (see the module doc) of micro-batch ``mb`` on virtual stage ``stage``.

    Written and parsed as ``f"{stage}{kind}{mb}"`` (``"0F3"``, ``"1SEND_B0"``), torch's notation.
    """

    stage: int
    kind: str
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {COMPUTE_KINDS + COMM_KINDS}")
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"stage and micro-batch are >= 0, got stage={self.stage} mb={self.mb}")

    @property
    def is_compute(self) -> bool:
        """True for F, B, I and W."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for the four send/receive kinds."""
        return self.kind in COMM_KINDS

    @property
    def is_backward(self) -> bool:
        """True for B and I: the actions that produce the input gradient (and need the output's)."""
        return self.kind in ("B", "I")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def parse_action(text: str) -> Action:
    """The :class:`Action` written as ``text`` (``"2I5"`` -> stage 2, ``I``, micro-batch 5)."""
    text = text.strip()
    i = 0
    while i < len(text) and text[i].isdigit():
        i += 1
    j = len(text)
    while j > i and text[j - 1].isdigit():
        j -= 1
    if i == 0 or j == len(text) or text[i:j] not in COMPUTE_KINDS + COMM_KINDS:
        raise ValueError(f"cannot read {text!r} as an action: expected <stage><kind><mb>, e.g. '0F3' or '1SEND_B0'")
    return Action(int(text[:i]), text[i:j], int(text[j:]))


def format_actions(actions: Sequence[Action | None]) -> str:
    """One rank's list as text, ``None`` (an idle slot, in simulated grids) shown as ``-``."""
    return " ".join("-" if a is None else str(a) for a in actions)
