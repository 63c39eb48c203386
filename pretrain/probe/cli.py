"""``elmo-pretrain probe TASK``: its flags (derived from the option models) and its handler."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from elmo_pretrain.probe.options import (
    CLI_CONFIG_FIELDS,
    PER_KIND,
    TASK_DEFAULTS,
    ProbeConfig,
    ProbeOptions,
    probe_config,
)
from elmo_pretrain.probe.tasks import BUILT_IN, task_kind
from elmo_service.errors import InputError
from elmo_service.settings_base import add_arguments, from_args


def cmd_probe(args: argparse.Namespace) -> int:
    from elmo_pretrain.probe.learn import polarity_probe, pos_probe
    from elmo_pretrain.probe.report import results_table, write_report
    from elmo_pretrain.probe.service import check_destinations, write_and_store
    from elmo_pretrain.probe.tasks import load_for_command
    from elmo_service.artifact import default_model_dir, read_header
    from elmo_service.runtime import set_threads
    from elmo_service.scalar_mix import check_task_name

    o = from_args(ProbeOptions, args)
    task, kind = o.task, task_kind(o.task)
    cfg = probe_config(kind, **{k: getattr(args, k) for k in CLI_CONFIG_FIELDS})
    name = o.task_name or (task if task in BUILT_IN else None)
    if name is None:
        raise InputError(
            f"probe {task} needs --task-name (what to call the task)", field="task_name"
        )
    check_task_name(name)
    model_dir = Path(o.model) if o.model else default_model_dir()
    # a wrong --model fails here, before any data is read or fetched
    header = read_header(model_dir)
    # the mix is learned on the local model: a service must serve that same version
    check_destinations(
        o, model_dir, name, model_version=header.version, n_layers=header.config.n_output_layers
    )
    set_threads(o.threads)
    data, classes = load_for_command(task, o.data, o.fetch, o.max_train)
    cache = Path(o.cache) / name
    if kind == "tokens":
        results, spec = pos_probe(model_dir, data, classes, cache, cfg, task=name)
    else:
        index = {c: i for i, c in enumerate(classes)}
        data = {s: [(t, index[y]) for t, y in rows] for s, rows in data.items()}
        results, spec = polarity_probe(model_dir, data, cache, cfg, task=name, classes=classes)
    print(results_table(results))
    argv = getattr(args, "argv", None) or sys.argv[1:]
    command = "elmo-pretrain " + " ".join(shlex.quote(a) for a in argv)
    # outputs go to a run folder; the model (a tracked file, maybe) only with --store
    out = Path(o.out or f"runs/probe/{name}")
    for report in [out / "report.md", *([Path(o.report)] if o.report else [])]:
        write_report(report, f"{name} probe of {model_dir.name}", results, command)
        print(f"report: {report}")
    write_and_store(spec, name, out, model_dir, o)
    return 0


def add_probe_commands(sub) -> None:
    p = sub.add_parser(
        "probe", help="learn a task's scalar mix on labelled data and report per-layer accuracy"
    )
    add_arguments(p, ProbeOptions)
    tok, sent = TASK_DEFAULTS["tokens"], TASK_DEFAULTS["sentences"]
    per_kind = {
        k: f"{getattr(tok, k)} for token tasks, {getattr(sent, k)} for sentence tasks"
        for k in PER_KIND
    }
    add_arguments(p, ProbeConfig, CLI_CONFIG_FIELDS, deferred=per_kind)
    p.set_defaults(func=cmd_probe)
