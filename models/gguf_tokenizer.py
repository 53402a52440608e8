"""Byte-level BPE tokenizers ("gpt2" in GGUF metadata) built straight from a GGUF file's vocabulary.

Built with the `tokenizers` library and wrapped as a transformers `PreTrainedTokenizerFast`, so
no PyTorch is needed (transformers' own GGUF path imports it). SentencePiece-style vocabularies
("llama") fall back to transformers.
"""

from __future__ import annotations

from typing import Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# llama.cpp pre-tokenizer names whose Hugging Face originals split every digit on its own.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell", "smaug-bpe"}
# llama.cpp token types
_CONTROL, _USER_DEFINED = 3, 4
# The Llama 3 / Qwen2 split pattern (llama.cpp "llama-bpe", "qwen2").
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_bpe_tokenizer(meta: Callable[[str], object]) -> PreTrainedTokenizerFast:
    """meta(key) -> value of a `tokenizer.*` GGUF field (None when absent)."""
    tokens = [str(t) for t in meta("tokenizer.ggml.tokens")]
    merges = [tuple(str(m).split(" ", 1)) for m in (meta("tokenizer.ggml.merges") or [])]
    types = list(meta("tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = str(meta("tokenizer.ggml.pre") or "default")
    tok = Tokenizer(models.BPE({s: i for i, s in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in ("llama-bpe", "llama3", "qwen2"))
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3", "qwen2"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
                for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(specials)

    def token(key: str) -> str | None:
        idx = meta(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=token("bos"), eos_token=token("eos"), unk_token=token("unknown"),
        pad_token=token("padding"), clean_up_tokenization_spaces=False)
    add_bos = meta("tokenizer.ggml.add_bos_token")
    if add_bos and fast.bos_token is not None:
        # prepend bos on encode, as llama.cpp does for such vocabularies
        from tokenizers import processors
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fast.bos_token} $A", pair=f"{fast.bos_token} $A $B",
            special_tokens=[(fast.bos_token, int(meta("tokenizer.ggml.bos_token_id")))])
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=fast.bos_token, eos_token=fast.eos_token, unk_token=fast.unk_token,
            pad_token=fast.pad_token, clean_up_tokenization_spaces=False)
    template = meta("tokenizer.chat_template")
    if template:
        fast.chat_template = str(template)
    return fast
