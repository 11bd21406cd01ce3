"""Inductor lowerings for fp8fx ops (fused Triton templates arrive here); version shims in ``compat``."""
