"""Measurement: memory accounting (CPU and CUDA alike), next to the theory formulas."""

from lslm.metrics.memory import (
    ActivationMemory,
    MemoryReport,
    ModelStateBytes,
    format_bytes,
    memory_report,
    model_state_bytes,
    peak_rss_bytes,
    process_rss_bytes,
    reset_peak_memory,
    theory_model_state_bytes,
)

__all__ = [
    "ActivationMemory",
    "MemoryReport",
    "ModelStateBytes",
    "format_bytes",
    "memory_report",
    "model_state_bytes",
    "peak_rss_bytes",
    "process_rss_bytes",
    "reset_peak_memory",
    "theory_model_state_bytes",
]
