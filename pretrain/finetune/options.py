"""The finetuner's options, each declared once: the task network and its training
(:class:`FinetuneConfig`, one set for every task) and the command's own
(:class:`FinetuneOptions`). ``elmo-pretrain finetune`` derives its flags from both.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from elmo_pretrain.probe.options import PROBE_PRECISIONS, TaskCommandOptions
from elmo_service.settings_base import StrictModel

ELMO_AT = ("input", "output", "both")


class FinetuneConfig(StrictModel):
    """The task network and how it is trained: chosen once, for every task (no per-task
    tuning, none on test). Small enough that three tasks x two arms x three seeds
    train on a shared 2-core CPU in about an hour (docs/finetune.md)."""

    word_dim: int = Field(100, ge=1, description="trainable word embedding size (baseline)")
    min_word_count: int = Field(
        2, ge=1, description="training words seen fewer times share the unknown-word vector"
    )
    char_dim: int = Field(16, ge=1, description="character embedding size")
    char_filters: int = Field(50, ge=1, description="character CNN filters (width 3, max-pooled)")
    max_word_chars: int = Field(20, ge=1, description="characters per word the CNN reads")
    hidden: int = Field(64, ge=1, description="biLSTM size per direction")
    dropout: float = Field(0.5, ge=0, lt=1, description="on the network's input and output")
    lr: float = Field(3e-3, gt=0, description="Adam learning rate (the mix scalars too)")
    batch_size: int = Field(16, ge=1, description="sentences per step")
    clip_norm: float = Field(5.0, gt=0, description="gradient norm clip")
    epochs: int = Field(20, ge=1, description="at most this many passes over the training split")
    patience: int = Field(
        4,
        ge=1,
        description="stop after this many epochs without a better dev score (counted once "
        "it is above 0: span F1 stays 0 until the first right span)",
    )
    max_dev_sentences: int = Field(
        1000,
        ge=0,
        description="early stopping watches the first N dev sentences (0: all); the "
        "reported dev score is the whole split's",
    )
    per_direction: bool = Field(False, description="per-direction mix (2L+1 weights)")
    elmo_at: Literal[ELMO_AT] = Field(  # type: ignore[valid-type]
        "input",
        description="where ELMo joins the network: input ([x_k; ELMo_k] into the biLSTM), "
        "output ([h_k; ELMo_k] into the classifier), or both (two mixes)",
    )
    embed_batch_tokens: int = Field(4096, ge=1, description="tokens per embedding batch")
    precision: Literal[PROBE_PRECISIONS] = Field(  # type: ignore[valid-type]
        "fp32", description="embedding precision (the finetuner embeds on the CPU)"
    )


# FinetuneConfig fields that are flags of `elmo-pretrain finetune`
CLI_CONFIG_FIELDS = (
    "hidden",
    "dropout",
    "lr",
    "batch_size",
    "epochs",
    "patience",
    "per_direction",
    "elmo_at",
    "precision",
)


class FinetuneOptions(TaskCommandOptions):
    """What ``elmo-pretrain finetune`` takes besides :class:`FinetuneConfig`'s fields."""

    seeds: int = Field(3, ge=1, description="train every network with N seeds; report mean ± std")
    first_seed: int = Field(
        0, ge=0, description="seeds are first_seed..first_seed+N-1 (to split a run over processes)"
    )
    no_baseline: bool = Field(False, description="train ELMo + baseline only")
    no_probe: bool = Field(False, description="skip the linear-probe row (ELMo mix + linear)")
    adapt: bool = Field(
        False,
        description="first continue the biLM on the task's training and dev text, never "
        "test (the paper's section 3.4, `elmo-pretrain adapt`), and add the row "
        "adapted+baseline: ELMo + baseline over the adapted biLM",
    )
    adapt_steps: int | None = Field(
        None, ge=1, description="--adapt: optimizer steps (default: adapt's)"
    )
    adapt_minutes: float | None = Field(
        None, ge=0, description="--adapt: stop adapting after this many minutes (default: adapt's)"
    )
    adapt_lr: float | None = Field(
        None, gt=0, description="--adapt: peak learning rate (default: adapt's)"
    )
    no_elmo: bool = Field(
        False,
        description="with --adapt: skip the ELMo + baseline row over the unadapted biLM (to "
        "split a benchmark's arms over processes)",
    )
    metric: Literal["auto", "accuracy", "span-f1"] = Field(
        "auto",
        description="auto: span F1 (exact BIO spans) for ner and for tagging data whose tags "
        "are all O/B-*/I-*, else accuracy",
    )
    crf: Literal["auto", "on", "off"] = Field(
        "auto", description="a CRF on the tagger: auto = when the metric is span F1"
    )
    out: str | None = Field(
        None,
        description="run folder: report.md, report.json and task.json (default "
        "runs/finetune/<task name>)",
    )
    cache: str = Field("runs/finetune-cache", description="where embedded layers are kept")
    report: str | None = Field(
        None, description="also write the markdown report here (and its .json beside it)"
    )
    task_name: str | None = Field(
        None,
        description="name to store/register the task under (default: <task>-finetuned; "
        "required for tagging and classification)",
    )
