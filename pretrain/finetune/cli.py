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

from elmo_service.errors import InputError
from elmo_service.settings_base import add_arguments, from_args
from pretrain.finetune.options import CLI_CONFIG_FIELDS, FinetuneConfig, FinetuneOptions
from pretrain.probe.tasks import BUILT_IN, task_kind


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


def cmd_finetune(args: argparse.Namespace) -> int:
    from elmo_service.artifact import default_model_dir, load_artifact
    from elmo_service.runtime import set_threads
    from pretrain.finetune.report import results_table, unseen_line, write_report
    from pretrain.finetune.run import build_task, choose_metric, finetune
    from pretrain.probe.service import check_destinations, write_and_store
    from pretrain.probe.tasks import load_for_command

    o = from_args(FinetuneOptions, args)
    cfg = FinetuneConfig(
        **{k: getattr(args, k) for k in CLI_CONFIG_FIELDS if getattr(args, k) is not None}
    )
    name = task_name_of(o)
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
    task = build_task(art, data, classes, tokens, metric, crf, cfg, Path(o.cache) / name)
    print(f"[finetune] features ready in {time.monotonic() - t0:.0f}s", flush=True)
    if unseen := unseen_line(task):
        print(f"[finetune] note: {unseen}", flush=True)
    arms = [*([] if o.no_baseline else ["baseline"]), "elmo+baseline"]
    arms += [] if o.no_probe else ["probe"]
    seeds = list(range(o.first_seed, o.first_seed + o.seeds))
    ft = finetune(art, task, cfg, arms, seeds, name, log=lambda m: print(m, flush=True))
    print(f"[finetune] done in {time.monotonic() - t0:.0f}s")
    print(results_table(ft))

    argv = getattr(args, "argv", None) or sys.argv[1:]
    command = "elmo-pretrain " + " ".join(shlex.quote(a) for a in argv)
    title = f"{name}: finetune on {model_dir.name} ({model_dir})"
    for report in [out / "report.md", *([Path(o.report)] if o.report else [])]:
        write_report(report, title, ft, command)
        print(f"report: {report}")
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
