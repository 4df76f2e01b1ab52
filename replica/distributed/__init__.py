"""Tensor-parallel process groups (gloo on CPU, NCCL on GPU)."""
