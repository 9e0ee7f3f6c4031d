"""Triton kernels (``opreg.backends.triton``): imported on demand, never needed by the core."""
