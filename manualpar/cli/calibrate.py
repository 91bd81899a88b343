"""`python -m manualpar calibrate`: measure this host for the planner's cost model.

Writes a topology file (the hardware fields of `Topology`) that `python -m manualpar plan
--topology FILE` and `plan_tables(topology=load_topology(FILE, world_size))` read:

- memory bandwidth: a large tensor copied (bytes read + written per second);
- per-row cost: random rows gathered, less what their bytes cost at that bandwidth;
- per-block cost: a one-process training step of 64 tiny tables against one of a single table;
- links: two local processes exchange all_to_alls through the strategy (gloo here, NCCL on
  GPUs): the small message's time is the latency, a large one's bytes per second the bandwidth.
  One host has no inter-node link: it is written equal to the local one; edit it for a cluster;
- disk: a file written and synced, read back in large blocks (bandwidth) and as random rows
  (cost per row), in --disk-dir (default: the system's temporary folder);
- memory per rank: what the host can allocate now, divided by --ranks-per-node; and the host's
  cores, which ranks beyond them share.
Each figure is the median of --repeats runs; the machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from manualpar import ManualParallelStrategy, ManualParError, empty_init
from manualpar.embeddings import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    SparseFeatures,
    shard_embeddings,
    table_wise,
)
from manualpar.embeddings.planning import available_bytes
from manualpar.testing import run_distributed

__all__ = ["add_arguments", "measure_links", "run"]

MiB = 2**20


class CalibrationError(ManualParError, RuntimeError):
    """A measurement could not be made (no room for its file, a process failed)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--out", default="topology.json", help="the topology file to write (default %(default)s)")
    add("--ranks-per-node", type=int, default=os.cpu_count() or 1, help="processes per node")
    add("--disk-dir", default=None, help="where the disk tier would live (default: temp dir)")
    add("--repeats", type=int, default=5, help="runs per figure; the median is kept")
    add("--size-mib", type=int, default=256, help="buffer, table and file size (default 256)")


def _median_seconds(action: Callable[[], Any], repeats: int) -> float:
    action()  # warm up: first-touch pages, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_memory(size: int, repeats: int) -> tuple[float, float]:
    """(bytes per second of a copy, seconds per randomly gathered row beyond its bytes), on one
    thread, as each rank of a job runs (torchrun sets OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _memory_figures(size, repeats)
    finally:
        torch.set_num_threads(threads)


def _memory_figures(size: int, repeats: int) -> tuple[float, float]:
    source = torch.rand(size // 4)
    target = torch.empty_like(source)
    bandwidth = 2 * size / _median_seconds(lambda: target.copy_(source), repeats)
    table = source.view(-1, 64)  # rows of 256 bytes, as a 64-wide float32 table
    ids = torch.randint(0, table.shape[0], (table.shape[0] // 4,))
    gathered = _median_seconds(lambda: table.index_select(0, ids), repeats)
    moved = 2 * ids.numel() * 64 * 4  # read the rows, write the result
    return bandwidth, max(gathered - moved / bandwidth, 0.0) / ids.numel()


def _exchange(sizes: list[int], repeats: int) -> list[float]:
    """On each of two ranks: the median seconds of an all_to_all sending `size` bytes to the
    other rank, per size (run by run_distributed; the strategy does the collective)."""
    strategy = ManualParallelStrategy()
    results = []
    for size in sizes:
        elements = max(size // 4, 1)
        tensor = torch.ones(2 * elements)
        splits = [elements, elements]

        def once(tensor: torch.Tensor = tensor, splits: list[int] = splits) -> None:
            strategy.all_to_all(tensor, splits, splits, name="calibration all_to_all")

        strategy.barrier()
        results.append(_median_seconds(once, repeats))
    strategy.teardown()
    return results


def measure_links(size: int, repeats: int) -> tuple[float, float]:
    """(bytes per second each way, seconds per collective) between two local processes."""
    small, large = 1024, size // 4
    per_rank = run_distributed(
        _exchange, 2, args=([small, large], repeats), timeout=300, collective_timeout=120
    )
    latency = max(times[0] for times in per_rank)
    slowest = max(times[1] for times in per_rank)
    return large / max(slowest - latency, 1e-9), latency


def _tiny_tables_step(count: int, repeats: int) -> float:
    """Median seconds of a one-process training step of `count` 8-row tables, 1 id each."""
    strategy = ManualParallelStrategy()
    configs = [EmbeddingBagConfig(f"t{i}", 8, 8) for i in range(count)]
    with empty_init():
        ebc = EmbeddingBagCollection(configs, seed=0)
    plan = {c.name: table_wise(0) for c in configs}
    emb = shard_embeddings(ebc, strategy, plan, RowWiseAdagrad(lr=0.01))
    features = SparseFeatures.from_dict({c.name: [[1], [2]] for c in configs})

    def step() -> None:
        emb(features).values.sum().backward()

    seconds = _median_seconds(step, 3 * repeats)
    strategy.teardown()
    return seconds


def measure_blocks(repeats: int) -> float:
    """Seconds a step spends per table block beyond its rows: 64 tiny tables against one."""
    one, many = (
        run_distributed(_tiny_tables_step, 1, args=(count, repeats), timeout=300)[0]
        for count in (1, 64)
    )
    return max(many - one, 0.0) / 63


def measure_disk(folder: Path, size: int, repeats: int) -> tuple[float, float]:
    """(bytes per second of a large read, seconds per random 256-byte row read) of a file in
    `folder`, its pages dropped from the cache before each read."""
    row = 256
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix="manualpar-calibrate-") as handle:
            handle.write(os.urandom(size))
            handle.flush()
            os.fsync(handle.fileno())
            fd = handle.fileno()

            def drop() -> None:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

            def read_all() -> None:
                drop()
                for offset in range(0, size, 4 * MiB):
                    os.pread(fd, 4 * MiB, offset)

            offsets = (torch.randint(0, size // row, (4096,)) * row).tolist()

            def read_rows() -> None:
                drop()
                for offset in offsets:
                    os.pread(fd, row, offset)

            bandwidth = size / _median_seconds(read_all, repeats)
            per_row = _median_seconds(read_rows, repeats) / len(offsets)
    except OSError as error:
        raise CalibrationError(
            f"calibrate: cannot measure the disk in {folder}: {error}; pass --disk-dir with "
            f"{size // MiB} MiB free"
        ) from None
    return bandwidth, max(per_row - row / bandwidth, 0.0)


def run(args: argparse.Namespace) -> int:
    if args.ranks_per_node < 1 or args.repeats < 1 or args.size_mib < 16:
        raise CalibrationError(
            "calibrate: --ranks-per-node and --repeats must be >= 1, --size-mib >= 16"
        )
    size = args.size_mib * MiB
    folder = Path(args.disk_dir or tempfile.gettempdir())
    print(f"calibrating this host ({args.repeats} runs a figure, {args.size_mib} MiB buffers)")
    bandwidth, row_seconds = measure_memory(size, args.repeats)
    print(f"  memory: {bandwidth / 1e9:.2f} GB/s, {row_seconds * 1e9:.1f} ns a row")
    block = measure_blocks(args.repeats)
    print(f"  a table block's fixed cost in a step: {block * 1e6:.0f} us")
    link, latency = measure_links(size, args.repeats)
    print(f"  two local processes: {link / 1e9:.2f} GB/s each way, {latency * 1e6:.0f} us a call")
    disk, disk_row = measure_disk(folder, size, args.repeats)
    print(f"  disk ({folder}): {disk / 1e9:.2f} GB/s, {disk_row * 1e6:.1f} us a random row")
    free = available_bytes(torch.device("cpu")) or 0
    fields = {
        "ranks_per_node": args.ranks_per_node,
        "device_memory_bytes": free // args.ranks_per_node,
        "host_memory_bytes": free // args.ranks_per_node,
        "memory_bandwidth": round(bandwidth),
        "intra_node_bandwidth": round(link),
        "inter_node_bandwidth": round(link),  # one host: no other link to measure
        "disk_bandwidth": round(disk),
        "intra_node_latency": latency,
        "inter_node_latency": latency,
        "row_seconds": row_seconds,
        "disk_row_seconds": disk_row,
        "block_seconds": block,
        "cores_per_node": os.cpu_count() or 1,
    }
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(fields, indent=2) + "\n")
    except OSError as error:
        raise CalibrationError(f"calibrate: cannot write {out}: {error}") from None
    print(f"topology written to {out} (plan with --topology {out})")
    return 0
