"""Trainer: a small fit loop on the public API only (strategy, builders, checkpoint IO).

    trainer = mp.Trainer(strategy, "runs/exp1", max_steps=1000, checkpoint_every=100)
    trainer.fit(model, data)          # model: training_step(batch, step) -> loss (or dict)

What it adds over a hand-written loop: a progress bar on rank 0, metrics averaged over ranks and
appended to `metrics.jsonl`, validation every N steps, gradient accumulation, checkpoints every N
steps and at the end, and automatic resume from the latest complete checkpoint (after a
torchelastic restart or a rerun). Data is addressed by step: `data(step, strategy)` returns this
rank's batch for that step (`dataset_batches(dataset, global_batch_size)` builds one for a
map-style dataset), so a resumed run sees exactly the batches the uninterrupted run would have
seen and, on CPU, reproduces it bit for bit. `data` raises StopIteration when this rank has no
batch for a step: every rank then stops at that step (see `_fetch`); `val_data` likewise ends
every rank's validation pass at the same batch (see loop/validation.py).
"""

from __future__ import annotations

import logging
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from manualpar.builders import clip_grad_norm_
from manualpar.checkpoint.extra import extra_checkpoint_entries
from manualpar.checkpoint.files import latest_checkpoint, read_manifest
from manualpar.embeddings import ShardedEmbeddingBagCollection
from manualpar.loop.configured import optimizer_and_schedulers
from manualpar.loop.data import Data, dataset_batches, step_batches
from manualpar.loop.logs import log_with_rank, progress_bar
from manualpar.loop.metrics_file import MetricsFile
from manualpar.loop.raw_id_rates import POSTFIX, raw_id_rates, raw_id_remappers
from manualpar.loop.resume_lr import RESUME_LR, learning_rates, report_restored_lrs
from manualpar.loop.validation import Validation
from manualpar.module import ParallelModule
from manualpar.seed import RNGState
from manualpar.strategy import ManualParallelStrategy

__all__ = ["Trainer", "dataset_batches"]  # dataset_batches: re-exported from loop.data

log = logging.getLogger("manualpar.trainer")
Scheduler = Any  # a torch lr_scheduler (LRScheduler or ReduceLROnPlateau-free: step() alone)


class Trainer:
    """Runs `model.training_step` for `max_steps` optimizer steps; see the module docstring.

    Args:
        strategy: the job's strategy.
        out_dir: holds `checkpoints/step_<n>/` and `metrics.jsonl`.
        max_steps: optimizer steps to reach (a resumed run continues towards the same number).
        checkpoint_every: save every N steps (and always at the end); None: only at the end.
        keep_last: committed checkpoints to keep (older ones are deleted after a save).
        accumulate: micro-batches per optimizer step (loss divided accordingly).
        log_every: reduce and record metrics every N steps.
        val_every / val_steps: run `model.validation_step` on `val_steps` batches every N steps.
        progress: show a progress bar on rank 0.
        clip_grad_norm: clip the dense gradients (the optimizer's parameters: DDP, FSDP, any
            mix) to this global norm before each optimizer step; logs `grad_norm` (before
            clipping). Sharded tables clip inside their fused update (see their optimizers).
        async_checkpoint: write checkpoints in the background (`strategy.save_checkpoint_async`):
            training waits only for a CPU copy of the state; the checkpoint commits when every
            rank finished writing, and fit() returns only after the last one committed.
        resume_lr: on resume, "checkpoint" keeps the learning rates saved with the optimizers
            (an interrupted run continues as it was); "configured" puts back the ones the
            optimizers were created with (to change the learning rate of a run). Either way
            the resume logs which values the checkpoint overrode (a scheduled group only if
            its rate is not what its restored schedule gives).
    """

    def __init__(
        self,
        strategy: ManualParallelStrategy,
        out_dir: str | Path,
        *,
        max_steps: int,
        checkpoint_every: int | None = None,
        keep_last: int = 2,
        accumulate: int = 1,
        log_every: int = 10,
        val_every: int | None = None,
        val_steps: int = 1,
        progress: bool = True,
        clip_grad_norm: float | None = None,
        resume_lr: str = "checkpoint",
        async_checkpoint: bool = False,
    ) -> None:
        for name, value in (
            ("max_steps", max_steps),
            ("accumulate", accumulate),
            ("log_every", log_every),
            ("keep_last", keep_last),
            ("val_steps", val_steps),
        ):
            if value < 1:
                raise ValueError(f"Trainer: {name} must be >= 1, got {value}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"Trainer: clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
        if resume_lr not in RESUME_LR:
            raise ValueError(f"Trainer: resume_lr must be one of {RESUME_LR}, got {resume_lr!r}")
        self.strategy = strategy
        log_with_rank(strategy.rank, strategy.world_size)
        self.out_dir = Path(out_dir)
        self._metrics = MetricsFile(self.out_dir / "metrics.jsonl", strategy)
        self.max_steps, self.accumulate, self.log_every = max_steps, accumulate, log_every
        self.checkpoint_every, self.keep_last = checkpoint_every, keep_last
        self.val_every, self.val_steps = val_every, val_steps
        self.progress = progress
        self.clip_grad_norm, self.resume_lr = clip_grad_norm, resume_lr
        self.async_checkpoint = async_checkpoint
        self.step = 0
        self.data_ran_out: dict[int, int] = {}  # rank -> the micro-batch index it had no batch for
        self._validation = Validation(strategy, val_steps)
        self._saved_at: int | None = None  # the step of the checkpoint last saved or resumed
        self._extra: dict[str, Any] = {}
        self._remappers: dict[str, Any] = {}
        self._sharded: list[ShardedEmbeddingBagCollection] = []
        self._schedulers: list[Scheduler] = []

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self._metrics.path

    @property
    def val_data_ran_out(self) -> dict[int, int]:
        """{rank: batch index} of the last validation pass some rank's data cut short."""
        return self._validation.ran_out

    # ---- the loop ---------------------------------------------------------------------------
    def fit(
        self,
        model: nn.Module,
        data: Data,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        schedulers: Scheduler | Sequence[Scheduler] | None = None,
        val_data: Data | None = None,
    ) -> dict[str, float]:
        """Train to `max_steps`, resuming if a checkpoint exists; returns the last metrics.

        `optimizer` and `schedulers` default to `model.configure_optimizers()`, which returns
        an optimizer or {"optimizer": ..., "schedulers": [...]}. Schedulers (torch lr_scheduler
        objects, over the dense optimizer or a sharded collection's `fused_optimizer`) step once
        after every optimizer step and are checkpointed as `scheduler_<i>`.
        """
        if self.val_every and val_data is None:
            warnings.warn(
                f"Trainer(val_every={self.val_every}) but fit() got no val_data, so validation "
                "never runs; pass fit(..., val_data=...) or drop val_every",
                stacklevel=2,
            )
        if isinstance(model, ParallelModule) and not model.is_setup:
            model.setup(self.strategy)
        if optimizer is None:
            if not hasattr(model, "configure_optimizers"):
                raise TypeError(
                    f"{type(model).__name__} has no configure_optimizers(); pass "
                    "optimizer= to fit()"
                )
            optimizer, configured = optimizer_and_schedulers(
                _user(model).configure_optimizers(), type(model).__name__
            )
            schedulers = configured if schedulers is None else schedulers
        if schedulers is None:
            schedulers = []
        elif not isinstance(schedulers, Sequence):
            schedulers = [schedulers]
        self._schedulers = list(schedulers)
        self._extra = extra_checkpoint_entries(model)
        self._remappers = raw_id_remappers(model)  # managed-collision tables: rates logged
        self._sharded = [m for m in model.modules() if isinstance(m, ShardedEmbeddingBagCollection)]
        state = {
            "model": model,
            "optim": optimizer,
            "step": 0,
            "rng": RNGState(),
            **self._extra,
            **{f"scheduler_{i}": s for i, s in enumerate(self._schedulers)},
        }
        self._resume(state)
        self.step = state["step"]
        try:
            last = self._loop(model, optimizer, data, val_data, state)
        except BaseException:
            self._abandon_pending_save()
            raise
        self.strategy.wait_for_checkpoint()  # the last checkpoint is committed when fit returns
        self._prune()
        return last

    def _loop(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: Data,
        val_data: Data | None,
        state: dict[str, Any],
    ) -> dict[str, float]:
        model.train()
        shown = self.progress and self.strategy.is_global_zero
        bar = progress_bar(self.max_steps, self.step) if shown else None
        window: dict[str, list[float]] = {}
        last = self._metrics.recorded_at(self.step) if self.step >= self.max_steps else {}
        started, steps_in_window = time.perf_counter(), 0
        while self.step < self.max_steps:
            batches = self._fetch(data)
            if batches is None:  # a rank's data ran out: every rank ends the run at this step
                if steps_in_window:
                    rate = steps_in_window / (time.perf_counter() - started)
                    last = self._record(window, rate, optimizer)
                self._metrics.append(
                    {"step": self.step, "event": "data_ran_out", "ranks": sorted(self.data_ran_out)}
                )
                if self._saved_at != self.step:
                    state["step"] = self.step
                    self._save(state)
                break
            for name, value in self._train_step(model, optimizer, batches).items():
                window.setdefault(name, []).append(value)
            self.step += 1
            steps_in_window += 1
            if self.step % self.log_every == 0 or self.step == self.max_steps:
                rate = steps_in_window / (time.perf_counter() - started)
                last = self._record(window, rate, optimizer)
                window, started, steps_in_window = {}, time.perf_counter(), 0
                if bar is not None:
                    rates = {k: f"{last[m]:.1%}" for k, m in POSTFIX.items() if m in last}
                    bar.set_postfix(loss=f"{last['loss']:.4f}", steps_per_s=f"{rate:.1f}", **rates)
            if val_data is not None and self.val_every and self.step % self.val_every == 0:
                last.update(self._validate(model, val_data))
            if bar is not None:
                bar.update(1)
            if (self.checkpoint_every and self.step % self.checkpoint_every == 0) or (
                self.step == self.max_steps
            ):
                state["step"] = self.step
                self._save(state)
        if bar is not None:
            bar.close()
        return last

    def _fetch(self, data: Data) -> list[Any] | None:
        """This step's micro-batches, or None on every rank if any rank's data ran out (then
        `data_ran_out` names the ranks); see `step_batches`."""
        batches, ran_out = step_batches(self.strategy, data, self.step, self.accumulate)
        if batches is None:
            self.data_ran_out = ran_out
            where = ", ".join(f"rank {r} (batch {i})" for r, i in ran_out.items())
            log.warning(
                "training data ran out on %s at step %d; every rank stops at step %d (of "
                "max_steps=%d) and saves a checkpoint there",
                where,
                self.step,
                self.step,
                self.max_steps,
            )
        return batches

    def _train_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any]
    ) -> dict[str, float]:
        optimizer.zero_grad(set_to_none=True)
        skipped = self._skipped_updates()
        totals: dict[str, float] = {}
        for micro, batch in enumerate(batches):
            index = self.step * self.accumulate + micro
            out = _user(model).training_step(batch, index)
            metrics = dict(out) if isinstance(out, Mapping) else {"loss": out}
            if "loss" not in metrics:
                raise ValueError(
                    f"{type(model).__name__}.training_step must return a loss "
                    "tensor or a dict with 'loss'"
                )
            (metrics["loss"] / self.accumulate).backward()
            for name, value in metrics.items():
                value = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
                totals[name] = totals.get(name, 0.0) + value / self.accumulate
        if self._skipped_updates() > skipped:  # non_finite="skip" dropped a sparse update
            totals["skipped_non_finite"] = 1.0  # the dense gradients hold it too: no step
            log.warning("step %d: non-finite gradients; the dense step is skipped too", self.step)
        else:
            self._optimizer_step(optimizer, totals)
        for scheduler in self._schedulers:
            scheduler.step()
        return totals

    def _skipped_updates(self) -> int:
        return sum(module.skipped_updates for module in self._sharded)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, totals: dict[str, float]) -> None:
        if self.clip_grad_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            totals["grad_norm"] = float(clip_grad_norm_(params, self.clip_grad_norm))
        optimizer.step()

    def _validate(self, model: nn.Module, val_data: Data) -> dict[str, float]:
        """One validation pass (every rank ends it at the same batch if a rank's `val_data` runs
        out: see loop/validation.py), reduced over ranks and recorded."""
        model.eval()
        try:
            means, event = self._validation.run(_user(model), val_data, self.step)
        finally:
            model.train()
        if event is not None:
            self._metrics.append(event)
        if not means:  # some rank had no batch at all: nothing to average
            return {}
        reduced = self._reduce({f"val/{k}": v for k, v in means.items()})
        self._metrics.append({"step": self.step, **reduced})
        return reduced

    # ---- metrics ------------------------------------------------------------------------------
    def _reduce(self, values: Mapping[str, float]) -> dict[str, float]:
        """Mean over ranks, in one collective for all names."""
        names = sorted(values)
        tensor = torch.tensor([values[n] for n in names], dtype=torch.float64)
        means = self.strategy.all_reduce(tensor, op="mean").tolist()
        return dict(zip(names, means, strict=True))

    def _record(
        self, window: Mapping[str, list[float]], rate: float, optimizer: torch.optim.Optimizer
    ) -> dict[str, float]:
        reduced = self._reduce({k: sum(v) / len(v) for k, v in window.items()})
        reduced.update(raw_id_rates(self._remappers, self.strategy))
        lr = float(optimizer.param_groups[0].get("lr", 0.0))
        # extra entries with a learning rate (fused optimizers of sharded tables): log it too
        extra_lr = {
            f"{name}/lr": float(entry.lr)
            for name, entry in self._extra.items()
            if isinstance(getattr(entry, "lr", None), (int, float))
        }
        self._metrics.append(
            {"step": self.step, **reduced, "lr": lr, **extra_lr, "steps_per_s": rate}
        )
        return reduced

    # ---- checkpoints --------------------------------------------------------------------------
    def _resume(self, state: dict[str, Any]) -> None:
        latest = latest_checkpoint(self.checkpoint_dir)
        if latest is None:
            return
        configured = learning_rates(state)
        self.strategy.load_checkpoint(latest, state)
        self._saved_at = state["step"]
        log.info(
            "resumed from %s at step %d: restored %s",
            latest,
            state["step"],
            ", ".join(sorted(state)),
        )
        report_restored_lrs(configured, state, keep=self.resume_lr)
        self._metrics.keep_until(state["step"])
        self.strategy.barrier("resume")

    def _save(self, state: dict[str, Any]) -> None:
        path = self.checkpoint_dir / f"step_{self.step:08d}"
        if self.async_checkpoint:
            self.strategy.wait_for_checkpoint()  # the previous one commits first
            self._prune()
            self.strategy.save_checkpoint_async(path, state)
        else:
            self.strategy.save_checkpoint(path, state)
            self._prune()
        self._saved_at = self.step

    def _prune(self) -> None:
        """Keep the `keep_last` newest committed checkpoints (rank 0 deletes the others)."""
        if self.strategy.is_global_zero and self.checkpoint_dir.is_dir():
            committed = sorted(
                (read_manifest(p)["step"], p)
                for p in self.checkpoint_dir.iterdir()
                if not p.name.startswith(".") and (p / "manualpar.json").is_file()
            )
            for _, old in committed[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    def _abandon_pending_save(self) -> None:
        """fit() failed: let a background save finish or fail (bounded by the collective
        timeout), never replacing the error that stopped fit. A save that cannot finish is
        never committed, so the previous checkpoint stays the latest."""
        try:
            self.strategy.wait_for_checkpoint()
        except Exception as error:
            log.warning(
                "the checkpoint being written when fit() failed was not committed (%s); "
                "the previous one is still the latest",
                error,
            )


def _user(model: nn.Module) -> Any:
    """The model as the user wrote it: training_step, validation_step, configure_optimizers are
    its own methods, which nn.Module's types do not know."""
    return model
