"""Measurement: memory accounting by owner and device (CPU and CUDA alike), next to the theory formulas."""

from lslm.metrics.memory import (
    CATEGORIES,
    ActivationMemory,
    MemoryBreakdown,
    MemoryOwner,
    MemoryRegistry,
    MemoryReport,
    ModelStateBytes,
    format_bytes,
    memory_by_owner,
    memory_report,
    model_state_bytes,
    peak_rss_bytes,
    process_rss_bytes,
    reset_peak_memory,
    theory_model_state_bytes,
)

__all__ = [
    "CATEGORIES",
    "ActivationMemory",
    "MemoryBreakdown",
    "MemoryOwner",
    "MemoryRegistry",
    "MemoryReport",
    "ModelStateBytes",
    "format_bytes",
    "memory_by_owner",
    "memory_report",
    "model_state_bytes",
    "peak_rss_bytes",
    "process_rss_bytes",
    "reset_peak_memory",
    "theory_model_state_bytes",
]
