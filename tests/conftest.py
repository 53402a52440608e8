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
