"""Exercises with automatic checks, one mechanism for every notebook (see ``core``)."""

from lslm.exercises.core import Verdict, materialise, run_check
from lslm.exercises.grad_sync import check_grad_sync, reference_sync_gradients
from lslm.exercises.ring_all_gather import check_ring_all_gather
from lslm.exercises.sharding import check_shard_range, reference_shard_range

__all__ = ["Verdict", "check_grad_sync", "check_ring_all_gather", "check_shard_range", "materialise",
           "reference_shard_range", "reference_sync_gradients", "run_check"]
