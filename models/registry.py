"""Maps the Hugging Face `architectures` name to the family that implements it.

A family is its model class (built from `(config, dtype, rngs)`), the parser that turns its
config.json into a `ModelConfig`, and the table that turns its checkpoint's tensors into the
model's parameters (models/weights.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from flax import nnx

from jaxengine.models import gpt2, llama, opt
from jaxengine.models import phi3
from jaxengine.models import gemma
from jaxengine.models import moe
from jaxengine.models.bert import ENCODER_ARCHITECTURES
from jaxengine.models.config import ModelConfig
from jaxengine.models.weights import WeightRule


@dataclasses.dataclass(frozen=True)
class Family:
    model: type[nnx.Module]  # Model(cfg, dtype, rngs=...): __call__(ids, positions, kv, md, attention), compute_logits
    config: Callable[[Mapping], ModelConfig]  # config.json -> ModelConfig
    weights: tuple[WeightRule, ...]  # checkpoint tensor names -> parameters
    ignored: str = r"(?!)"  # checkpoint tensors the model recomputes (regex; default: none)


_LLAMA = Family(llama.ForCausalLM, llama.config_from_hf, llama.WEIGHTS, llama.IGNORED)


def _classifier_config(cfg: Mapping) -> ModelConfig:
    """A *ForSequenceClassification decoder: the causal model's body, no LM head of its own (its
    `score` head is read by the pooling engine)."""
    return dataclasses.replace(llama.config_from_hf(cfg), tie_word_embeddings=True)


# Decoder classifiers and reward models: the body runs through the generating engine's steps, and
# the pooling engine applies `score.weight` to each prompt's last hidden state.
_LLAMA_CLASSIFIER = Family(llama.ForCausalLM, _classifier_config, llama.WEIGHTS,
                           llama.IGNORED + r"|score\.weight|lm_head\.weight")
CLASSIFIER_ARCHITECTURES: frozenset[str] = frozenset(
    f"{name}ForSequenceClassification" for name in ("Llama", "Mistral", "Qwen2", "Qwen3"))
_REGISTRY: dict[str, Family] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "Phi3ForCausalLM": Family(phi3.ForCausalLM, phi3.config_from_hf, phi3.WEIGHTS, phi3.IGNORED),
    "GPT2LMHeadModel": Family(gpt2.GPT2LMHeadModel, gpt2.config_from_hf, gpt2.WEIGHTS, gpt2.IGNORED),
    "OPTForCausalLM": Family(opt.OPTForCausalLM, opt.config_from_hf, opt.WEIGHTS),
    "Gemma2ForCausalLM": Family(gemma.ForCausalLM, gemma.config_from_hf, gemma.WEIGHTS),
    "Gemma3ForCausalLM": Family(gemma.ForCausalLM, gemma.config_from_hf, gemma.WEIGHTS),
    moe.MIXTRAL: Family(moe.ForCausalLM, moe.config_from_hf, moe.MIXTRAL_WEIGHTS, moe.IGNORED),
    moe.QWEN3_MOE: Family(moe.ForCausalLM, moe.config_from_hf, moe.QWEN3_MOE_WEIGHTS, moe.IGNORED),
    **{name: _LLAMA_CLASSIFIER for name in CLASSIFIER_ARCHITECTURES},
}


# Architectures implemented but not served by the decoder path: the encoders of models/bert.py
# (embedding models, rerankers) run under the pooling runner, with no KV cache and no sampling.
_POOLING_ONLY: frozenset[str] = ENCODER_ARCHITECTURES


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_family(architecture: str) -> Family:
    if architecture in _POOLING_ONLY:
        raise ValueError(f"{architecture} is an encoder (embedding / reranking) model, not a text "
                         "generator: serve it with runner='pooling'")
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}") from None


def get_model_class(architecture: str) -> type[nnx.Module]:
    return get_family(architecture).model
