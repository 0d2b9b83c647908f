"""Exercises with automatic checks, one mechanism for every notebook (see ``core``)."""

from lslm.exercises.core import Verdict, materialise, run_check
from lslm.exercises.ring_all_gather import check_ring_all_gather
from lslm.exercises.sharding import check_shard_range, reference_shard_range

__all__ = ["Verdict", "check_ring_all_gather", "check_shard_range", "materialise", "reference_shard_range",
           "run_check"]
