"""Corpus-scale embedding: ``elmo-service embed-bulk`` on Ray Data (docs/bulk.md).

* ``plan``: options, the shards cut from the inputs, the layout, the mix (the driver);
* ``shard``: one shard's work (read, tokenize, embed, Parquet, manifest) and its check;
* ``cluster``: the Ray run (a local loopback cluster or ``--address``, the actor pool);
* ``reaper``: ends a local cluster's processes when its driver ends, however it ends;
* ``run``: ``run_bulk``, the driver that ties them together.

The core never imports Ray at import time: ``ray`` and ``pyarrow`` are the optional
extra ``elmo-service[bulk]``, imported inside the functions that need them.
"""

from elmo_bulk.plan import (
    MANIFESTS,
    SKIPPED_FILE,
    BulkOptions,
    Shard,
    resolve_mix,
    scan_inputs,
)
from elmo_bulk.run import BulkSummary, run_bulk
from elmo_bulk.shard import ShardResult, embed_shard, verify_shard

__all__ = [
    "MANIFESTS",
    "SKIPPED_FILE",
    "BulkOptions",
    "BulkSummary",
    "Shard",
    "ShardResult",
    "embed_shard",
    "resolve_mix",
    "run_bulk",
    "scan_inputs",
    "verify_shard",
]
