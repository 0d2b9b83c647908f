"""Bytes per rank that ring attention and Ulysses move for one attention layer (forward and backward).

``unit`` is one of q, k, v on one rank: ``B · H · (T / cp) · D`` elements.

* Ring, forward: ``cp − 1`` steps, each sending the key/value block (2 units).
  Backward: the key/value block again (``cp − 1`` sends of 2 units) and the dK/dV accumulator,
  which makes ``cp`` hops to come home (2 units each). Every byte is a p2p send the ledger records.
* Ulysses, forward: an all-to-all of q, k, v (3 units) and one of the output (1 unit); backward
  the same in reverse (dO: 1 unit, dq/dk/dv: 3). The ledger records each all-to-all's whole
  input; the ``1/cp`` of it that stays on the rank never crosses the network.

So at fixed ``T``, the ring sends ``2(cp − 1)`` units forward and Ulysses ``4(cp − 1)/cp``: the
ring's traffic per rank grows with ``cp`` (a constant number of bytes per step, ``cp − 1`` steps,
each hidden behind a block of attention), Ulysses' stays below 4 units (but needs ``H % cp == 0``).
"""

from __future__ import annotations

__all__ = ["cp_traffic"]


def cp_traffic(batch: int, n_head: int, seq_len: int, head_dim: int, cp: int,
               element_size: int = 4) -> dict[str, int]:
    """Bytes per rank for one attention layer: ``ring_forward``/``ring_backward`` (bytes sent),
    ``ulysses_forward``/``ulysses_backward`` (bytes leaving the rank) and
    ``ulysses_forward_ledger``/``ulysses_backward_ledger`` (the all-to-all inputs, as the ledger records them)."""
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} is not divisible by cp = {cp}")
    unit = batch * n_head * (seq_len // cp) * head_dim * element_size
    ring_fwd = 2 * (cp - 1) * unit
    ring_bwd = 2 * (cp - 1) * unit + (2 * cp * unit if cp > 1 else 0)
    uly_ledger = 4 * unit if cp > 1 else 0
    return {"unit": unit, "ring_forward": ring_fwd, "ring_backward": ring_bwd,
            "ulysses_forward": uly_ledger * (cp - 1) // cp, "ulysses_backward": uly_ledger * (cp - 1) // cp,
            "ulysses_forward_ledger": uly_ledger, "ulysses_backward_ledger": uly_ledger}
