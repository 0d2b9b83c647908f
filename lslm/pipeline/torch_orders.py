"""torch.distributed.pipelining's per-rank compute orders, without processes, as lslm Actions.

torch builds every rank's order when a schedule object is constructed (``pipeline_order``, the same
data ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops`` returns). Constructing a
schedule needs stage objects, but only their ``group_rank`` / ``group_size`` / ``num_stages`` are read
for the order, so autospec mocks of ``PipelineStage`` do (what torch's visualizer does). All of this is
private API: :class:`TorchOrderUnavailable` says what moved.

Mapping: torch ``F`` -> ``F``, ``B`` (FULL_BACKWARD) -> ``B``, ``I`` (BACKWARD_INPUT) -> ``I``, ``W``
(BACKWARD_WEIGHT) -> ``W``; ``OVERLAP_F_B`` (DualPipeV's overlapped pair) -> its forward then its backward;
idle slots (``None``), communication, ``REDUCE_GRAD``, ``UNSHARD`` / ``RESHARD`` are dropped.

Which torch class each lslm schedule is compared with (:data:`TORCH_CLASSES`):

* ``gpipe`` - ``ScheduleGPipe``; ``1f1b`` - ``Schedule1F1B`` (needs ``m >= p``). torch 2.13's
  ``Schedule1F1B._get_pipeline_order`` (used only for visualisation; the runtime's own loop is right)
  numbers the **last** rank's forwards 1..m instead of 0..m-1; :func:`torch_compute_order` returns it as is
  and the tests allow exactly that shift;
* ``interleaved`` - ``ScheduleInterleaved1F1B`` (torch also accepts some ``m`` that are not multiples of
  ``p``; lslm follows Megatron-LM's ``m % p == 0``, where the two orders agree);
* ``zb-h1`` - ``ScheduleInterleavedZeroBubble`` with **one** stage per rank: its warm-up is 1F1B's
  (``p - 1 - rank`` forwards) and rank ``r`` holds back its first ``W`` for ``r`` steady steps, which is
  ZB-H1 (Qi et al. 2023 sec. 2.1); torch's visualiser only builds it with ``v >= 2``, so we construct it
  directly;
* ``dualpipev`` - ``ScheduleDualPipeV`` (``m >= 2p``);
* ``naive`` - none.
"""

from __future__ import annotations

from typing import Any

from lslm.pipeline.actions import Action

__all__ = ["TORCH_CLASSES", "TorchOrderUnavailable", "torch_compute_order"]

TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                 "zb-h1": "ScheduleInterleavedZeroBubble", "dualpipev": "ScheduleDualPipeV"}
_KINDS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


class TorchOrderUnavailable(RuntimeError):
    """torch's private schedule API is not where this module expects it (the message says what is missing)."""


def _convert(action: Any) -> list[Action]:
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [x for sub in subs for x in _convert(sub)]
    kind = _KINDS.get(getattr(action.computation_type, "name", ""))
    return [] if kind is None else [Action(int(action.stage_index), kind, int(action.microbatch_index))]


def torch_compute_order(name: str, p: int, m: int, v: int = 1) -> list[list[Action]] | None:
    """torch's compute order for lslm schedule ``name`` (module doc): one list of Actions per rank.

    ``None`` when torch has no such schedule (``"naive"``) or refuses this ``(p, m, v)`` (its ValueError);
    raises :class:`TorchOrderUnavailable` when the private API moved.
    """
    cls_name = TORCH_CLASSES.get(name)
    if cls_name is None:
        return None
    try:
        from unittest import mock

        from torch.distributed.pipelining import schedules as tsched
        from torch.distributed.pipelining.stage import PipelineStage

        cls = getattr(tsched, cls_name)
        single = issubclass(cls, tsched.PipelineScheduleSingle)
    except (ImportError, AttributeError) as err:
        raise TorchOrderUnavailable(f"torch.distributed.pipelining.{cls_name} not found: {err}") from err

    def stage() -> Any:
        st = mock.create_autospec(PipelineStage, instance=True)
        st.group_rank, st.group_size, st.submod, st.num_stages = 0, p, None, p * v
        return st

    try:
        sched = cls(stage(), m) if single else cls([stage() for _ in range(v)], m)
    except ValueError:
        return None
    except Exception as err:  # the private constructor path changed shape
        raise TorchOrderUnavailable(f"could not build {cls_name} from mock stages: {err!r}") from err
    order = getattr(sched, "pipeline_order", None)
    if not isinstance(order, dict) or sorted(order) != list(range(p)):
        raise TorchOrderUnavailable(f"{cls_name}.pipeline_order is not a dict rank -> actions any more")
    try:
        return [[x for a in order[r] for x in _convert(a)] for r in range(p)]
    except AttributeError as err:
        raise TorchOrderUnavailable(f"torch's _Action changed: {err}") from err
