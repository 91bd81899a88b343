"""The plain-torch baseline of bench_embeddings.py, run under torchrun: what one writes with
torch alone (nn.EmbeddingBag(sparse=True) per table or row block, ids and pooled rows exchanged
with all_to_all_single, torch.optim.Adagrad on the sparse gradients). Row-wise sends every id to
every rank and masks the rows a rank does not hold."""

from __future__ import annotations

import argparse
import time
from typing import Any


def worker_baseline(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from embedding_workload import batch_ids, local_batch, max_over_ranks, time_steps, write_result
    from torch import nn

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    batch = local_batch(args, world)
    count = batch * args.ids_per_bag
    strategy_rows = [args.rows * r // world for r in range(world + 1)]
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    if args.plan == "table_wise":
        owner = [i * world // args.tables for i in range(args.tables)]
        mine = [t for t in range(args.tables) if owner[t] == rank]
        bags = nn.ModuleList(
            nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=True) for _ in mine
        )
    else:
        lo, hi = strategy_rows[rank], strategy_rows[rank + 1]
        bags = nn.ModuleList(
            nn.EmbeddingBag(hi - lo, args.dim, mode="sum", sparse=True) for _ in range(args.tables)
        )
    for weight in bags.parameters():  # (each bag's one weight)
        nn.init.uniform_(weight, -(args.rows**-0.5), args.rows**-0.5)
    optimizer = torch.optim.Adagrad(bags.parameters(), lr=args.lr, eps=1e-8)
    init_s = max_over_ranks(time.perf_counter() - started)
    init_cpu_s = max_over_ranks(time.process_time() - cpu_started)  # all threads: load-proof

    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any, tensor: torch.Tensor, send: list[int], receive: list[int]
        ) -> torch.Tensor:
            ctx.send, ctx.receive = send, receive
            out = tensor.new_empty(sum(receive))
            dist.all_to_all_single(out, tensor, receive, send)
            return out

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            out = grad.new_empty(sum(ctx.send))
            dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive)
            return out, None, None

    offsets = torch.arange(0, world * count, args.ids_per_bag)

    def step(index: int) -> None:
        ids = batch_ids(args, rank, world, index)
        if args.plan == "table_wise":
            send_ids = torch.cat(
                [
                    ids[[t for t in range(args.tables) if owner[t] == d]].flatten()
                    for d in range(world)
                ]
            )
            sizes = [count * owner.count(d) for d in range(world)]
            got = torch.empty(len(mine) * count * world, dtype=torch.int64)
            dist.all_to_all_single(got, send_ids, [len(mine) * count] * world, sizes)
            got = got.view(world, len(mine), count)
            pooled = [bags[k](got[:, k].flatten(), offsets) for k in range(len(mine))]
            send = torch.stack(pooled, 1).view(world, len(mine), batch, args.dim).flatten()
            out = AllToAll.apply(
                send,
                [len(mine) * batch * args.dim] * world,
                [owner.count(d) * batch * args.dim for d in range(world)],
            )
        else:
            got = torch.empty(world * args.tables * count, dtype=torch.int64)
            dist.all_to_all_single(got, ids.flatten().repeat(world))
            got = got.view(world, args.tables, count)
            lo, hi = strategy_rows[rank], strategy_rows[rank + 1]
            pooled = []
            for t in range(args.tables):
                local = got[:, t].flatten()
                mask = (local >= lo) & (local < hi)
                pooled.append(
                    bags[t](
                        (local - lo).clamp(0, hi - lo - 1), offsets, per_sample_weights=mask.float()
                    )
                )
            send = torch.stack(pooled, 1).view(world, args.tables, batch, args.dim).flatten()
            out = AllToAll.apply(
                send, [send.numel() // world] * world, [send.numel() // world] * world
            )
            out = out.view(world, -1).sum(0)
        out.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps = time_steps(step, args)
    write_result(args, "baseline", steps, init_s, sharding=args.plan, init_cpu_s=init_cpu_s)
    dist.destroy_process_group()
