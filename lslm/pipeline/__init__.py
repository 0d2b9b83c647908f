"""lslm.pipeline: pipeline parallelism, every schedule an instruction list run by one executor and one simulator.

* :mod:`.actions` - ``Action(stage, kind, mb)``: F, B, I (input gradient), W (weight gradient), sends, receives;
* :mod:`.schedules` - naive, GPipe, 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV as per-rank lists;
  :mod:`.comm_plan` - the sends and receives each list implies, batched so NCCL cannot deadlock;
* :mod:`.validate` - the rules a schedule must keep (a learner's hand-written one included);
* :mod:`.simulator` - an event simulation with cost ratios and NCCL's matching rule; :mod:`.theory` - the closed
  forms for bubbles and activation memory; :mod:`.timeline` - measured and simulated timelines in one format;
* :mod:`.partition` - a GPT cut into stages by layers, parameters or measured time;
* :mod:`.split_backward` - zero-bubble's split of a linear layer's backward into I and W;
* :mod:`.stage`, :mod:`.p2p`, :mod:`.executor`, :mod:`.memory` - one stage's forward/backward (rematerialisation,
  output deallocation), batched point-to-point through the ledger, the executor, saved-activation bytes;
* :mod:`.apply` - :func:`apply_pipeline` (a plan, its checks before any process starts, the pipelined model);
* :mod:`.pipedream_2bw` - PipeDream-2BW: asynchronous 1F1B with double-buffered weights;
* :mod:`.torch_reference` - the same GPT under ``torch.distributed.pipelining``, for side-by-sides;
  :mod:`.torch_orders` - torch's per-rank orders, to compare with ours.
"""

from lslm.pipeline.actions import Action, format_actions, parse_action
from lslm.pipeline.apply import PipelineModel, PipelinePlan, apply_pipeline, check_plan
from lslm.pipeline.partition import GPTStage, partition_units, split_gpt, unit_costs
from lslm.pipeline.schedules import (
    SCHEDULES,
    PipelineSchedule,
    build_schedule,
    check_schedule_config,
    schedule_from_lists,
)
from lslm.pipeline.simulator import SimResult, simulate
from lslm.pipeline.timeline import Event, Timeline
from lslm.pipeline.validate import ScheduleError, validate_schedule

__all__ = [
    "SCHEDULES", "Action", "Event", "GPTStage", "PipelineModel", "PipelinePlan", "PipelineSchedule", "ScheduleError",
    "SimResult", "Timeline", "apply_pipeline", "build_schedule", "check_plan", "check_schedule_config",
    "format_actions", "parse_action", "partition_units", "schedule_from_lists", "simulate", "split_gpt",
    "unit_costs", "validate_schedule",
]
