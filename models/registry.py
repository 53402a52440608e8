"""Maps the Hugging Face `architectures` name to the model class that implements it."""

from __future__ import annotations

from jaxengine.models.llama import ForCausalLM

_REGISTRY: dict[str, type[ForCausalLM]] = {
    "LlamaForCausalLM": ForCausalLM,
    "MistralForCausalLM": ForCausalLM,
    "Qwen2ForCausalLM": ForCausalLM,
    "Qwen3ForCausalLM": ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[ForCausalLM]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None
