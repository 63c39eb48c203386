"""Learn a task's scalar mix on labelled data, and measure what context buys.

ELMo's recipe (Peters et al. 2018, §3.3): freeze the biLM, learn the task's
softmax-normalised layer weights ``s`` and scale ``γ`` together with the
downstream model. Here the downstream model is linear, so the numbers are a
probe of what each layer encodes (Liu et al. 2019):

* token tasks (``pos``: Brown with 12 universal tags; ``tagging``: your own
  tags): word vectors ``[L+1, D]`` → mix → linear → tags;
* sentence tasks (``polarity``: movie reviews; ``classification``: your own
  labels): layers mean-pooled over tokens → mix → logistic regression.

One module per concern:

* :mod:`~elmo_pretrain.probe.options`: :class:`ProbeConfig` (training) and the command's options;
* :mod:`~elmo_pretrain.probe.tasks`: built-in and user task data, checked line by line;
* :mod:`~elmo_pretrain.probe.features`: the frozen model's features, cached per model version;
* :mod:`~elmo_pretrain.probe.learn`: the mix + linear probe and the per-layer runs;
* :mod:`~elmo_pretrain.probe.report`: the results table;
* :mod:`~elmo_pretrain.probe.service`: storing the task with the model or in a running service;
* :mod:`~elmo_pretrain.probe.cli`: ``elmo-pretrain probe``.

"""

import importlib

# the names load on first use: `elmo-pretrain prepare` and `--help` start without torch
_WHERE = {
    "add_probe_commands": "elmo_pretrain.probe.cli",
    "pooled_features": "elmo_pretrain.probe.features",
    "word_features": "elmo_pretrain.probe.features",
    "MixProbe": "elmo_pretrain.probe.learn",
    "ProbeResult": "elmo_pretrain.probe.learn",
    "best_mix": "elmo_pretrain.probe.learn",
    "polarity_probe": "elmo_pretrain.probe.learn",
    "pos_probe": "elmo_pretrain.probe.learn",
    "random_artifact": "elmo_pretrain.probe.learn",
    "run_probe": "elmo_pretrain.probe.learn",
    "train_probe": "elmo_pretrain.probe.learn",
    "TASK_DEFAULTS": "elmo_pretrain.probe.options",
    "ProbeConfig": "elmo_pretrain.probe.options",
    "ProbeOptions": "elmo_pretrain.probe.options",
    "results_table": "elmo_pretrain.probe.report",
    "write_report": "elmo_pretrain.probe.report",
    "check_service": "elmo_pretrain.probe.service",
    "save_task": "elmo_pretrain.probe.service",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


__all__ = [
    "TASK_DEFAULTS",
    "MixProbe",
    "ProbeConfig",
    "ProbeOptions",
    "ProbeResult",
    "add_probe_commands",
    "best_mix",
    "check_service",
    "polarity_probe",
    "pooled_features",
    "pos_probe",
    "random_artifact",
    "results_table",
    "run_probe",
    "save_task",
    "train_probe",
    "word_features",
    "write_report",
]
