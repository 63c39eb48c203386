"""Request and response bodies, with the examples shown at /docs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

from elmo_service.values import invalid_text


def _valid_text(s: str) -> str:
    why = invalid_text(s)  # the one text rule: the library and the client apply it too
    if why is not None:
        raise ValueError(why)
    return s


def _text_or_tokens(v: Any, message: str) -> str | list[str]:
    if isinstance(v, str):
        return _valid_text(v)
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        for x in v:
            _valid_text(x)
        return v
    raise ValueError(message)


def _sentence(v: Any) -> str | list[str]:
    return _text_or_tokens(v, "must be a string or a list of token strings")


_MAX_TOKEN_ID = 2**31 - 1


def _token_ids(v: list, where: str) -> list[int]:
    for j, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID:
            raise ValueError(f"{where}[{j}] must be a token id (an integer >= 0)")
    return v


def _input(v: Any) -> str | list[str] | list[list[int]]:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids (one input) or a
    list of such lists; ids come back as ``list[list[int]]`` (api/token_ids.py decodes them)."""
    if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
        return [_token_ids(v, "input")]
    if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
        for i, row in enumerate(v):
            if not row:
                raise ValueError(f"input[{i}] is an empty list of token ids")
            _token_ids(row, f"input[{i}]")
        return v
    return _text_or_tokens(
        v, "must be a string, a list of strings, a list of token ids or a list of such lists"
    )


TokenIds = Annotated[list[int], Field(min_length=1)]
# the schema says what the route enforces (an empty list is a 422 naming the field)
OpenAIInput = Annotated[
    str | list[str] | list[list[int]],
    PlainValidator(
        _input,
        json_schema_input_type=str
        | Annotated[list[str], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)],
    ),
]


Sentence = Annotated[
    str | list[str], PlainValidator(_sentence, json_schema_input_type=str | list[str])
]


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError("must be a number")
    f = float(v)
    if f != f or f in (float("inf"), float("-inf")):
        raise ValueError("must be a finite number")
    return f


Number = Annotated[float, PlainValidator(_number, json_schema_input_type=float)]


# Request models are strict (no coercion: "0" or true is not a layer index, "true" is not
# a bool) and forbid unknown fields, so a typo ("sentence") is named, never ignored.
REQUEST_CONFIG = {"extra": "forbid", "strict": True}


class EmbedRequest(BaseModel):
    model_config = ConfigDict(
        **REQUEST_CONFIG,
        json_schema_extra={
            "examples": [
                {
                    "sentences": ["The bank raised rates.", "We sat on the river bank."],
                    "output": "mix",
                },
                {
                    "sentences": [["I", "ate", "an", "apple", "."]],
                    "output": "layers",
                    "layers": [0, 2],
                },
                {
                    "sentences": ["Contextual vectors, pooled."],
                    "output": "mix",
                    "mix": [0.1, 0.5, 0.4],
                    "gamma": 1.0,
                    "pooling": "mean",
                    "encoding": "base64",
                    "dtype": "float16",
                },
                # 'pos' ships with the bundled model: the example works on a fresh server
                {"sentences": ["Use a registered task."], "task": "pos", "granularity": "word"},
            ]
        },
    )

    sentences: list[Sentence] = Field(
        ...,
        description="Strings (tokenized by the model's tokenizer) or lists of tokens (pre-tokenized words). "
        'An empty sentence ("" or []) gets an empty answer (no tokens; pooled: the zero vector).',
        json_schema_extra={"minItems": 1},  # an empty list is a 422 naming the field
        examples=[["The bank raised rates.", ["We", "sat", "on", "the", "river", "bank", "."]]],
    )
    output: Literal["layers", "mix", "both"] | None = Field(
        None,
        description="What to return. Default: 'mix' when task or mix is given, else 'layers'.",
    )
    layers: list[int] | None = Field(
        None,
        description="Subset of layer indices for the 'layers' output (0 = token layer).",
        examples=[[0, 2]],
    )
    task: str | None = Field(
        None, description="Name of a registered task (GET /v1/tasks) whose mix to apply."
    )
    mix: list[Number] | None = Field(
        None,
        description="Inline scalar-mix weights (unnormalised; softmax is applied): L+1, or 2L+1 per direction.",
    )
    gamma: Number | None = Field(None, description="Scale of the inline mix (default 1.0).")
    per_direction: bool | None = Field(
        None, description="Inline mix weights are per direction (2L+1)."
    )
    layer_norm: bool | None = Field(
        None, description="Normalise each layer (per sentence) before mixing."
    )
    granularity: Literal["token", "word"] = Field(
        "token", description="'word' averages the vectors of each word's tokens."
    )
    pooling: Literal["none", "mean", "max"] = Field(
        "none", description="Pool over positions: one vector per sentence."
    )
    encoding: Literal["json", "base64"] = Field(
        "json", description="'base64': little-endian C-order bytes of the array, base64-encoded."
    )
    dtype: Literal["float32", "float16"] = "float32"
    priority: Literal["interactive", "batch"] = Field(
        "interactive",
        description="The batcher's lane: interactive (served first) or batch (bulk work; "
        "a bounded share of the model while interactive work waits). docs/serving.md.",
    )


class TokenOut(BaseModel):
    text: str
    start: int
    end: int
    word: int


class WordOut(BaseModel):
    text: str
    start: int
    end: int


class ArrayOut(BaseModel):
    shape: list[int]
    dtype: Literal["float32", "float16"]
    data: list[Any] | str = Field(
        ..., description="Nested lists (json) or base64 (base64 encoding)."
    )
    indices: list[int] | None = Field(
        None, description="Layer indices of the first axis ('layers' only)."
    )


class SentenceOut(BaseModel):
    index: int
    tokens: list[TokenOut] | None = None
    words: list[WordOut] | None = None
    layers: ArrayOut | None = Field(
        None, description="[layers, positions, dim] (or [layers, dim] pooled)."
    )
    mix: ArrayOut | None = Field(None, description="[positions, dim] (or [dim] pooled).")


class ModelRef(BaseModel):
    id: str
    version: str


class EmbedUsage(BaseModel):
    sentences: int
    tokens: int
    cache_hits: int
    cache_misses: int


class EmbedResponse(BaseModel):
    object: Literal["embed_result"] = "embed_result"
    model: ModelRef
    task: str | None = None
    data: list[SentenceOut]
    usage: EmbedUsage


class EmbeddingsRequest(BaseModel):
    """OpenAI's ``POST /v1/embeddings``."""

    model_config = ConfigDict(
        **REQUEST_CONFIG,
        json_schema_extra={
            "examples": [{"input": ["The bank raised rates.", "A river bank."], "model": "default"}]
        },
    )

    input: OpenAIInput = Field(
        ...,
        description="A string, a list of strings (up to ELMO_OPENAI_MAX_INPUTS, 2048), or "
        "OpenAI token ids (a list, or a list of lists), decoded with tiktoken.",
    )
    model: str = Field(..., description="The served model's id (GET /v1/models).")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(
        None,
        description="Only the model's own width (or omitted): ELMo's vectors have no "
        "shorter prefix trained to stand alone, so a cut one would not be an embedding.",
    )
    user: str | None = None
    priority: Literal["interactive", "batch"] = Field(
        "interactive",
        description="The batcher's lane: interactive (served first) or batch (bulk work; "
        "a bounded share of the model while interactive work waits). docs/serving.md.",
    )


class EmbeddingOut(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingOut]
    model: str
    usage: EmbeddingsUsage


class TaskIn(BaseModel):
    model_config = ConfigDict(
        **REQUEST_CONFIG,
        json_schema_extra={
            "examples": [
                {"weights": [0.0, 1.0, 2.0], "gamma": 1.0},
                {"weights": [0.0, 1.0, 1.0, 0.5, 0.5], "gamma": 0.8, "per_direction": True},
            ]
        },
    )

    weights: list[Number] = Field(
        ..., description="Unnormalised mix weights: L+1, or 2L+1 with per_direction."
    )
    gamma: Number = 1.0
    per_direction: bool = False
    layer_norm: bool = False
    meta: dict[str, Any] = Field(
        default_factory=dict, description="Free-form notes (source, metrics...)."
    )


class TaskOut(BaseModel):
    name: str
    weights: list[float]
    gamma: float
    per_direction: bool
    layer_norm: bool
    meta: dict[str, Any]
    source: Literal["model", "store"] = Field(
        ..., description="'model': shipped in the artifact; 'store': stored."
    )
    overrides_model: bool
    read_only: bool


class UnreadableTask(BaseModel):
    name: str
    error: str


class TaskList(BaseModel):
    object: Literal["list"] = "list"
    n_layers: int
    data: list[TaskOut]
    unreadable: list[UnreadableTask] = Field(
        default_factory=list,
        description="Stored tasks that cannot be read (e.g. written straight into Redis), "
        "skipped: an admin can PUT them again or DELETE them.",
    )


class TaskDeleted(BaseModel):
    deleted: str
    model_task_visible: bool = Field(
        ..., description="A task of the same name shipped with the model is visible again."
    )


class TokenizerOut(BaseModel):
    type: str
    fingerprint: str


class ModelInfo(BaseModel):
    """The served model (OpenAI's model object, plus what this service knows of it)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    version: str
    path: str = Field(..., description="The artifact's folder name in the models folder "
                      "(never the server's absolute path).")  # fmt: skip
    n_layers: int = Field(..., description="Output layers (L+1: the token layer and L biLSTM).")
    dim: int = Field(..., description="Vector width (2 x projection_dim).")
    max_tokens_per_sentence: int
    config: dict[str, Any] = Field(..., description="The biLM's configuration.")
    tokenizer: TokenizerOut
    provenance: dict[str, Any]
    tasks_shipped: list[str]
    cache_key_prefix: str
    speed_path: str = Field("", description="The kernel and weights the model runs in: "
                            "'cpu-native fp32' (exact), 'cpu-native int8' / 'cpu-native bf16' "
                            "(opt-in, ELMO_WEIGHTS), 'torch'...")  # fmt: skip
    certificate: dict[str, Any] | None = Field(None, description="For int8 / bf16 weights: "
        "the largest difference from fp32 relative to the largest |value| over a fixed "
        "sentence set (max_rel_diff), measured on this model at warm-up; held-out "
        "perplexity where the artifact ships held-out text. null for fp32 (exact).")  # fmt: skip
    loaded_at: float
    warmed: bool


class ArtifactEntry(BaseModel):
    """An artifact folder in the models folder; ``error`` when it cannot be read."""

    id: str
    object: Literal["model"] = "model"
    path: str = Field(..., description="Its folder name in the models folder.")
    version: str | None = None
    created: int | None = None
    n_layers: int | None = None
    dim: int | None = None
    tokenizer: str | None = None
    provenance: dict[str, Any] | None = Field(
        None, description="A summary (plain values); the whole record with ?full=true."
    )
    error: str | None = None
    served: bool
    disk_version: str | None = Field(
        None,
        description="On the served entry: the version its folder holds now, when it was "
        "replaced after loading (the entry describes what is served).",
    )
    disk_error: str | None = Field(
        None, description="On the served entry: its folder is gone or unreadable now."
    )


class DesiredOut(BaseModel):
    id: str
    version: str
    generation: int = Field(..., description="Increases with every activation (Redis INCR).")
    at: float
    by: str = Field(..., description="The replica that recorded it.")


class SelfTestSummary(BaseModel):
    status: Literal["passed", "failed", "unchecked", "absent", "error"]
    ok: bool | None = Field(..., description="null: not held to the bound (not fp32, or absent).")
    max_rel_diff: float | None = None
    checked_at: float


class SelfTestComparison(BaseModel):
    max_abs_diff: float | None = Field(..., description="null: not finite")
    max_rel_diff: float | None = Field(
        ..., description="max |d| / max(1, |stored|); null: not finite"
    )
    worst_sentence: int | None
    within_bound: bool
    error: str | None = None


class SelfTestResult(BaseModel):
    model: ModelRef
    status: Literal["passed", "failed", "unchecked", "error"]
    ok: bool | None = Field(..., description="Every value within the bound; null: not fp32.")
    bound: dict[str, Any]
    checked_at: float
    sentences: int | None = None
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    alone: SelfTestComparison | None = Field(None, description="Each sentence alone.")
    batched: SelfTestComparison | None = Field(None, description="All in one request.")
    stored_for_version: str | None = None
    exact: bool | None = None
    seconds: float | None = None
    error: str | None = None


class ReplicaOut(BaseModel):
    id: str
    host: str
    pid: int
    served: ModelRef | None
    selftest: SelfTestSummary | None = Field(
        None, description="Its served model's last self-test (GET /v1/selftest); null: not run."
    )
    state: Literal["serving", "loading", "failed"] = Field(
        ..., description="failed: cannot load the desired model; it serves what it had."
    )
    error: str | None
    generation: int | None = Field(None, description="The desired generation it last read.")
    started_at: float | None
    heartbeat_at: float
    self: bool = Field(False, description="The replica that answered.")


class FleetOut(BaseModel):
    shared: bool = Field(..., description="true with Redis (a desired state shared by replicas).")
    desired: DesiredOut | None = Field(None, description="The last activation recorded.")
    agree: bool = Field(
        ...,
        description="Every replica serves one version (the desired one), and this view saw "
        "it all: the desired record read, no replica missing or unreadable, not stale.",
    )
    converged: int | None = Field(None, description="Replicas serving the desired model.")
    replicas_total: int
    replicas: list[ReplicaOut]
    missing: list[str] = Field(
        [], description="Replicas that stopped beating without leaving (within "
        "6 x ELMO_FLEET_TTL): this view cannot account for them.",
    )  # fmt: skip
    unreadable: int = Field(0, description="Index entries whose heartbeat cannot be read.")
    state_age: float | None = Field(
        None, description="Seconds since the answering replica last read the desired record."
    )
    stale: bool = Field(
        False, description="The answering replica has not read the fleet's state for over "
        "ELMO_FLEET_TTL: it may serve an older model than the fleet's.",
    )  # fmt: skip
    error: str | None = Field(None, description="Redis did not answer: only this replica shown.")
    recorded: DesiredOut | None = Field(
        None,
        description="In an activation's answer: the record it made (a newer activation "
        "elsewhere may already have replaced it as `desired`; the highest generation wins).",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelInfo] = Field(..., description="The served model (OpenAI-compatible).")
    served: ModelRef = Field(..., description="The model of the replica that answered.")
    models_dir: str = Field(..., description="The models folder's name (not its server path).")
    artifacts: list[ArtifactEntry]
    fleet: FleetOut


class Activated(BaseModel):
    activated: ModelInfo
    previous: ModelRef | None
    changed: bool
    fleet: FleetOut | None = Field(
        None, description="With Redis: the fleet right after this replica swapped."
    )


class Limits(BaseModel):
    """What one request may hold (``GET /v1/limits``): a client splits under these."""

    max_sentences: int = Field(..., description="Sentences (or inputs) per request.")
    max_chars: int = Field(..., description="Characters per request, all sentences together.")
    max_body_bytes: int = Field(..., description="Bytes of one request body.")
    max_response_floats: int = Field(..., description="Floats one answer may carry.")
    max_tokens_per_sentence: int
    max_queue: int = Field(..., description="Sentences the model's queue holds; more -> 429.")
    request_timeout: float = Field(..., description="Seconds a request may wait -> 503.")
    model: ModelRef
    n_layers: int
    dim: int


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class CacheState(BaseModel):
    backend: Literal["redis", "memory", "none"]
    state: str = Field(..., description="ok, down, half_open (Redis) or disabled.")
    dtype: Literal["float32", "float16"]
    ttl: int
    last_error: str | None = None
    writes: Literal["refused"] | None = Field(
        None, description="Present while Redis refuses cache writes (e.g. OOM); reads go on."
    )
    last_write_error: str | None = None
    reachable: bool | None = None
    entries: int | None = None
    bytes: int | None = None
    max_bytes: int | None = None


class FleetHealth(BaseModel):
    stale: bool = Field(..., description="The fleet's state unread for over ELMO_FLEET_TTL.")
    state_age: float = Field(..., description="Seconds since it was last read.")
    error: str | None = None


class Ready(BaseModel):
    status: Literal["ready"] = "ready"
    model: ModelRef
    queue_depth: int
    cache: CacheState
    tasks_store: Literal["file", "redis"]
    fleet: FleetHealth | None = Field(None, description="With Redis: this replica's view of it.")
    selftest: SelfTestSummary | None = Field(
        None, description="With ELMO_READY_REQUIRES_SELFTEST: the served model's self-test."
    )


class ErrorOut(BaseModel):
    code: str = Field(..., examples=["limit_exceeded"])
    message: str = Field(..., examples=["sentence 2 has 700 tokens; the limit is 512"])
    field: str | None = Field(None, examples=["sentences[2]"])


class NotReady(ErrorOut):
    status: Literal["starting", "stale", "unjoined", "selftest_failed"] = "starting"
    fleet: FleetHealth | None = None
    selftest: SelfTestSummary | None = None


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorOut, "description": desc}
    for status, desc in {
        400: "Malformed JSON",
        401: "Missing or invalid API key",
        403: "The key may not do this (writes need an admin key)",
        404: "No such route, model, task or job",
        409: "Conflict (e.g. deleting a task shipped with the model)",
        413: "A limit was exceeded (body size, sentences, tokens, characters)",
        415: "Content-Type is not application/json",
        422: "Invalid request: `field` names what is wrong",
        429: "Overloaded (queue full, or the queued work would not let the request finish "
        "within its timeout): retry after `Retry-After` seconds",
        500: "A server fault (never caused by the request), e.g. the model produced "
        "a non-finite value: nothing wrong is ever answered with a 200",
        503: "Not ready, or timed out waiting for the model",
    }.items()
}


class OpenAIError(BaseModel):
    message: str
    type: str = Field(..., examples=["invalid_request_error"])
    param: str | None = Field(None, examples=["input[2]"])
    code: str | None = Field(None, examples=["limit_exceeded"])


class OpenAIErrorOut(BaseModel):
    """OpenAI's error body, on ``/v1/embeddings`` (``api/dialects.py``)."""

    error: OpenAIError


class TeiErrorOut(BaseModel):
    """TEI's error body, on its routes (``api/dialects.py``)."""

    error: str
    error_type: str = Field(..., examples=["Validation"])


def _in_dialect(
    model: type[BaseModel], bad_request_is_400: bool
) -> dict[int | str, dict[str, Any]]:
    out = {s: {**r, "model": model} for s, r in ERROR_RESPONSES.items()}
    if bad_request_is_400:  # OpenAI answers a bad request with 400, never 422
        out[400] = {**out[400], "description": "Invalid request (OpenAI's status for it)"}
        out.pop(422)
    return out


OPENAI_ERROR_RESPONSES = _in_dialect(OpenAIErrorOut, bad_request_is_400=True)
TEI_ERROR_RESPONSES = _in_dialect(TeiErrorOut, bad_request_is_400=False)
