"""The strategy: ranks, the process group, the device, every collective and checkpoint IO.

`strategy` holds ManualParallelStrategy, `collectives` the collectives it inherits (the only
torch.distributed collective calls in manualpar), `process_group` makes and destroys the group,
`timeouts` resolves the collective timeout.
"""

from manualpar.strategy.collectives import PendingCollective, ReduceOp
from manualpar.strategy.process_group import pick_device
from manualpar.strategy.strategy import ManualParallelStrategy
from manualpar.strategy.timeouts import DEFAULT_TIMEOUT, TIMEOUT_ENV_VAR

__all__ = [
    "DEFAULT_TIMEOUT",
    "TIMEOUT_ENV_VAR",
    "ManualParallelStrategy",
    "PendingCollective",
    "ReduceOp",
    "pick_device",
]
