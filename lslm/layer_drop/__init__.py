"""lslm.layer_drop: progressive layer dropping (Zhang and He, NeurIPS 2020), applied to a GPT from outside.

* :class:`PLDSchedule` - the keep ratio over time, ``theta(t) = (1 - theta_bar) exp(-gamma t) + theta_bar``,
  and over depth, ``p_l(t) = 1 - l / L (1 - theta(t))``;
* :func:`apply_progressive_layer_drop` - each block of ``model.blocks`` kept with probability ``p_l(t)`` in
  training and skipped (no compute at all) otherwise; returns the :class:`ProgressiveLayerDrop` handle.
"""

from lslm.layer_drop.progressive import PLDSchedule, ProgressiveLayerDrop, apply_progressive_layer_drop

__all__ = ["PLDSchedule", "ProgressiveLayerDrop", "apply_progressive_layer_drop"]
