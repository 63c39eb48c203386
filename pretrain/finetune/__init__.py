"""ELMo + baseline against the baseline: the ELMo paper's recipe and its table, for our models.

The biLM is frozen and its layers embedded once (cached); a task network (a
biLSTM tagger, with a CRF for span tasks, or a biLSTM encoder with pooling for
sentence labels) is trained over context-free token representations alone
(the baseline) and over ``[x_k; ELMo_k]`` with the task's scalar mix learned
jointly, over several seeds; the report gives both, and the increase. The
learned mix is stored as a task, as ``probe`` stores its own.

* :mod:`~elmo_pretrain.finetune.options`: the network and training options (one set
  for every task) and the command's;
* :mod:`~elmo_pretrain.finetune.data`: ids, cached biLM layers, batches;
* :mod:`~elmo_pretrain.finetune.crf`: a linear-chain CRF;
* :mod:`~elmo_pretrain.finetune.network`: the task networks (baseline, ELMo + baseline, probe);
* :mod:`~elmo_pretrain.finetune.train`: training with early stopping, metrics, seeds;
* :mod:`~elmo_pretrain.finetune.run`: one finetune from checked data to results;
* :mod:`~elmo_pretrain.finetune.report`: the table (markdown + JSON);
* :mod:`~elmo_pretrain.finetune.cli`: ``elmo-pretrain finetune``.

Data plumbing (built-in tasks, a user's JSONL, line-by-line checks) is the
probe's: :mod:`elmo_pretrain.probe.tasks`.
"""

from elmo_pretrain.lazy import lazy_exports

# the names load on first use: `elmo-pretrain prepare` and `--help` start without torch
__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "cli": ("add_finetune_commands",),
        "crf": ("CRF",),
        "network": ("TaskNetwork",),
        "options": ("FinetuneConfig", "FinetuneOptions"),
        "run": ("Finetuned", "build_task", "finetune"),
        "train": ("span_f1", "spans"),
    },
)
