"""Learning-rate schedules, gradient clipping and frozen tables of a fused optimizer: a job that
trains a sharded collection (run on each rank) and the single-process reference it must equal.

The reference trains the unsharded collection with torch's sparse optimizers (row-wise Adagrad
written out), driven by torch's own scheduler; clipping is computed on the dense table gradient
(`torch.nn.utils.clip_grad_norm_` for the global norm), then the clipped rows become the sparse
gradient the optimizer applies; a frozen table has requires_grad=False, so torch skips it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from embedding_cases import (
    SEED,
    TABLES,
    local_loss,
    make_batch,
    mixed_plan,
    optimizer,
    uniform_plan,
)
from torch.optim import lr_scheduler as sched

import manualpar as mp
from manualpar.checkpoint.local_shards import full_tensors
from manualpar.embeddings import EmbeddingBagCollection, UpdateRule, shard_embeddings

NAMES = tuple(t.name for t in TABLES)
ALL = frozenset(NAMES)
BATCHES = (5, 3)
SCHEDULE_STEPS = 6  # OneCycleLR's whole cycle; jobs train at most this many steps


def _decay(step: int) -> float:
    return 1 / (1 + 0.5 * step)


def make_schedule(name: str | None, opt: torch.optim.Optimizer) -> Any:
    """One of torch's schedulers (or a chain of them) over `opt`, for up to SCHEDULE_STEPS."""
    if name is None:
        return None
    if name == "step":
        return sched.StepLR(opt, step_size=2, gamma=0.5)
    if name == "lambda":
        return sched.LambdaLR(opt, _decay)
    if name == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=4, eta_min=0.01)
    if name == "onecycle":  # fused rules have no momentum to cycle
        return sched.OneCycleLR(opt, max_lr=0.8, total_steps=SCHEDULE_STEPS, cycle_momentum=False)
    if name == "sequential":
        warmup = sched.LinearLR(opt, start_factor=0.25, total_iters=2)
        return sched.SequentialLR(opt, [warmup, sched.ExponentialLR(opt, 0.7)], milestones=[2])
    if name == "chained":
        return sched.ChainedScheduler([sched.StepLR(opt, 2, 0.5), sched.ExponentialLR(opt, 0.9)])
    raise ValueError(name)


@dataclass(frozen=True)
class Job:
    """One sharded collection trained over steps [start, end): its rule, schedule, clipping
    and the tables frozen at each step (the first step's set, with `freeze_before_sharding`,
    on the unsharded collection)."""

    opt: str
    end: int
    start: int = 0
    plan: str = "mixed"
    schedule: str | None = None
    max_row_grad_norm: float | None = None
    max_grad_norm: float | None = None
    frozen: tuple[frozenset[str], ...] = ()
    freeze_before_sharding: bool = False
    snapshots: tuple[int, ...] = ()  # record the tables after these many steps
    load: str | None = None
    save: str | None = None

    def rule(self) -> UpdateRule:
        return dataclasses.replace(
            optimizer(self.opt),
            max_row_grad_norm=self.max_row_grad_norm,
            max_grad_norm=self.max_grad_norm,
        )

    def frozen_at(self, step: int) -> frozenset[str]:
        return self.frozen[step] if step < len(self.frozen) else frozenset()


class CollectiveLog:
    """Names and sent elements of the collectives a strategy runs while `active`."""

    def __init__(self, strategy: mp.ManualParallelStrategy) -> None:
        self.active = False
        self.calls: list[tuple[str, int]] = []
        to_all, reduce = strategy.all_to_all_async, strategy.all_reduce_

        def all_to_all_async(tensor, send, receive, **kwargs):
            if self.active:
                self.calls.append((kwargs["name"], tensor.numel()))
            return to_all(tensor, send, receive, **kwargs)

        def all_reduce_(tensor, op="sum", **kwargs):
            if self.active:
                self.calls.append((kwargs["name"], tensor.numel()))
            return reduce(tensor, op, **kwargs)

        strategy.all_to_all_async = all_to_all_async
        strategy.all_reduce_ = all_reduce_

    def take(self) -> list[tuple[str, int]]:
        calls, self.calls = self.calls, []
        return calls


def _set_frozen(emb: torch.nn.Module, frozen: frozenset[str]) -> None:
    """The whole collection through requires_grad_ on the module, else table by table."""
    if frozen == ALL:
        emb.requires_grad_(False)
        return
    for name in NAMES:
        emb.tables[name].weight.requires_grad_(name not in frozen)


def run_jobs(jobs: Sequence[Job]) -> list[dict]:
    """On each rank: train every job; per step the lr the update read, the collectives of
    its backward and whether the output needed a backward; full tables and state at the end."""
    strategy = mp.ManualParallelStrategy()
    log = CollectiveLog(strategy)
    rank, world = strategy.rank, strategy.world_size
    results = []
    for job in jobs:
        with mp.empty_init():
            ebc = EmbeddingBagCollection(TABLES, seed=SEED)
        if job.freeze_before_sharding:
            for name in job.frozen_at(0):
                ebc.tables[name].weight.requires_grad_(False)
        plan = mixed_plan(world) if job.plan == "mixed" else uniform_plan(job.plan, world)
        emb = shard_embeddings(ebc, strategy, plan, job.rule())
        schedule = make_schedule(job.schedule, emb.fused_optimizer)
        state = {"model": emb, "sparse_optim": emb.fused_optimizer}
        if schedule is not None:
            state["schedule"] = schedule
        if job.load:
            strategy.load_checkpoint(job.load, state)
        dense = torch.ones((), requires_grad=True)  # so backward runs with every table frozen
        out: dict[str, Any] = {"lrs": [], "collectives": [], "trains": [], "snapshots": {}}
        for step in range(job.start, job.end):
            if step > 0 or not job.freeze_before_sharding:
                _set_frozen(emb, job.frozen_at(step))
            pooled = emb(make_batch(rank, step, BATCHES[rank])).values
            out["trains"].append(pooled.requires_grad)
            log.active = True
            local_loss(pooled * dense, rank, step).backward()
            log.active = False
            out["collectives"].append(log.take())
            out["lrs"].append(emb.fused_optimizer.rule.lr)
            if schedule is not None:
                schedule.step()
            if step + 1 in job.snapshots:
                with full_tensors():
                    out["snapshots"][step + 1] = _tables(emb)
        if job.save:
            strategy.save_checkpoint(job.save, state)
        with full_tensors():
            out["tables"] = _tables(emb)
            out["state"] = emb.fused_optimizer.state_dict()["state"]
        results.append(out)
    strategy.teardown()
    return results


def _tables(emb: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k.split(".")[1]: v for k, v in emb.state_dict().items()}


# the single-process reference ----------------------------------------------------------------
def reference_run(job: Job, batch_sizes: Sequence[int] = BATCHES) -> dict:
    """`job` from step 0 on the unsharded collection with torch's optimizers and scheduler."""
    ebc = EmbeddingBagCollection(TABLES, seed=SEED)
    params = {name: table.weight for name, table in ebc.tables.items()}
    rule = optimizer(job.opt)
    opt = _torch_optimizer(job.opt, rule, list(params.values()))
    schedule = make_schedule(job.schedule, opt)
    row_state = {name: torch.zeros(p.shape[0]) for name, p in params.items()}
    out: dict[str, Any] = {"lrs": [], "snapshots": {}, "row_clipped": 0, "norms": []}
    world = len(batch_sizes)
    for step in range(job.end):
        for name, p in params.items():
            p.requires_grad_(name not in job.frozen_at(step))
            p.grad = None
        loss = sum(
            local_loss(ebc(make_batch(rank, step, batch)).values, rank, step) / world
            for rank, batch in enumerate(batch_sizes)
        )
        lr = opt.param_groups[0]["lr"]
        out["lrs"].append(lr)
        if loss.requires_grad:
            loss.backward()
            _clip(params, job, out)
            if job.opt == "rowwise":
                _rowwise_step(params, row_state, lr, rule.eps)
        opt.step()
        if schedule is not None:
            schedule.step()
        if step + 1 in job.snapshots:
            out["snapshots"][step + 1] = {n: p.detach().clone() for n, p in params.items()}
    out["tables"] = {name: p.detach().clone() for name, p in params.items()}
    out["state"] = _state(job.opt, opt, params, row_state)
    return out


def _torch_optimizer(
    name: str, rule: Any, params: list[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=rule.lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=rule.lr, eps=rule.eps)
    if name == "adam":
        return torch.optim.SparseAdam(params, lr=rule.lr, betas=rule.betas, eps=rule.eps)
    # row-wise Adagrad is written out below; a plain SGD with no parameters of its own
    # carries the schedule
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=rule.lr)


def _clip(params: dict[str, torch.nn.Parameter], job: Job, out: dict) -> None:
    """Clip the dense table gradients, then keep the sparse gradients' rows."""
    live = {name: p for name, p in params.items() if p.grad is not None}
    sparse = {name: p.grad.coalesce() for name, p in live.items()}
    dense = {name: g.to_dense() for name, g in sparse.items()}
    if job.max_row_grad_norm is not None:
        for grad in dense.values():
            norms = torch.linalg.vector_norm(grad, dim=1)
            out["row_clipped"] += int((norms > job.max_row_grad_norm).sum())
            grad.mul_((job.max_row_grad_norm / (norms + 1e-6)).clamp(max=1.0).unsqueeze(1))
    if job.max_grad_norm is not None:
        holders = []
        for grad in dense.values():
            holder = torch.zeros_like(grad)
            holder.grad = grad  # clip_grad_norm_ scales .grad in place
            holders.append(holder)
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(holders, job.max_grad_norm)))
    for name, p in live.items():
        rows = sparse[name].indices()
        p.grad = torch.sparse_coo_tensor(rows, dense[name][rows[0]], p.shape).coalesce()


def _rowwise_step(
    params: dict[str, torch.nn.Parameter], row_state: dict, lr: float, eps: float
) -> None:
    with torch.no_grad():
        for name, p in params.items():
            if p.grad is None:
                continue
            grad = p.grad.coalesce()
            rows, values = grad.indices()[0], grad.values()
            row_state[name][rows] += values.square().mean(1)
            p[rows] -= lr * values / (row_state[name][rows].sqrt() + eps)[:, None]


def _state(name: str, opt: torch.optim.Optimizer, params: dict, row_state: dict) -> dict:
    state: dict[str, dict] = {}
    for table, p in params.items():
        if name == "rowwise":
            state[table] = {"sum": row_state[table]}
        elif name == "adagrad":
            state[table] = {"sum": opt.state[p]["sum"].to_dense()}
        elif name == "adam" and p in opt.state:
            state[table] = {k: opt.state[p][k].to_dense() for k in ("exp_avg", "exp_avg_sq")}
        else:
            state[table] = {}
    return state
