"""Every collective of the strategy on this process's ranks, and what each rank must get."""

from __future__ import annotations

import torch

from manualpar import ManualParallelStrategy


def collectives_report() -> dict:
    strategy = ManualParallelStrategy()
    rank, world = strategy.rank, strategy.world_size
    x = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    out = {op: strategy.reduce(x, op=op).tolist() for op in ("sum", "mean", "max", "min")}
    out["input_after"] = x.tolist()
    out["int_mean"] = strategy.reduce(torch.tensor(rank), op="mean").item()
    out["int_sum_dtype"] = str(strategy.reduce(torch.tensor(rank), op="sum").dtype)
    out["scalar"] = strategy.all_reduce(float(rank), op="sum").item()
    to_dst = strategy.reduce(x, op="sum", dst=world - 1)
    out["dst"] = None if to_dst is None else to_dst.tolist()
    tensor = torch.full((3,), float(rank))
    out["broadcast_tensor"] = strategy.broadcast(tensor, src=world - 1).tolist()
    out["broadcast_object"] = strategy.broadcast({"from": rank, "list": [rank]}, src=0)
    out["gather"] = strategy.all_gather(torch.tensor([rank, rank * rank])).tolist()
    out["gather_object"] = strategy.all_gather_object(f"r{rank}")
    strategy.barrier("end")
    out["repr"] = repr(strategy)
    strategy.teardown()
    return out


def expected_report(rank: int, world: int) -> dict:
    firsts = [r + 1.0 for r in range(world)]
    seconds = [10.0 * (r + 1) for r in range(world)]
    return {
        "sum": [sum(firsts), sum(seconds)],
        "mean": [sum(firsts) / world, sum(seconds) / world],
        "max": [max(firsts), max(seconds)],
        "min": [min(firsts), min(seconds)],
        "input_after": [rank + 1.0, 10.0 * (rank + 1)],  # reduce leaves its input alone
        "int_mean": sum(range(world)) / world,
        "int_sum_dtype": "torch.int64",
        "scalar": float(sum(range(world))),
        "dst": [sum(firsts), sum(seconds)] if rank == world - 1 else None,
        "broadcast_tensor": [float(world - 1)] * 3,
        "broadcast_object": {"from": 0, "list": [0]},
        "gather": [[r, r * r] for r in range(world)],
        "gather_object": [f"r{r}" for r in range(world)],
    }
