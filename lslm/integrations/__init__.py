"""Training with the tools used at work (Lightning, Accelerate, a torchrun script, DeepSpeed's ZeRO engine), side by
side with lslm."""
