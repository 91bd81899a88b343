"""Checkpoint IO: sharded (torch.distributed.checkpoint) or full, committed atomically.

`save` and `load` save and load, `background` saves while training goes on, `files` owns the
directory layout and the atomic commit, `state` flattens a state mapping into leaves,
`local_shards` describes blocks of a sharded tensor to DCP, `extra` lets a module add its own
entries (e.g. a fused optimizer), `describe` reads a checkpoint without a model, `dtypes`
checks values loaded into another dtype, `writer` names the file a failed write was writing,
`agreement` turns one rank's failure into the same error on every rank. Nothing here
imports the strategy: it is passed in and used through its public API.
"""

from manualpar.checkpoint.background import PendingSave, save_checkpoint_async
from manualpar.checkpoint.describe import describe_checkpoint
from manualpar.checkpoint.files import MANIFEST, latest_checkpoint, read_manifest
from manualpar.checkpoint.load import load_checkpoint
from manualpar.checkpoint.local_shards import LocalShards, full_tensors
from manualpar.checkpoint.save import save_checkpoint

__all__ = [
    "MANIFEST",
    "LocalShards",
    "PendingSave",
    "describe_checkpoint",
    "full_tensors",
    "latest_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
    "save_checkpoint_async",
]
