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

from elmo_pretrain.lazy import lazy_exports

# the names load on first use: `elmo-pretrain prepare` and `--help` start without torch
__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "cli": ("add_probe_commands",),
        "features": ("pooled_features", "word_features"),
        "learn": (
            "MixProbe",
            "ProbeResult",
            "best_mix",
            "polarity_probe",
            "pos_probe",
            "random_artifact",
            "run_probe",
            "train_probe",
        ),
        "options": ("TASK_DEFAULTS", "ProbeConfig", "ProbeOptions"),
        "report": ("results_table", "write_report"),
        "service": ("check_service", "save_task"),
    },
)
