"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests forbid unknown fields (a typo must not be silently ignored) and use strict scalar
types (`"n": true` or `"max_tokens": 1.5` are errors, as on OpenAI). Fields that OpenAI defines
but this server does not implement are declared, so that they can be rejected by name when set
to anything but their neutral value (`unsupported_fields`). vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, ...) are accepted like vLLM does.

Responses follow OpenAI's shapes field for field; `stop_reason` is vLLM's extra (the stop
string or token id that ended a choice).
"""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, model_serializer

# Integers are bounded to int32 (seeds to 64 bits), so that no value the schema accepts can
# overflow a device array or a NumPy column deep inside the engine.
Int = Annotated[int, Strict(), Field(ge=-(2**31), le=2**31 - 1)]
SeedInt = Annotated[int, Strict(), Field(ge=-(2**63), le=2**64 - 1)]
Float = Annotated[float, Strict()]  # strict float still accepts JSON integers
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]
# Any JSON value: declared so that unsupported OpenAI fields are recognised and rejected by name.
JSONValue = object


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Unsupported field -> its neutral values (None always counts as neutral).
    _neutral: ClassVar[dict[str, tuple[object, ...]]] = {}

    def unsupported_fields(self) -> list[str]:
        """Names of declared-but-unimplemented fields that the request sets to a non-neutral value."""
        out = []
        for name, neutral in self._neutral.items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                out.append(name)
        return out


class StreamOptions(RequestModel):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False  # vLLM: usage on every chunk


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is accepted: the output
    always follows the schema)."""

    name: Str
    description: Str | None = None
    schema_: dict[Str, JSONValue] | None = Field(default=None, alias="schema")
    strict: Bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON valid under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: Str | None = None  # None: the first served model name
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    temperature: Float | None = None  # None: 1.0 (OpenAI's default)
    top_p: Float | None = None
    stop: Str | list[Str] | None = None
    seed: SeedInt | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[Str, Float] | None = None  # token id (as a string) -> bias, clamped to [-100, 100]
    user: Str | None = None  # accepted and ignored, as an end-user id for abuse monitoring would be
    # vLLM's extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Int | None = None  # top logprobs per prompt token (not with stream)
    allowed_token_ids: list[Int] | None = None
    bad_words: list[Str] | None = None
    truncate_prompt_tokens: Int | None = None  # keep the prompt's last k tokens (-1: max_model_len - 1)
    use_beam_search: Bool = False  # beam search with n beams, n choices best first (not with stream)
    length_penalty: Float = 1.0  # beam search: the final score is cum_logprob / length ** length_penalty
    # Structured outputs (at most one; server/structured_request.py maps them to SamplingParams)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[Str, JSONValue] | None = None  # vLLM: json, regex, choice, grammar, ...
    guided_json: Str | dict[Str, JSONValue] | None = None  # vLLM's older names
    guided_regex: Str | None = None
    guided_choice: list[Str] | None = None
    guided_grammar: Str | None = None
    guided_whitespace_pattern: Str | None = None
    guided_decoding_backend: Str | None = None  # accepted and ignored: there is one grammar backend


Prompt = Str | list[Str] | list[Int] | list[list[Int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = 16  # OpenAI's default for completions
    logprobs: Int | None = None
    echo: Bool = False
    best_of: Int | None = None  # must equal n (no server-side ranking)
    suffix: JSONValue | None = None  # not implemented
    add_special_tokens: Bool = True  # vLLM: tokenizer special tokens around a text prompt

    _neutral: ClassVar[dict[str, tuple[object, ...]]] = {"suffix": ("",)}

    def unsupported_fields(self) -> list[str]:
        out = super().unsupported_fields()
        if self.best_of is not None and self.best_of != self.n:
            out.append("best_of")
        return out


class FunctionDefinition(RequestModel):
    name: Str = Field(min_length=1)
    description: Str | None = None
    parameters: dict[Str, JSONValue] | None = None  # a JSON schema of the arguments object
    strict: Bool | None = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: Str


class NamedToolChoice(RequestModel):
    """`tool_choice` forcing one function: `{"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[dict[Str, JSONValue]] | None = None  # string or text parts
    name: Str | None = None
    tool_calls: list[dict[Str, JSONValue]] | None = None  # assistant turns, passed to the template
    tool_call_id: Str | None = None  # tool turns
    # Fields the official clients echo back on assistant messages; ignored.
    refusal: Str | None = None
    annotations: list[JSONValue] | None = None
    audio: JSONValue | None = None
    function_call: JSONValue | None = None
    reasoning_content: Str | None = None

    def template_dict(self) -> dict[str, object]:
        """The message as the chat template sees it (developer turns are system turns)."""
        out: dict[str, object] = {"role": "system" if self.role == "developer" else self.role,
                                  "content": self.content}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True  # vLLM
    continue_final_message: Bool = False  # vLLM
    chat_template_kwargs: dict[Str, JSONValue] | None = None  # vLLM: extra template variables
    # Accepted and ignored: they do not change what is generated.
    metadata: dict[Str, Str] | None = None
    service_tier: Str | None = None
    store: Bool | None = None
    # Tool calling (server/serving_tools.py). tool_choice None: "auto" with tools, else "none".
    tools: list[ChatCompletionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: Bool | None = None  # None: true (several calls may come back)
    # OpenAI features this server does not implement.
    functions: list[JSONValue] | None = None
    function_call: JSONValue | None = None
    audio: JSONValue | None = None
    modalities: list[Str] | None = None
    prediction: JSONValue | None = None
    reasoning_effort: JSONValue | None = None
    web_search_options: JSONValue | None = None
    verbosity: JSONValue | None = None

    _neutral: ClassVar[dict[str, tuple[object, ...]]] = {
        "functions": ([],), "function_call": ("none",), "audio": (),
        "modalities": (["text"],), "prediction": (), "reasoning_effort": (), "web_search_options": (),
        "verbosity": (), "store": (False,)}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(RequestModel):
    model: Str | None = None
    prompt: Str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(RequestModel):
    model: Str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template_kwargs: dict[Str, JSONValue] | None = None
    tools: list[ChatCompletionTool] | None = None  # for templates that list them
    add_special_tokens: Bool = False
    return_token_strs: Bool = False


def _tokenize_kind(body: object) -> str:
    has_messages = isinstance(body, dict) and "messages" in body or isinstance(body, TokenizeChatRequest)
    return "TokenizeChatRequest" if has_messages else "TokenizeCompletionRequest"


# vLLM's /tokenize takes either shape; the presence of `messages` decides which.
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
                            | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
                            Discriminator(_tokenize_kind)]


class DetokenizeRequest(RequestModel):
    model: Str | None = None
    tokens: list[Int]


# -- pooling requests (embedding, classification and cross-encoder models) ---------------------
EncodingFormat = Literal["float", "base64"]  # base64: little-endian float32 bytes, as OpenAI sends them


class EmbeddingRequest(RequestModel):
    """OpenAI's `/v1/embeddings` body plus vLLM's extras; vLLM's `/pooling` takes the same."""

    model: Str | None = None
    input: Prompt  # a text, texts, token ids, or lists of token ids
    encoding_format: EncodingFormat = "float"
    dimensions: Int | None = None  # keep the first k dimensions (Matryoshka), then normalise
    user: Str | None = None  # accepted and ignored
    truncate_prompt_tokens: Int | None = None  # keep each prompt's last k tokens (-1: max_model_len)
    normalize: Bool | None = None  # None: the model's default (embeddings), off (/pooling)


PoolingRequest = EmbeddingRequest


class ClassificationRequest(RequestModel):
    model: Str | None = None
    input: Prompt
    user: Str | None = None
    truncate_prompt_tokens: Int | None = None
    activation: Bool | None = None  # False: the raw logits instead of softmax / sigmoid


class ScoreRequest(RequestModel):
    """Pairs one text_1 with each text_2, or the i-th with the i-th."""

    model: Str | None = None
    text_1: Str | list[Str]
    text_2: Str | list[Str]
    truncate_prompt_tokens: Int | None = None
    activation: Bool | None = None  # cross-encoders: False gives the raw logit
    user: Str | None = None


class RerankRequest(RequestModel):
    """vLLM's Jina / Cohere-compatible rerank body."""

    model: Str | None = None
    query: Str
    documents: list[Str]
    top_n: Int | None = None  # None or 0: every document (vLLM's 0)
    return_documents: Bool = True
    truncate_prompt_tokens: Int | None = None
    activation: Bool | None = None
    user: Str | None = None


# -- responses ---------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "jaxengine"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestModel):
    """`POST /v1/load_lora_adapter` (vLLM's body)."""

    lora_name: Str
    lora_path: Str


class UnloadLoRAAdapterRequest(RequestModel):
    """`POST /v1/unload_lora_adapter` (vLLM's body; `lora_int_id` is accepted and ignored: the
    server numbers adapters itself)."""

    lora_name: Str
    lora_int_id: Int | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's per-token entry of `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first is null): token id -> its logprob.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer protocol
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call: `id`, `type` and `function.name` come in a call's
    first piece, then `function.arguments` pieces that concatenate to the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer protocol
        return {k: v for k, v in handler(self).items() if v is not None}


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None  # vLLM: the model's thinking (--reasoning-parser)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    """A streamed message fragment: only the keys that are set (`{}` on the final chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # noqa: ANN001, ANN202 - pydantic's serializer protocol
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


# -- pooling responses ------------------------------------------------------------------------------
class PoolingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


class ClassificationData(BaseModel):
    index: int
    label: str | None  # id2label of the most probable class
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=_now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int  # the document's position in the request
    document: RerankDocument | None = None  # left out with return_documents=false
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # best first
