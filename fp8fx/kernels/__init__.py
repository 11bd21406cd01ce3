"""Triton kernels (imported lazily: ``import fp8fx`` must work without Triton)."""
