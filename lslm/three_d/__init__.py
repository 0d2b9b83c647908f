"""3D parallelism: tensor (+ sequence) parallelism inside pipeline stages, data parallelism or ZeRO-1 across them
(ZeRO-2 without pipeline stages)."""

from lslm.three_d.apply import ZERO_STAGES, ThreeDModel, ThreeDPlan, apply_3d, check_3d, stage_module_names

__all__ = ["ZERO_STAGES", "ThreeDModel", "ThreeDPlan", "apply_3d", "check_3d", "stage_module_names"]
