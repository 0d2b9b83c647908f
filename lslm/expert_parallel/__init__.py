"""lslm.expert_parallel: a mixture-of-experts layer for the GPT and its experts sharded over ranks.

* :mod:`.router` - top-k routing (Switch or Mixtral gates), load-balancing loss and router z-loss;
* :mod:`.dispatch` - capacity, priority and dropped assignments (and the dropless mode);
* :mod:`.moe` - the serial :class:`MoE` layer, :func:`apply_moe` in place of each block's MLP;
* :mod:`.group` - the ep group (the data-parallel ranks: the grid has no ``ep`` axis);
* :mod:`.all_to_all` - the uneven all-to-all (counts first, then rows) and its autograd reverse;
* :mod:`.parallel` - :class:`ExpertParallelMoE`, :func:`apply_expert_parallel`, the gradient rule (on ``.grad``
  or on gradient buffers, where the experts have a buffer of their own, kind ``"ep"``);
* :mod:`.traffic` - bytes per rank per layer, the formula the ledger is checked against;
* :mod:`.balance` - tokens per expert and dropped tokens per layer, for a plot over training.

Checked against the serial MoE on each rank's batch shard in tests/test_expert_parallel.py.
"""

from lslm.expert_parallel.all_to_all import all_to_all_rows, exchange_counts
from lslm.expert_parallel.balance import moe_balance
from lslm.expert_parallel.dispatch import Assignments, assign, expert_capacity
from lslm.expert_parallel.group import EPGroup
from lslm.expert_parallel.moe import Expert, MoE, apply_moe, check_moe, moe_aux_loss, moe_layers, route_tokens
from lslm.expert_parallel.parallel import (
    ExpertParallelMoE,
    apply_expert_parallel,
    expert_parameters,
    reduce_expert_parallel_grads,
)
from lslm.expert_parallel.router import Routing, TopKRouter, load_balancing_loss, router_z_loss
from lslm.expert_parallel.traffic import ep_traffic, rows_per_rank

__all__ = ["Assignments", "EPGroup", "Expert", "ExpertParallelMoE", "MoE", "Routing", "TopKRouter",
           "all_to_all_rows", "apply_expert_parallel", "apply_moe", "assign", "check_moe", "ep_traffic",
           "exchange_counts", "expert_capacity", "expert_parameters", "load_balancing_loss", "moe_aux_loss",
           "moe_balance", "moe_layers", "reduce_expert_parallel_grads", "route_tokens", "router_z_loss",
           "rows_per_rank"]
