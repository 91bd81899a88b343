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


def after_teardown_errors(directory: str) -> dict[str, str]:
    """Each collective and process-group entry point of a torn-down strategy: what it raised
    ("ErrorType: message"), or "returned" if it gave a value."""
    from pathlib import Path

    strategy = ManualParallelStrategy(accelerator="cpu")
    world = strategy.world_size
    path = Path(directory) / f"rank{strategy.rank}"
    strategy.teardown()
    x = torch.ones(world)
    calls = {
        "barrier": lambda: strategy.barrier("end"),
        "broadcast": lambda: strategy.broadcast(x),
        "broadcast_object": lambda: strategy.broadcast({"a": 1}),
        "reduce": lambda: strategy.reduce(x, op="sum", dst=0),
        "all_reduce": lambda: strategy.all_reduce(x, op="max"),
        "all_reduce_": lambda: strategy.all_reduce_(x),
        "all_reduce_async": lambda: strategy.all_reduce_async(x),
        "all_to_all": lambda: strategy.all_to_all(x, [1] * world, [1] * world),
        "all_gather": lambda: strategy.all_gather(x),
        "all_gather_differentiable": lambda: strategy.all_gather(x, differentiable=True),
        "all_gather_object": lambda: strategy.all_gather_object("a"),
        "mesh": lambda: strategy.mesh(shard=world),
        "save_checkpoint": lambda: strategy.save_checkpoint(path, {"x": x}),
        "save_checkpoint_async": lambda: strategy.save_checkpoint_async(path, {"x": x}),
        "load_checkpoint": lambda: strategy.load_checkpoint(path, {"x": x}),
    }
    outcomes = {}
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = "returned"
        except Exception as error:
            outcomes[name] = f"{type(error).__name__}: {error}"
    return outcomes


AFTER_TEARDOWN_LABELS = {
    "barrier": "barrier('end')",
    "broadcast": "broadcast",
    "broadcast_object": "broadcast",
    "reduce": "reduce(op=sum)",
    "all_reduce": "reduce(op=max)",
    "all_reduce_": "all_reduce",
    "all_reduce_async": "all_reduce",
    "all_to_all": "all_to_all",
    "all_gather": "all_gather",
    "all_gather_differentiable": "all_gather",
    "all_gather_object": "all_gather_object",
    "mesh": "mesh()",
    "save_checkpoint": "save_checkpoint",
    "save_checkpoint_async": "save_checkpoint_async",
    "load_checkpoint": "load_checkpoint",
}


def expected_after_teardown(rank: int) -> dict[str, str]:
    """What each entry point of `after_teardown_errors` must raise on `rank`, at any world size."""
    return {
        name: f"CollectiveError: {label} called on rank {rank} after teardown(); the "
        "strategy's process group is gone, so the result would be this rank's value alone. "
        "Call teardown() once, after the script's last collective, mesh() and checkpoint "
        "save or load, or make a new ManualParallelStrategy to go on"
        for name, label in AFTER_TEARDOWN_LABELS.items()
    }
