"""The lab tests' session defaults, as tests/conftest.py sets them for the product tests: no
model hub, CPU only (Mosaic and Triton kernels are lowered for CUDA, not run)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
