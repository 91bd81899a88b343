"""materialize on real processes: each rank allocates only its share of the layers, with the
values one process would give them, and leaves a weight a builder already sharded alone."""

from __future__ import annotations

import resource

import torch
from torch import nn

import manualpar as mp
from manualpar.meta import empty_init, is_meta, materialize
from manualpar.testing import run_distributed

MB = 1024 * 1024
LAYERS, WIDTH = 8, 2048


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _materialize_my_layers() -> dict:
    strategy = mp.ManualParallelStrategy()
    # torch imports its meta-tensor machinery (sympy, mpmath: ~40 MB) at the first to_empty;
    # load it before the baseline, so the growth measured is the parameters' memory alone
    nn.Linear(2, 2, device="meta").to_empty(device="cpu")
    before = _peak_rss()
    with empty_init():
        model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    others = [str(i) for i in range(LAYERS) if i % strategy.world_size != strategy.rank]
    materialize(model, strategy, skip=others, seed=5)
    mine = [i for i in range(LAYERS) if str(i) not in others]
    result = {
        "before": before,
        "peak": _peak_rss(),
        "mine": mine,
        "share": sum(p.numel() * p.element_size() for i in mine for p in model[i].parameters()),
        "full": sum(p.numel() * p.element_size() for p in model.parameters()),
        "meta": [i for i in range(LAYERS) if is_meta(model[i])],
        "corners": {i: model[i].weight[:2, :4].detach().clone() for i in mine},
        "sharded_layer": _materialize_beside_a_sharded_weight(strategy.world_size),
    }
    strategy.teardown()
    return result


def _materialize_beside_a_sharded_weight(world_size: int) -> dict:
    """A builder already sharded the weight (a DTensor with a real local shard); only the meta
    bias of the same Linear is materialized."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    with empty_init():
        layer = nn.Linear(4, 4)
    layer.weight = nn.Parameter(distribute_tensor(torch.full((4, 4), 3.0), mesh, [Shard(0)]))
    weight = layer.weight
    materialize(layer, "cpu")
    return {
        "weight_ids": (id(layer.weight), id(weight)),  # the same object: not replaced
        "bias_device": layer.bias.device.type,
        "local_shard": weight.to_local().detach().clone(),
    }


def test_each_rank_allocates_only_its_share() -> None:
    results = run_distributed(_materialize_my_layers, world_size=2, timeout=60)
    assert [r["mine"] for r in results] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    for rank, result in enumerate(results):
        share, full = result["share"], result["full"]
        assert share == 4 * (WIDTH * WIDTH + WIDTH) * 4 and full == 2 * share
        assert result["meta"] == [i for i in range(LAYERS) if i % 2 != rank]
        kept_id, sharded_id = result["sharded_layer"]["weight_ids"]
        assert kept_id == sharded_id, "materialize replaced a weight a builder had sharded"
        assert result["sharded_layer"]["bias_device"] == "cpu"
        torch.testing.assert_close(
            result["sharded_layer"]["local_shard"], torch.full((2, 4), 3.0), rtol=0, atol=0
        )
        assert result["peak"] < share + 400 * MB, (rank, result["peak"] / MB)
        grown = result["peak"] - result["before"]
        assert grown < (share + full) / 2, f"rank {rank} grew {grown / MB:.0f} MB"
    with empty_init():
        reference = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    materialize(reference, "cpu", seed=5)  # one process, all layers: the same values
    for result in results:
        for index, corner in result["corners"].items():
            assert torch.equal(corner, reference[index].weight[:2, :4]), index
