"""Bytes per rank that ring attention and Ulysses move for one attention layer (forward and backward).

``unit_q`` is this rank's queries, ``B · H · (T / cp) · D`` elements; ``unit_kv`` its keys (or its values),
``B · H_kv · (T / cp) · D`` (``H_kv = kv_heads``, fewer than ``H`` with grouped-query attention), in the inputs'
dtype (``element_size`` bytes each); ``acc_kv`` is ``unit_kv`` in the accumulation dtype (fp32, or fp64 for
fp64 inputs: ``max(element_size, 4)`` bytes an element).

* Ring, forward: ``cp − 1`` steps, each sending the key/value block (``2 unit_kv``).
  Backward: the key/value block again (``cp − 1`` sends of ``2 unit_kv``) and the dK/dV accumulator, which
  makes ``cp`` hops to come home (``2 acc_kv`` each: it travels in fp32, as it sums every rank's share).
  Every byte is a p2p send the ledger records. The queries never travel.
* Ulysses, forward: one all-to-all of q, k, v (``unit_q + 2 unit_kv``) and one of the output (``unit_q``);
  backward the same in reverse (dO: ``unit_q``, dq/dk/dv: ``unit_q + 2 unit_kv``). The ledger records each
  all-to-all's whole input; the ``1/cp`` of it that stays on the rank never crosses the network.

So at fixed ``T``, forward, the ring sends ``2(cp − 1) unit_kv`` and Ulysses ``(2 unit_q + 2 unit_kv)(cp − 1)/cp``:
the ring's traffic per rank grows with ``cp`` (a constant number of bytes per step, ``cp − 1`` steps, each hidden
behind a block of attention), Ulysses' does not (but needs ``H`` and ``H_kv`` divisible by ``cp``). The ring is
the cheaper one while ``(cp − 1) · H_kv < H``: up to cp = 2 with multi-head attention (equal there), up to
cp = 4 with 8 key/value heads of 32 (Llama-3-8B).
"""

from __future__ import annotations

__all__ = ["cp_traffic"]


def cp_traffic(batch: int, n_head: int, seq_len: int, head_dim: int, cp: int,
               element_size: int = 4, kv_heads: int | None = None) -> dict[str, int]:
    """Bytes per rank for one attention layer: ``ring_forward``/``ring_backward`` (bytes sent),
    ``ulysses_forward``/``ulysses_backward`` (bytes leaving the rank) and
    ``ulysses_forward_ledger``/``ulysses_backward_ledger`` (the all-to-all inputs, as the ledger records them);
    ``unit_q`` and ``unit_kv`` as in the module doc (``unit``: ``unit_q``, the name before GQA).

    ``kv_heads``: key/value heads (``None``: ``n_head``, multi-head attention); it must divide ``n_head``.
    """
    kv = n_head if kv_heads is None else kv_heads
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} is not divisible by cp = {cp}")
    if kv < 1 or n_head % kv:
        raise ValueError(f"kv_heads = {kv} must divide n_head = {n_head} (each key/value head serves "
                         "n_head / kv_heads query heads)")
    tokens = batch * (seq_len // cp) * head_dim
    unit_q, unit_kv = tokens * n_head * element_size, tokens * kv * element_size
    acc_kv = tokens * kv * max(element_size, 4)
    ring_fwd = 2 * (cp - 1) * unit_kv
    ring_bwd = 2 * (cp - 1) * unit_kv + (2 * cp * acc_kv if cp > 1 else 0)
    uly_ledger = 2 * unit_q + 2 * unit_kv if cp > 1 else 0
    return {"unit": unit_q, "unit_q": unit_q, "unit_kv": unit_kv, "ring_forward": ring_fwd, "ring_backward": ring_bwd,
            "ulysses_forward": uly_ledger * (cp - 1) // cp, "ulysses_backward": uly_ledger * (cp - 1) // cp,
            "ulysses_forward_ledger": uly_ledger, "ulysses_backward_ledger": uly_ledger}
