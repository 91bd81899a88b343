"""The strategy's in-place, asynchronous and all-to-all collectives, and collectives over a
subgroup: on real gloo processes, against values computed by hand."""

from __future__ import annotations

import torch
import torch.distributed as dist

from manualpar import ManualParallelStrategy
from manualpar.testing import run_distributed


def _all_to_all_report() -> dict[str, list[float]]:
    """Rank r sends r+1 copies of (10 r + d) to each rank d: uneven splits both ways."""
    strategy = ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    send = [rank + 1] * world
    receive = [sender + 1 for sender in range(world)]
    tensor = torch.cat([torch.full((rank + 1,), 10.0 * rank + d) for d in range(world)])
    blocking = strategy.all_to_all(tensor, send, receive, name="test all_to_all")
    pending = strategy.all_to_all_async(tensor * 2, send, receive, name="test async")
    in_place = torch.full((3,), float(rank + 1))
    returned = strategy.all_reduce_(in_place, "sum", name="test in place")
    bucket = torch.full((2,), float(rank))
    future = strategy.all_reduce_async(bucket, name="test bucket").future()
    return {
        "blocking": blocking.tolist(),
        "async": pending.wait().tolist(),
        "in_place": in_place.tolist(),
        "same_object": [float(returned is in_place)],
        "future": future.wait().tolist(),
        "bucket": bucket.tolist(),
    }


def test_all_to_all_and_in_place_reductions_on_3_ranks() -> None:
    world = 3
    for rank, report in enumerate(run_distributed(_all_to_all_report, world_size=world)):
        expected = [10.0 * sender + rank for sender in range(world) for _ in range(sender + 1)]
        assert report["blocking"] == expected
        assert report["async"] == [2 * value for value in expected]
        assert report["in_place"] == [6.0] * 3  # 1 + 2 + 3, written into the tensor passed
        assert report["same_object"] == [1.0]
        assert report["future"] == report["bucket"] == [3.0, 3.0]  # 0 + 1 + 2


def _subgroup_report() -> dict[str, float] | None:
    """Ranks 0 and 2 of 3 form a group; rank 1 sits it out."""
    strategy = ManualParallelStrategy()
    pair = dist.new_group([0, 2])
    if strategy.rank == 1:
        return None
    value = torch.tensor(float(strategy.rank + 1))
    gathered = strategy.all_gather(value, group=pair)
    received = strategy.all_to_all(
        torch.tensor([float(strategy.rank), 100.0 + strategy.rank]), [1, 1], [1, 1], group=pair
    )
    return {
        "sum": float(strategy.all_reduce(value, "sum", group=pair)),
        "mean": float(strategy.all_reduce(value, "mean", group=pair)),
        "size": float(strategy.group_size(pair)),
        "gathered": float(gathered.sum()),
        "from_pair": float(received[1 if strategy.rank == 0 else 0]),
        "broadcast": float(
            strategy.broadcast(torch.tensor(float(strategy.rank)), src=1, group=pair)
        ),
    }


def test_collectives_over_a_subgroup_use_its_ranks_and_size() -> None:
    first, skipped, last = run_distributed(_subgroup_report, world_size=3)
    assert skipped is None
    assert first is not None and last is not None
    for report in (first, last):
        assert report["sum"] == 4.0  # ranks 0 and 2 hold 1 and 3
        assert report["mean"] == 2.0  # divided by the group's size, not the world's
        assert report["size"] == 2.0
        assert report["gathered"] == 4.0
        assert report["broadcast"] == 2.0  # src=1 is the group's second member: global rank 2
    # element i of each member goes to the group's rank i (global ranks 0 and 2)
    assert first["from_pair"] == 2.0  # global rank 2's element 0
    assert last["from_pair"] == 100.0  # global rank 0's element 1


def _bad_splits() -> str:
    strategy = ManualParallelStrategy()
    try:
        strategy.all_to_all(torch.zeros(3), [1, 1], [1, 1], name="exchange")
    except ValueError as error:
        return str(error)
    return "no error"


def test_all_to_all_refuses_splits_that_do_not_cover_the_tensor() -> None:
    for message in run_distributed(_bad_splits, world_size=2):
        assert message == (
            "exchange: the send splits add up to 2 elements but the tensor has 3; "
            "send exactly the tensor's elements"
        )
