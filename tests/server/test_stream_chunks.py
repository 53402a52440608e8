"""The templated stream chunks (server/stream_chunks.py) are byte for byte pydantic's dumps."""

from __future__ import annotations

import numpy as np
import pytest

from jaxengine.server.protocol import (ChatCompletionStreamResponse, ChatStreamChoice, CompletionChoice,
                                       CompletionStreamResponse, DeltaMessage)
from jaxengine.server.serving_common import sse
from jaxengine.server.stream_chunks import ChunkTemplate, chat_content_choice, completion_choice

# Every ASCII character (control characters, quotes, backslash, DEL), the line and paragraph
# separators JavaScript treats as line ends, accents, CJK, an emoji outside the BMP, U+FFFD.
TEXTS = ["", "plain", "".join(map(chr, range(128))), 'say "hi"\\n', "a\u2028b\u2029c", "é ñ 中文 😀 \ufffd",
         "\x00\x1f\x7f\x80\x9f", "</script>", '"choices":[]']
# Served model names may be anything, including the key the template splits at.
NAMES = ["tiny", 'we"ird \\ "choices":[] \u00e9']


@pytest.mark.parametrize("model", NAMES)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", [(None, None), ("length", None), ("stop", 2), ("stop", np.int64(7)),
                                         ("stop", "END\n\"x\""), ("abort", None)])
def test_completion_chunk_equals_pydantic(model: str, text: str, finish: str | None, stop: int | str | None) -> None:
    full = CompletionStreamResponse(id="cmpl-1-0", created=1700000000, model=model,
                                    choices=[CompletionChoice(index=3, text=text, finish_reason=finish,
                                                              stop_reason=stop)])
    template = ChunkTemplate(CompletionStreamResponse(id="cmpl-1-0", created=1700000000, model=model, choices=[]))
    assert template.event(completion_choice(3, text, finish, stop)) == sse(full.model_dump_json())


@pytest.mark.parametrize("model", NAMES)
@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_chat_chunk_equals_pydantic(model: str, text: str) -> None:
    full = ChatCompletionStreamResponse(id="chatcmpl-1", created=1700000000, model=model,
                                        choices=[ChatStreamChoice(index=1, delta=DeltaMessage(content=text))])
    template = ChunkTemplate(ChatCompletionStreamResponse(id="chatcmpl-1", created=1700000000, model=model,
                                                          choices=[]))
    assert template.event(chat_content_choice(1, text)) == sse(full.model_dump_json())
