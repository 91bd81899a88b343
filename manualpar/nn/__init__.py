"""Dense layers of recommendation models, plain `nn.Module`s built only on torch.

`CrossNet` is DCN-v2's cross network (full-rank, or low-rank with `rank=`). The layers hold
their parameters directly and define `reset_parameters()`, so they can be declared under
`mp.empty_init()` and materialized, or sharded with `mp.fsdp`, like any torch layer.
"""

from manualpar.nn.cross_net import CrossNet

__all__ = ["CrossNet"]
