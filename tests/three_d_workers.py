"""Workers for tests/test_three_d.py: the launch target of notebook 09's 3D run (lslm.demos.three_d_demo).

One launch runs a list of cases (processes start once: 2 CPU cores are shared by 8 ranks);
each case is compared with the serial run there (losses, the clip's norm, every parameter shard).
"""

from __future__ import annotations

from lslm.demos.three_d_demo import suite

__all__ = ["suite"]
