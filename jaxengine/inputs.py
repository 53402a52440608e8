"""vLLM's prompt types: a prompt is text or token ids, as a plain dict.

`LLM.generate` and `LLMEngine.add_request` take a string, a list of token ids, or one of these.
Multimodal fields are refused by name (no model family here takes images, audio or video).
"""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[object]  # refused: text only


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text, reported back in RequestOutput.prompt when given
    multi_modal_data: NotRequired[object]  # refused: text only
