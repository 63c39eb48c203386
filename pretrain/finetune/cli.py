"""``elmo-pretrain finetune TASK``: its flags (derived from the option models) and its handler.

Everything that can be wrong with the input is checked before any embedding or
training: the model (and the tasks it ships), the task name, the service, the
data line by line. Outputs go to a run folder (``runs/finetune/<name>``), never
into the model unless ``--store`` says so; each file is written atomically.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from elmo_pretrain.finetune.options import CLI_CONFIG_FIELDS, FinetuneConfig, FinetuneOptions
from elmo_pretrain.probe.tasks import BUILT_IN, task_kind
from elmo_service.errors import InputError
from elmo_service.settings_base import add_arguments, from_args


def task_name_of(o: FinetuneOptions) -> str:
    from elmo_service.scalar_mix import check_task_name

    name = o.task_name or (f"{o.task}-finetuned" if o.task in BUILT_IN else None)
    if name is None:
        raise InputError(
            f"finetune {o.task} needs --task-name (what to call the task)", field="task_name"
        )
    try:
        return check_task_name(name)
    except Exception as e:  # ConfigError names "name"; the flag is --task-name
        raise InputError(f"--task-name {name!r}: {e}", field="task_name") from None


def arms_of(o: FinetuneOptions) -> list[str]:
    """The report's rows, in order; a combination that would train nothing useful is refused."""
    if o.no_elmo and not o.adapt:
        raise InputError(
            "--no-elmo needs --adapt (it leaves only the adapted row)", field="no_elmo"
        )
    if o.no_elmo and (o.store or o.service):
        raise InputError(
            "--store / --service keep the ELMo + baseline mix: drop --no-elmo", field="no_elmo"
        )
    arms = [] if o.no_baseline else ["baseline"]
    arms += [] if o.no_elmo else ["elmo+baseline"]
    arms += ["adapted+baseline"] if o.adapt else []
    return arms + ([] if o.no_probe else ["probe"])


def adapt_options(o: FinetuneOptions) -> dict:
    """The ``--adapt-*`` flags given, as :class:`elmo_pretrain.adapt.AdaptOptions` fields."""
    given = {"steps": o.adapt_steps, "max_minutes": o.adapt_minutes, "lr": o.adapt_lr}
    return {k: v for k, v in given.items() if v is not None}


def cmd_finetune(args: argparse.Namespace) -> int:
    from elmo_pretrain.finetune.adapted import adapted_model
    from elmo_pretrain.finetune.report import (
        adaptation_line,
        results_table,
        unseen_line,
        write_report,
    )
    from elmo_pretrain.finetune.run import build_task, choose_metric, finetune
    from elmo_pretrain.probe.service import check_destinations, write_and_store
    from elmo_pretrain.probe.tasks import load_for_command
    from elmo_service.artifact import default_model_dir, load_artifact
    from elmo_service.atomic import write_json
    from elmo_service.runtime import set_threads

    o = from_args(FinetuneOptions, args)
    cfg = FinetuneConfig(
        **{k: getattr(args, k) for k in CLI_CONFIG_FIELDS if getattr(args, k) is not None}
    )
    name = task_name_of(o)
    arms = arms_of(o)
    set_threads(o.threads)
    model_dir = Path(o.model) if o.model else default_model_dir()
    # the model and every task it ships (a task with another layer count fails here, by file)
    art = load_artifact(model_dir)
    check_destinations(
        o, model_dir, name, model_version=art.version, n_layers=art.config.n_output_layers
    )
    # a dev/test label never seen in training is a wrong prediction, counted in the report
    data, classes = load_for_command(o.task, o.data, o.fetch, o.max_train, allow_unseen=True)
    tokens = task_kind(o.task) == "tokens"
    metric = choose_metric(o.metric, o.task, tokens, classes)
    if metric == "span-f1" and not tokens:
        raise InputError("--metric span-f1 needs a tagging task", field="metric")
    crf = tokens and (o.crf == "on" or (o.crf == "auto" and metric == "span-f1"))
    out = Path(o.out or f"runs/finetune/{name}")

    t0 = time.monotonic()
    log = lambda m: print(m, flush=True)  # noqa: E731
    cache = Path(o.cache) / name
    task = build_task(art, data, classes, tokens, metric, crf, cfg, cache)
    print(f"[finetune] features ready in {time.monotonic() - t0:.0f}s", flush=True)
    if unseen := unseen_line(task):
        print(f"[finetune] note: {unseen}", flush=True)
    adapted = None
    if o.adapt:
        adapted_dir, record = adapted_model(
            model_dir, art.version, data, tokens, cache, adapt_options(o), o.threads, log
        )
        adapted_art = load_artifact(adapted_dir)
        adapted_task = build_task(adapted_art, data, classes, tokens, metric, crf, cfg, cache)
        print(adaptation_line(record), flush=True)
        adapted = (adapted_art, adapted_task, record)
    seeds = list(range(o.first_seed, o.first_seed + o.seeds))
    ft = finetune(art, task, cfg, arms, seeds, name, log=log, adapted=adapted)
    print(f"[finetune] done in {time.monotonic() - t0:.0f}s")
    print(results_table(ft))

    argv = getattr(args, "argv", None) or sys.argv[1:]
    command = "elmo-pretrain " + " ".join(shlex.quote(a) for a in argv)
    title = f"{name}: finetune on {model_dir.name} ({model_dir})"
    for report in [out / "report.md", *([Path(o.report)] if o.report else [])]:
        write_report(report, title, ft, command)
        print(f"report: {report}")
    if ft.adapted_spec is not None:
        # the adapted model is shared by every process of a benchmark: its mix goes here
        write_json(out / "adapted-task.json", ft.adapted_spec.to_dict(), sort_keys=True)
        print(f"adapted task: {out / 'adapted-task.json'} (for {ft.adaptation['model']})")
    if ft.spec is not None:
        write_and_store(ft.spec, name, out, model_dir, o)
    return 0


def add_finetune_commands(sub) -> None:
    p = sub.add_parser(
        "finetune",
        help="train a task network over the frozen biLM (ELMo + baseline) against the same "
        "network without it (baseline), over several seeds; store the learned mix",
    )
    add_arguments(p, FinetuneOptions)
    add_arguments(p, FinetuneConfig, CLI_CONFIG_FIELDS)
    p.set_defaults(func=cmd_finetune)
