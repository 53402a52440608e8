"""Test-session defaults and shared fixtures.

No test may reach the model hub (CI machines are offline). Tests run on the CPU; compiled
programs are shared across engine instances through a session-wide compilation cache.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer (built once from the GGUF), saved as a plain HF tokenizer folder."""
    from jaxengine.default_model import default_model_path
    from jaxengine.models.checkpoint import open_checkpoint

    path = str(tmp_path_factory.mktemp("smollm2_tokenizer"))
    open_checkpoint(default_model_path()).load_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla_cache"))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_tokenizer_dir):
    """family -> folder with a tiny random checkpoint of that family and the SmolLM2 tokenizer."""
    import transformers

    from tests.tiny_checkpoints import make_checkpoint

    made: dict[str, str] = {}
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)

    def get(family: str) -> str:
        if family not in made:
            made[family] = make_checkpoint(family, str(tmp_path_factory.mktemp(family)), tokenizer=tok)
        return made[family]

    return get


@pytest.fixture(scope="session")
def smollm2_reference():
    """transformers' SmolLM2-135M-Instruct from the embedded GGUF (float32, eval mode), loaded once
    for the real-model tests that compare against it (read only: forward and generate)."""
    import torch
    import transformers

    from jaxengine.default_model import DEFAULT_MODEL_FILE, default_model_path
    from tests.hf_gguf import cached_gguf_name_map

    path = default_model_path()
    with cached_gguf_name_map():  # the same model, loaded faster
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32).eval()
