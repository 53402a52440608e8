"""The laboratory: kernel probes, one-off GPU checks, kernel development notes and their
results and tests. Not part of the installed package (pyproject lists no lab package); run its
scripts and tests from the repository root, which puts `lab` and `tests` on the import path.
The product is imported as jaxengine.* (pallas_kernels/, models/, ...)."""
