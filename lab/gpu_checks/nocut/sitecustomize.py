"""On PYTHONPATH, makes a process's KV-sizing profile compile the whole model (no 2-layer cut):
the before side of lab/gpu_checks/startup_h100.py's cut comparison."""
import jaxengine.model_runner as _mr

_mr.PROFILE_LAYERS = 1 << 30
