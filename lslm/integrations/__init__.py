"""Training with the tools used at work (Lightning, Accelerate, a torchrun script), side by side with lslm."""
