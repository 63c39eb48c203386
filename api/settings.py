"""Service settings: ``ELMO_*`` environment variables (plus ``REDIS_URL``) and ``.env``.

A bad value fails at startup with one message naming every offending variable
(:func:`load_settings`), never later in a request. The dotenv file is ``.env`` in the
working directory, another with ``ELMO_ENV_FILE=path``, none with ``ELMO_ENV_FILE=``
(the tests set that: a checkout's compose ``.env`` must not change what they see).
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AliasChoices,
    ByteSize,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from elmo_api.admission import DEFAULT_FILL_WAIT_MS, DEFAULT_MAX_QUEUE
from elmo_api.lanes import (
    DEFAULT_BATCH_NICE,
    DEFAULT_BATCH_SHARE,
)
from elmo_service.bilm.config import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_SENTENCES,
    DEFAULT_TOKEN_CACHE_SIZE,
)
from elmo_service.errors import ConfigError

log = logging.getLogger("elmo_api.settings")

REPO_ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIX = "ELMO_"
ENV_FILE_VARIABLE = "ELMO_ENV_FILE"
# read from a dotenv file, these are said at start: the compose stack's `.env` holds its keys
_SECRET_NAMES = ("ELMO_ADMIN_KEYS", "ELMO_API_KEYS")


def env_file() -> str | None:
    """The dotenv file settings read now (``ELMO_ENV_FILE``, default ``.env``; empty: none)."""
    return os.environ.get(ENV_FILE_VARIABLE, ".env") or None


def _split_keys(v: object) -> object:
    if v is None:
        return []
    if isinstance(v, str):
        return [k.strip() for k in v.split(",") if k.strip()]
    return v


class Settings(BaseSettings):
    """Every knob of the server. Environment names are ``ELMO_<FIELD>`` upper-cased."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
        populate_by_name=True,
        allow_inf_nan=False,  # ELMO_REQUEST_TIMEOUT=inf would pass gt=0 and break timers later
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # the file is chosen per instance, not at import: ELMO_ENV_FILE may change in between
        dotenv = DotEnvSettingsSource(settings_cls, env_file=env_file())
        return init_settings, env_settings, dotenv, file_secret_settings

    # -- the model -------------------------------------------------------------
    models_dir: Path = Field(REPO_ROOT / "models", description="Directory holding model artifacts.")
    model: str = Field("default", description="Artifact name inside models_dir.")
    model_path: Path | None = Field(
        None, description="Explicit artifact directory; wins over models_dir/model."
    )
    device: str = Field("auto", description="cpu, cuda, cuda:N, or auto (CUDA when available).")
    precision: Literal["fp32", "bf16", "fp16", "auto"] = Field(
        "fp32",
        description="fp32 (exact, the default), bf16 or fp16 autocast, or auto (bf16 where native).",
    )
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (default: all cores)."
    )
    weights: Literal["fp32", "int8", "bf16"] = Field(
        "fp32",
        description=(
            "int8 / bf16: the model's matrices rounded once, streamed compact where a step is "
            "bound by reading them (CPU, fp32 precision only); faster for one sentence, its "
            "error against fp32 measured at load (GET /v1/models: speed_path, certificate; "
            "docs/bench-embedder.md). Cached vectors of the modes never mix."
        ),
    )
    token_cache_size: int = Field(
        DEFAULT_TOKEN_CACHE_SIZE,
        ge=0,
        description="Embedder's per-token CNN vector cache (entries).",
    )
    warmup: bool = True

    # -- batching --------------------------------------------------------------
    batch_tokens: int = Field(
        DEFAULT_BATCH_TOKENS, ge=16, description="Padded-token budget of one model batch."
    )
    max_batch_sentences: int = Field(DEFAULT_MAX_BATCH_SENTENCES, ge=1)
    max_queue: int = Field(
        DEFAULT_MAX_QUEUE, ge=1, description="Sentences waiting for the model; more -> 429."
    )
    batch_fill_wait_ms: float = Field(
        DEFAULT_FILL_WAIT_MS,
        ge=0,
        description=(
            "Upper bound on how long the batcher waits for requests already inside the server "
            "(announced, not yet queued) before starting a batch; also at most 1/4 of the recent "
            "batch time. Never applies to an idle server. 0 = off."
        ),
    )
    request_timeout: float = Field(
        30.0, gt=0, description="Seconds a request may wait for the model -> 503."
    )

    # -- priority lanes (api/batcher.py; docs/serving.md) ----------------------------
    batch_max_queue: int | None = Field(
        None,
        ge=1,
        description="Batch-lane sentences waiting for the model (priority=batch); more -> 429. "
        "Default: ELMO_MAX_QUEUE (which bounds the interactive lane).",
    )
    interactive_thread: bool = Field(
        True,
        description="CPU: an express model thread (a second kernel instance over the same weights, "
        "one intra-op thread) runs interactive requests while the main thread computes batch "
        "work, so they never wait behind a batch; with no batch work the main thread runs them "
        "on every core. False: one model thread, interactive work first between batches.",
    )
    batch_nice: int = Field(
        DEFAULT_BATCH_NICE,
        ge=0,
        le=19,
        description="With the express thread: the main model thread (and the kernel threads it "
        "starts) runs this much nicer (Linux), so the express thread and the event loop get the "
        "CPU first when both compute (docs/serving.md: measured). 0 = same priority.",
    )
    batch_share: float = Field(
        DEFAULT_BATCH_SHARE,
        ge=0,
        le=1,
        description="Without the express thread: the batch lane's least share of the model (in "
        "tokens, over recent batches) while both lanes have work waiting: never starved.",
    )

    # -- observability -------------------------------------------------------------
    otel: bool = Field(
        False,
        description="OpenTelemetry traces (the otel extra): a caller's traceparent is "
        "continued through the batcher to the model call. Off: nothing of it is imported.",
    )
    ready_requires_selftest: bool = Field(
        False,
        description="/readyz answers 503 until the served model has passed its self-test "
        "(run once at startup and on every model swap; GET /v1/selftest runs it again).",
    )

    # -- HTTP connections (uvicorn) ---------------------------------------------------
    http_first_byte_timeout: float = Field(
        2.0,
        gt=0,
        description="Seconds a new connection may stay silent before its first byte -> 408 "
        "and closed: idle sockets cannot pile up (they never count against "
        "ELMO_HTTP_MAX_CONNECTIONS either).",
    )
    http_header_timeout: float = Field(
        10.0,
        gt=0,
        description="Seconds a connection may take to send a request's headers (from "
        "connecting, or from its first byte on a kept-alive connection) -> 408 and closed. "
        "Sockets that never send are closed after it (slowloris).",
    )
    http_body_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a request may take to send its body once its headers are in; "
        "then the connection is closed.",
    )
    http_keepalive_timeout: int = Field(
        5, ge=1, description="Seconds an idle kept-alive connection stays open (uvicorn)."
    )
    http_max_connections: int = Field(
        1024,
        ge=1,
        description="Busy connections (a request whose headers are in, not yet answered; idle "
        "ones and ones still sending their headers do not count) and requests in progress "
        "beyond which a request is answered 503 at once (JSON, Retry-After); /healthz, /readyz "
        "and /metrics always answer.",
    )
    http_send_timeout: float = Field(
        30.0,
        gt=0,
        description="Seconds a client may leave a response unread (the send buffer full, "
        "nothing drained) before the connection is closed and the answer freed.",
    )

    # -- response size -----------------------------------------------------------------
    max_response_floats: int = Field(
        16 * 1024 * 1024,
        ge=1,
        description="Floats one answer may carry (sentences x positions x layers x dim, "
        "computed before embedding); more -> 413 naming this setting.",
    )

    # -- cache -------------------------------------------------------------------
    redis_url: str | None = Field(
        None, validation_alias=AliasChoices("REDIS_URL", "ELMO_REDIS_URL", "redis_url")
    )
    cache_redis_url: str | None = Field(
        None,
        description="A separate Redis for the vector cache (bounded memory, volatile-lru, no "
        "persistence), so tasks and jobs on REDIS_URL are never evicted; default REDIS_URL.",
    )
    cache: bool = Field(True, description="Cache per-sentence layer vectors.")
    cache_dtype: Literal["float32", "float16"] = "float32"
    cache_ttl: int = Field(7 * 24 * 3600, ge=1, description="Seconds; every cache entry expires.")
    cache_max_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="In-process LRU bound (no Redis)."
    )
    redis_password: SecretStr | None = Field(
        None,
        description="Password of every Redis client (cache, tasks, fleet, jobs, rq) whose URL "
        "carries none (a URL's own redis://:PASSWORD@host wins). A wrong or missing one fails "
        "startup with one line (fail closed).",
    )
    redis_timeout: float = Field(0.25, gt=0, description="Redis socket timeouts, seconds.")
    redis_retry_interval: float = Field(
        5.0, gt=0, description="Seconds before retrying a failed Redis."
    )
    redis_prefix: str = "elmo"

    # -- the fleet: replicas on one Redis (api/fleet.py, docs/scaling.md) ------------
    replica_id: str | None = Field(
        None,
        max_length=200,
        description="This replica's name in the fleet view (default: <hostname>-<pid>).",
    )
    fleet_interval: float = Field(
        2.0,
        gt=0,
        le=60,
        description="With Redis: seconds between heartbeats and between polls of the fleet's "
        "desired model (pub/sub wakes a replica at once; the poll catches a missed message).",
    )
    fleet_ttl: float = Field(
        10.0,
        gt=0,
        le=600,
        description="Seconds a heartbeat lives: a replica silent that long leaves the fleet view "
        "(listed missing for 6x that); also the bound past which a replica that cannot read the "
        "fleet's state says it is stale.",
    )
    fleet_stale_ready: Literal["ready", "unready"] = Field(
        "ready",
        description="/readyz of a replica that could not read the fleet's state for over "
        "ELMO_FLEET_TTL: ready (default: it still embeds, with the model it has; a Redis "
        "outage must not empty the balancer) or unready (503: out of rotation until it reads "
        "the state again). Either way the view, /readyz's body and /metrics say stale. A replica "
        "that has not read it once since it started is unready whatever this says (503 "
        "fleet_unjoined): it cannot tell the fleet's model.",
    )

    @model_validator(mode="after")
    def _fleet_ttl_covers_beats(self) -> Settings:
        if self.fleet_ttl <= self.fleet_interval:
            raise ValueError(
                f"ELMO_FLEET_TTL ({self.fleet_ttl}) must exceed ELMO_FLEET_INTERVAL "
                f"({self.fleet_interval}): every replica would drop out between two heartbeats"
            )
        return self

    # -- limits --------------------------------------------------------------------
    max_sentences: int = Field(256, ge=1, description="Sentences (or inputs) per request.")
    tokenize_off_loop_sentences: int = Field(
        0,
        ge=0,
        description="A request of at least this many sentences is tokenized on a thread of "
        "its own, not the event loop, so small requests are not held up behind it (0: never; "
        "off by default: measured, it may cost batch throughput, docs/benchmarks.md).",
    )
    max_tokens_per_sentence: int = Field(512, ge=1, description="Capped by the model's own limit.")
    max_chars: int = Field(
        200_000, ge=1, description="Characters per request, all sentences together."
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # POST /v1/embed/document (docs/documents.md): a document's own size limits; each
    # chunk of its answer is held to the per-sentence token limit and the answer-size bound
    max_document_tokens: int = Field(
        1_000_000, ge=1, description="Tokens of one document (POST /v1/embed/document)."
    )
    max_document_chars: int = Field(
        4 * 1024 * 1024, ge=1, description="Characters of one document (POST /v1/embed/document)."
    )
    # POST /v1/embeddings (OpenAI's API, as its SDK and the frameworks call it)
    openai_max_inputs: int = Field(
        2048, ge=1, description="Inputs per /v1/embeddings request (OpenAI's limit)."
    )
    openai_max_chars: int = Field(
        1_600_000, ge=1, description="Characters per /v1/embeddings request, inputs together."
    )
    openai_token_encoding: str = Field(
        "cl100k_base",
        description="tiktoken encoding of token-id input when the request's model name is not "
        "one of OpenAI's (tiktoken's table decides for those).",
    )
    openai_normalize: bool = Field(
        True,
        description="/v1/embeddings answers unit-length vectors, as OpenAI's are (dot product = "
        "cosine); false: the mean of the default mix as is. /v1/embed is never normalised.",
    )
    # what documents hold at once (api/documents.py): past any, a 429 with Retry-After
    max_document_streams: int = Field(
        4, ge=1, description="Documents streamed at once; each holds a thread until it ends."
    )
    max_document_tokens_in_flight: int = Field(
        2_000_000, ge=1, description="Tokens of all the documents streamed at once."
    )
    max_document_spill_bytes: int = Field(
        16 * 1024**3,
        ge=0,
        description="Bytes all the documents streamed at once may spill to disk (4 (2L+1) P a "
        "token: ~1.5 KB for the bundled model, ~10 KB for the original ELMo).",
    )
    document_spill_dir: str | None = Field(
        None,
        description="Where documents spill (a folder per process, swept at start when its "
        "process is gone); default: <system temp>/elmo-service-spill.",
    )

    # -- auth ------------------------------------------------------------------------
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated; when set, every /v1 route needs one (or an admin key).",
    )
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated; needed for writes (tasks). None set = writes refused.",
    )

    # -- files -------------------------------------------------------------------------
    data_dir: Path = REPO_ROOT / "data"
    runs_dir: Path = REPO_ROOT / "runs"
    tasks_file: Path | None = Field(
        None, description="Task store without Redis (default <data_dir>/tasks.json)."
    )

    # -- pretraining jobs ---------------------------------------------------------------
    jobs_queue: str = Field(
        "elmo-pretrain", description="rq queue name (with REDIS_URL); workers listen on it."
    )
    jobs_embedded_worker: bool = Field(
        True,
        description="Without Redis, the API starts a local worker process for jobs itself.",
    )
    jobs_max_attempts: int = Field(
        3,
        ge=1,
        description="Lost attempts (worker died, trainer killed by a signal) before a job is failed.",
    )
    jobs_heartbeat_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds without a runner heartbeat before a running job counts as lost.",
    )
    jobs_stop_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds a cancelled/stopped trainer gets to write its checkpoint before SIGKILL.",
    )
    jobs_poll_interval: float = Field(
        0.5, gt=0, le=10, description="Runner/worker polling period, seconds."
    )
    jobs_max_memory: ByteSize | None = Field(
        None,
        description="Memory a job may need (estimated from its config; e.g. 16GiB); bigger jobs "
        "-> 422. Default: jobs_memory_fraction of this machine's memory. Set it to the workers' "
        "memory when they run on other machines.",
    )
    jobs_memory_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Share of the machine's memory a job may need (see jobs_max_memory).",
    )

    # -- pretraining jobs: bounds and the job store ---------------------------
    jobs_max_steps: int = Field(
        10_000_000, ge=1, description="Quota: the most optimizer steps one job may ask for."
    )
    jobs_max_threads: int | None = Field(
        None,
        ge=1,
        description="The most trainer threads a job may ask for (default: this machine's "
        "cores; set it to the workers' when they run elsewhere). Workers check their own.",
    )
    jobs_gpus: int | None = Field(
        None,
        ge=0,
        description="CUDA devices a worker has, for checking a job's train.device (default: "
        "this machine's). Workers check their own.",
    )
    jobs_store_timeout: float = Field(
        2.0,
        gt=0,
        le=60,
        description="Job-store (Redis) socket timeout for the API, seconds: a hanging Redis "
        "stalls /v1/jobs this long, nothing else (workers use 5x this).",
    )

    @field_validator("api_keys", "admin_keys", mode="before")
    @classmethod
    def _keys(cls, v: object) -> object:
        return _split_keys(v)

    @field_validator("redis_url", "cache_redis_url", mode="before")
    @classmethod
    def _redis_url(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.strip() or None
        if v is not None and not str(v).startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return v

    @field_validator("model")
    @classmethod
    def _model_name(cls, v: str) -> str:
        from elmo_service.errors import InputError
        from elmo_service.settings_base import check_model_name

        try:
            return check_model_name(v, "model")
        except InputError as e:
            raise ValueError(e.message.removeprefix("model: ")) from None

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.max_sentences > self.max_queue:
            raise ValueError(
                f"ELMO_MAX_SENTENCES ({self.max_sentences}) exceeds ELMO_MAX_QUEUE ({self.max_queue}): "
                "such a request could never be queued"
            )
        return self

    # -- derived ----------------------------------------------------------------------
    @property
    def resolved_model_path(self) -> Path:
        return Path(self.model_path) if self.model_path else Path(self.models_dir) / self.model

    @property
    def resolved_cache_redis_url(self) -> str | None:
        return self.cache_redis_url or self.redis_url

    @property
    def resolved_tasks_file(self) -> Path:
        return Path(self.tasks_file) if self.tasks_file else Path(self.data_dir) / "tasks.json"

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys)


def _env_name(loc: tuple) -> str:
    name = str(loc[0]) if loc else "settings"
    if name in ("REDIS_URL", "redis_url"):
        return "REDIS_URL"
    return ENV_PREFIX + name.upper()


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = err.get("loc") or ()
        where = _env_name(loc) if loc else "settings"
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if "input" in err and loc:
            lines.append(f"{where}={err['input']!r}: {msg}")
        else:
            lines.append(f"{where}: {msg}")
    return "invalid settings: " + "; ".join(lines)


# ELMO_* variables read by other parts (training, the jobs worker, the compose files):
# not Settings fields, but not typos either. Add yours here.
OTHER_VARIABLES = frozenset({
    "ELMO_JOBS_PARENT_PID", "ELMO_SOURCES_CACHE", "ELMO_TENSORBOARD", "ELMO_IMAGE",
    "ELMO_CUDA_IMAGE", "ELMO_ENV_FILE", "ELMO_API_REPLICAS", "ELMO_LB_IMAGE",
    "ELMO_KERNEL_CALIBRATION", "ELMO_KERNEL_CACHE",  # the core's kernel route (docs/serving.md)
})  # fmt: skip


def known_variables() -> set[str]:
    names = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    return names | {"ELMO_REDIS_URL"} | OTHER_VARIABLES


# settings a release retired, and why (said instead of "not a setting")
RETIRED_VARIABLES = {
    "ELMO_BATCH_SLICE_TOKENS": "batch work is no longer cut into slices: interactive requests "
    "run on the express thread (ELMO_INTERACTIVE_THREAD)",
    "ELMO_INTERACTIVE_TOPUP_TOKENS": "interactive batches no longer carry batch work along",
    "ELMO_BATCHING": "every server batches; ELMO_MAX_BATCH_SENTENCES=1 with "
    "ELMO_BATCH_FILL_WAIT_MS=0 gives one forward pass per sentence",
}


def unknown_variables(names: Iterable[str]) -> list[str]:
    """One line per ``ELMO_*`` name nothing reads, with a did-you-mean when one is close."""
    known = known_variables()
    out = []
    for name in sorted(set(names)):
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in known:
            continue
        if name.upper() in RETIRED_VARIABLES:
            out.append(f"{name} was retired and is ignored: {RETIRED_VARIABLES[name.upper()]}")
            continue
        close = difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        out.append(f"{name} is not a setting and is ignored{hint}")
    return out


_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=", re.MULTILINE)


def _env_file_names(path: str | Path | None) -> list[str]:
    """The names a dotenv file sets (only the names: values are pydantic-settings' job)."""
    try:
        return _ENV_LINE.findall(Path(path).read_text(errors="replace")) if path else []
    except OSError:
        return []


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, ``.env`` and ``overrides``; ConfigError naming the bad ones.

    An ``ELMO_*`` variable that names no setting (a typo: ``ELMO_MAX_SENTENCE``) is
    logged as a warning with the setting it was probably meant to be."""
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e), field="settings") from e
    path = env_file()
    from_file = _env_file_names(path)
    for line in unknown_variables([*os.environ, *from_file]):
        log.warning("%s", line)
    taken = [n for n in _SECRET_NAMES if n in from_file and n not in os.environ]
    if taken:  # the compose stack's `.env` holds its keys: never take them silently
        log.warning(
            "%s taken from %s (the compose stack reads that file too); %s= reads no file",
            " and ".join(taken), Path(str(path)).resolve(), ENV_FILE_VARIABLE,
        )  # fmt: skip
    return settings
