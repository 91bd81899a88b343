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
every rank's validation pass at the same batch (see loop/validation.py). One optimizer step
(micro-batches, clipping, the update) is train_step.py; each convenience lives in its own file
beside this one: precision.py, early_stopping.py, best_checkpoints.py, tensorboard_log.py,
metric_objects.py, options.py (the option checks), load_weights.py (validate's, predict's).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from manualpar import deprecated
from manualpar.checkpoint.extra import extra_checkpoint_entries
from manualpar.checkpoint.files import read_manifest
from manualpar.loop.best_checkpoints import BestCheckpoints
from manualpar.loop.configured import optimizers_of
from manualpar.loop.data import Data, dataset_batches, step_batches
from manualpar.loop.early_stopping import EarlyStopping
from manualpar.loop.load_weights import load_weights
from manualpar.loop.logs import log_with_rank, progress_bar
from manualpar.loop.metrics_file import MetricsFile, Window, mean_over_ranks
from manualpar.loop.options import check_options
from manualpar.loop.precision import Precision
from manualpar.loop.predict import Predictions, predict
from manualpar.loop.raw_id_rates import POSTFIX, raw_id_rates, raw_id_remappers
from manualpar.loop.read_ahead import ReadAhead
from manualpar.loop.rolling_checkpoints import RollingCheckpoints
from manualpar.loop.run_record import RunRecord
from manualpar.loop.step_ahead import StepAhead, model_prefetch
from manualpar.loop.step_times import CHECKPOINT, READ, StepTimes
from manualpar.loop.tensorboard_log import TensorBoardLog
from manualpar.loop.train_step import TrainStep
from manualpar.loop.validation import Validation
from manualpar.loop.validation_watch import ValidationWatch
from manualpar.module import ParallelModule
from manualpar.seed import RNGState
from manualpar.strategy import ManualParallelStrategy

__all__ = ["Trainer", "dataset_batches"]  # dataset_batches: re-exported from loop.data

log = logging.getLogger("manualpar.trainer")
Scheduler = Any  # a torch lr_scheduler (LRScheduler or ReduceLROnPlateau-free: step() alone)


class Trainer:
    """Runs `model.training_step` for `max_steps` optimizer steps; every keyword option, its
    default and range: docs/trainer-options.md.

    The options' reference lives on that page so this file stays the loop (the module docstring
    and docs/trainer.md explain it)."""

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
        allow_batch_change: bool = False,
        async_checkpoint: bool = False,
        precision: str = "32",
        non_finite: str | None = None,
        early_stopping: EarlyStopping | None = None,
        best_checkpoints: BestCheckpoints | None = None,
        tensorboard: bool = False,
        read_ahead: bool | None = None,
        pipeline: bool = True,
        step_times_every: int | None = None,
        prefetch: bool | None = None,
    ) -> None:
        read_ahead = deprecated.renamed_keyword(
            "Trainer(prefetch=...)", read_ahead, prefetch, "read_ahead="
        )
        counts = {"max_steps": max_steps, "accumulate": accumulate, "log_every": log_every}
        counts.update(keep_last=keep_last, val_steps=val_steps)
        check_options(counts, clip_grad_norm, resume_lr, non_finite)
        self.strategy = strategy
        log_with_rank(strategy.rank, strategy.world_size)
        self.out_dir = Path(out_dir)
        self._metrics = MetricsFile(self.out_dir / "metrics.jsonl", strategy)
        self._tensorboard = TensorBoardLog(self.out_dir / "tensorboard") if tensorboard else None
        if self._tensorboard is not None:
            self._metrics.listeners.append(self._tensorboard.write)
        self._precision = Precision(precision)
        self._watch = ValidationWatch(early_stopping, best_checkpoints, self.out_dir, val_every)
        self.early_stopping, self.best_checkpoints = early_stopping, best_checkpoints
        self.stopped_early = False  # fit() ended by early stopping
        self.max_steps, self.accumulate, self.log_every = max_steps, accumulate, log_every
        self.checkpoint_every, self.keep_last = checkpoint_every, keep_last
        self._checkpoints = RollingCheckpoints(
            strategy, self.out_dir / "checkpoints", keep_last, async_checkpoint
        )
        self.val_every, self.val_steps = val_every, val_steps
        self.progress = progress
        self.clip_grad_norm, self.resume_lr = clip_grad_norm, resume_lr
        self.allow_batch_change = allow_batch_change
        self.async_checkpoint, self.pipeline = async_checkpoint, pipeline
        self.read_ahead = bool(read_ahead)
        self.step = 0
        self.data_ran_out: dict[int, int] = {}  # rank -> the micro-batch index it had no batch for
        self._validation = Validation(strategy, val_steps, self._metrics, self._precision)
        self._extra: dict[str, Any] = {}
        self._remappers: dict[str, Any] = {}
        self._schedulers: list[Scheduler] = []
        self._step = TrainStep(self._precision, strategy, accumulate, clip_grad_norm, non_finite)
        self._times = StepTimes(strategy, step_times_every, self._metrics)
        self._step.times = self._times.recorder

    @property
    def checkpoint_dir(self) -> Path:
        return self._checkpoints.directory

    @property
    def metrics_path(self) -> Path:
        return self._metrics.path

    @property
    def best_checkpoint(self) -> Path | None:
        """The best checkpoint `best_checkpoints` kept (before this Trainer validated: the one
        `best/best.json` lists), or None."""
        best = self._watch.best()
        return None if best is None else best[1]

    @property
    def best_score(self) -> float | None:
        """The monitored value of `best_checkpoint`, or None."""
        best = self._watch.best()
        return None if best is None else best[0]

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
        optimizer, self._schedulers = optimizers_of(model, optimizer, schedulers)
        self._extra = extra_checkpoint_entries(model)
        self._remappers = raw_id_remappers(model)  # managed-collision tables: rates logged
        self._step.track(model, self._schedulers)
        self._times.track(self._step.sharded)
        self._precision.setup(model, optimizer, self.strategy)
        state = {
            "model": model,
            "optim": optimizer,
            "step": 0,
            "rng": RNGState(),
            "run": RunRecord(data, self.accumulate, self.allow_batch_change),  # checked on resume
            **self._extra,
            **{f"scheduler_{i}": s for i, s in enumerate(self._schedulers)},
            **self._precision.entries(),
            **self._watch.entries(),
        }
        resumed = self._checkpoints.resume(state, self.resume_lr)
        if resumed is not None:
            self._metrics.keep_until(state["step"])
            for event in resumed.events(state["step"]):  # checkpoints it could not read
                self._metrics.append(event)
            self.strategy.barrier("resume")
        self.step = state["step"]
        self._watch.resumed(self.strategy.is_global_zero)
        if self._tensorboard is not None:
            self._tensorboard.start(purge_step=self.step + 1)
        read = ReadAhead(data) if self.read_ahead else data
        try:
            last = self._loop(model, optimizer, read, val_data, state)
        except BaseException:
            self._checkpoints.abandon_pending()
            raise
        finally:
            for module in self._step.sharded:  # a batch sent ahead of a step that never came
                module.drop_prefetched()
            self._times.untrack()
            if isinstance(read, ReadAhead):
                read.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
        self.strategy.wait_for_checkpoint()  # the last checkpoint is committed when fit returns
        self._checkpoints.prune()
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
        window = Window()
        self.stopped_early = self._watch.stopped_before(self.step)
        done = self.step >= self.max_steps or self.stopped_early
        last = self._metrics.recorded_at(self.step) if done else {}
        prefetch = model_prefetch(_user(model), self.pipeline, self.accumulate)
        steps = StepAhead(functools.partial(self._fetch, data), prefetch, self.max_steps)
        while self.step < self.max_steps and not self.stopped_early:
            self._times.begin(self.step)
            with self._times.recorder.phase(READ):
                batches = steps.batches(self.step)  # the next step's sent ahead (step_ahead.py)
            if batches is None:  # a rank's data ran out: every rank ends the run at this step
                ranks = sorted(self.data_ran_out)
                event = {"step": self.step, "event": "data_ran_out", "ranks": ranks}
                last = self._stop(state, event, window, optimizer) or last
                break
            window.add(self._step.run(model, optimizer, batches, self.step))
            self.step += 1
            if self.step % self.log_every == 0 or self.step == self.max_steps:
                last, rate = self._record(window, optimizer), window.rate()
                window = Window()
                if bar is not None:
                    rates = {k: f"{last[m]:.1%}" for k, m in POSTFIX.items() if m in last}
                    bar.set_postfix(loss=f"{last['loss']:.4f}", steps_per_s=f"{rate:.1f}", **rates)
            if val_data is not None and self.val_every and self.step % self.val_every == 0:
                values = self._validation.validate(model, val_data, self.step)
                last.update(values)
                self.stopped_early = self._watch.after_validation(
                    values,
                    self.step,
                    functools.partial(self._save, state),
                    self.strategy.is_global_zero,
                )
            if bar is not None:
                bar.update(1)
            if (self.checkpoint_every and self.step % self.checkpoint_every == 0) or (
                self.step == self.max_steps
            ):
                self._save(state)
            if self.stopped_early:
                assert self.early_stopping is not None
                event = self.early_stopping.event(self.step)
                last.update(self._stop(state, event, window, optimizer))
            self._times.end(self.step)
        if bar is not None:
            bar.close()
        return last

    def _stop(
        self, state: dict[str, Any], event: dict[str, Any], window: Window, optimizer: Any
    ) -> dict[str, float]:
        """End the run at this step on every rank: record the open window and `event`, save
        the checkpoint of this step (unless just saved); the window's values."""
        recorded = self._record(window, optimizer) if window.steps else {}
        self._metrics.append(event)
        if self._checkpoints.saved_at != self.step:
            self._save(state)
        return recorded

    def _save(self, state: dict[str, Any], best: Path | None = None) -> None:
        """A rolling checkpoint of this step, or with `best` a best one (always synchronous)."""
        state["step"] = self.step
        with self._times.recorder.phase(CHECKPOINT):
            if best is None:
                self._checkpoints.save(state, self.step)
            else:
                self.strategy.save_checkpoint(best, state)

    def _fetch(self, data: Data, step: int) -> list[Any] | None:
        """Step `step`'s micro-batches, or None on every rank if any rank's data ran out (then
        `data_ran_out` names the ranks); see `step_batches`."""
        batches, ran_out = step_batches(self.strategy, data, step, self.accumulate)
        if batches is None:
            self.data_ran_out = ran_out
            where = ", ".join(f"rank {r} (batch {i})" for r, i in ran_out.items())
            log.warning(
                "training data ran out on %s at step %d; every rank stops at step %d (of "
                "max_steps=%d) and saves a checkpoint there",
                where, step, step, self.max_steps,
            )  # fmt: skip
        return batches

    def validate(
        self, model: nn.Module, val_data: Data, checkpoint: str | Path | None = None
    ) -> dict[str, float]:
        """One validation pass outside fit(), on every rank; returns the reduced values and
        records them (metrics.jsonl, TensorBoard) at the step of the weights validated.

        Sets up a ParallelModule not yet set up. `checkpoint`: None validates the current
        weights; "latest" (under checkpoints/), "best" (`best_checkpoint`) or a checkpoint path
        is loaded into the model first (its model entry and extra entries such as sharded
        tables' state; not the optimizer). "latest" skips checkpoints that cannot be read, as
        fit's resume does (a warning and a `checkpoint_skipped` record for each)."""
        if isinstance(model, ParallelModule) and not model.is_setup:
            model.setup(self.strategy)
        step = self.step
        if checkpoint is not None:
            loaded = load_weights(
                self.strategy, self._watch, "validate", model, checkpoint, self.checkpoint_dir
            )
            step = int(read_manifest(loaded.path)["step"])
            for event in loaded.events(step):  # checkpoints "latest" could not read
                self._metrics.append(event)
        training = model.training
        try:
            return self._validation.validate(model, val_data, step)
        finally:
            model.train(training)
            if self._tensorboard is not None:
                self._tensorboard.close()

    def predict(
        self,
        model: nn.Module,
        data: Data,
        *,
        steps: int | None = None,
        order: str = "interleaved",
        checkpoint: str | Path | None = None,
    ) -> Predictions:
        """`model.predict_step(batch)` over `data` on every rank, in eval mode under the
        Trainer's precision, as validation runs: iterate it (on every rank together) for each
        global batch's outputs in the global sample order (loop/predict.py). Sets up and loads
        `checkpoint` as validate() does."""
        if isinstance(model, ParallelModule) and not model.is_setup:
            model.setup(self.strategy)
        if checkpoint is not None:
            load_weights(
                self.strategy, self._watch, "predict", model, checkpoint, self.checkpoint_dir
            )
        autocast = functools.partial(self._precision.autocast, self.strategy.device)
        return predict(model, data, self.strategy, steps=steps, order=order, autocast=autocast)

    # ---- metrics ------------------------------------------------------------------------------
    def _record(self, window: Window, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        rate = window.rate()
        reduced = mean_over_ranks(self.strategy, window.means())
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


def _user(model: nn.Module) -> Any:
    """The model as the user wrote it: training_step, validation_step, configure_optimizers are
    its own methods, which nn.Module's types do not know."""
    return model
