"""Vocabulary padding: a vocabulary split over ``t`` ranks needs a size divisible by ``t``.

GPT-2's 50,257 tokens are odd, so no ``t > 1`` divides them. Megatron pads the
vocabulary up to a multiple of ``t x k`` (``--make-vocab-size-divisible-by``, k = 128 by
default, which also keeps each shard's matmul width a multiple of 128 for GPU kernels).
The padded embedding rows are never looked up; the padded logit columns are masked out of
the softmax (:mod:`lslm.tensor_parallel.cross_entropy`) and dropped when logits are
gathered, so padding changes no number the model computes.
"""

from __future__ import annotations

__all__ = ["pad_vocab_size", "vocab_range"]


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """The smallest size >= ``vocab_size`` divisible by ``tp * multiple`` (50257, tp=2 -> 50258; k=128 -> 50432)."""
    for name, value in (("vocab_size", vocab_size), ("tp", tp), ("multiple", multiple)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    step = tp * multiple
    return -(-vocab_size // step) * step


def vocab_range(padded_vocab_size: int, tp_rank: int, tp: int) -> tuple[int, int]:
    """``[start, end)`` of the (padded) vocabulary rows that ``tp_rank`` of ``tp`` holds."""
    if padded_vocab_size % tp:
        raise ValueError(f"padded vocabulary {padded_vocab_size} is not divisible by tp={tp}: pad it with "
                         f"pad_vocab_size({padded_vocab_size}, {tp})")
    per_rank = padded_vocab_size // tp
    return tp_rank * per_rank, (tp_rank + 1) * per_rank
