"""ELMo + baseline against the baseline: the ELMo paper's recipe and its table, for our models.

The biLM is frozen and its layers embedded once (cached); a task network (a
biLSTM tagger, with a CRF for span tasks, or a biLSTM encoder with pooling for
sentence labels) is trained over context-free token representations alone
(the baseline) and over ``[x_k; ELMo_k]`` with the task's scalar mix learned
jointly, over several seeds; the report gives both, and the increase. The
learned mix is stored as a task, as ``probe`` stores its own.

* :mod:`~pretrain.finetune.options`: the network and training options (one set
  for every task) and the command's;
* :mod:`~pretrain.finetune.data`: ids, cached biLM layers, batches;
* :mod:`~pretrain.finetune.crf`: a linear-chain CRF;
* :mod:`~pretrain.finetune.network`: the task networks (baseline, ELMo + baseline, probe);
* :mod:`~pretrain.finetune.train`: training with early stopping, metrics, seeds;
* :mod:`~pretrain.finetune.run`: one finetune from checked data to results;
* :mod:`~pretrain.finetune.report`: the table (markdown + JSON);
* :mod:`~pretrain.finetune.cli`: ``elmo-pretrain finetune``.

Data plumbing (built-in tasks, a user's JSONL, line-by-line checks) is the
probe's: :mod:`pretrain.probe.tasks`.
"""

from pretrain.finetune.cli import add_finetune_commands
from pretrain.finetune.crf import CRF
from pretrain.finetune.network import TaskNetwork
from pretrain.finetune.options import FinetuneConfig, FinetuneOptions
from pretrain.finetune.run import Finetuned, build_task, finetune
from pretrain.finetune.train import span_f1, spans

__all__ = [
    "CRF",
    "FinetuneConfig",
    "FinetuneOptions",
    "Finetuned",
    "TaskNetwork",
    "add_finetune_commands",
    "build_task",
    "finetune",
    "span_f1",
    "spans",
]
