"""Trainer on one process: argument checks, and dataset_batches' split of each epoch."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

import manualpar as mp


def _no_batches(step: int, strategy: mp.ManualParallelStrategy) -> None:
    raise AssertionError("the Trainer asked for a batch before checking the model")


def test_bad_arguments() -> None:
    strategy = mp.ManualParallelStrategy()
    with pytest.raises(mp.ConfigError, match="Trainer: accumulate must be >= 1, got 0"):
        mp.Trainer(strategy, "x", max_steps=1, accumulate=0)
    with pytest.raises(mp.ConfigTypeError, match=r"Linear has no configure_optimizers\(\)"):
        mp.Trainer(strategy, "x", max_steps=1).fit(nn.Linear(1, 1), _no_batches)


class _Ranked:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


def test_dataset_batches_cover_each_epoch_once_across_ranks() -> None:
    dataset = torch.arange(24).float()
    data = mp.dataset_batches(dataset, global_batch_size=6, seed=3)
    ranks = [_Ranked(r, 2) for r in range(2)]
    epoch = [data(step, rank) for step in range(4) for rank in ranks]  # 24 // 6 = 4 steps/epoch
    assert all(len(b) == 3 for b in epoch)
    assert sorted(torch.cat(epoch).tolist()) == list(range(24))
    assert torch.equal(mp.dataset_batches(dataset, 6, seed=3)(5, ranks[1]), data(5, ranks[1]))
    assert not torch.equal(data(4, ranks[0]), epoch[0])  # reshuffled next epoch
    with pytest.raises(mp.DataError, match="global_batch_size 5 is not a multiple of the world"):
        mp.dataset_batches(dataset, 5)(0, ranks[0])
    with pytest.raises(mp.DataError, match=r"global_batch_size 30 must be in \[1, len\(dataset\)"):
        mp.dataset_batches(dataset, 30)


class _Regression(mp.ParallelModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1)

    def training_step(self, batch: torch.Tensor, step: int) -> torch.Tensor:
        return self.fc(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_val_every_without_val_data_warns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(), tmp_path, max_steps=2, val_every=1, progress=False
    )
    with pytest.warns(UserWarning, match=r"Trainer\(val_every=1\) but fit\(\) got no val_data"):
        trainer.fit(_Regression(), lambda step, strategy: torch.ones(4, 2))
    assert trainer.step == 2


def test_fit_on_a_finished_run_returns_its_last_metrics(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def data(step: int, strategy: mp.ManualParallelStrategy) -> torch.Tensor:
        return torch.full((4, 2), float(step + 1))

    def fit() -> dict[str, float]:
        torch.manual_seed(0)
        trainer = mp.Trainer(mp.ManualParallelStrategy(), tmp_path, max_steps=3, progress=False)
        return trainer.fit(_Regression(), data)

    first = fit()
    assert set(first) == {"loss"}
    again = fit()  # resumes at step 3 = max_steps: nothing to train
    assert again == first


def _ramp(step: int, strategy: mp.ManualParallelStrategy) -> torch.Tensor:
    return torch.full((4, 2), float(step + 1))


def _records(path) -> list[dict]:  # type: ignore[no-untyped-def]
    import json

    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_clip_grad_norm_clips_before_each_step_and_logs_the_norm(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = _Regression()
    reference = _Regression()
    reference.load_state_dict(model.state_dict())
    trainer = mp.Trainer(
        mp.ManualParallelStrategy(),
        tmp_path,
        max_steps=3,
        log_every=1,
        clip_grad_norm=0.5,
        progress=False,
    )
    trainer.fit(model, _ramp)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    norms = []
    for step in range(3):
        optimizer.zero_grad()
        reference.training_step(_ramp(step, None), step).backward()  # type: ignore[arg-type]
        norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)))
        optimizer.step()
    assert [r["grad_norm"] for r in _records(tmp_path)] == pytest.approx(norms, rel=1e-6)
    assert norms[0] > 0.5  # the bound was active
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)


class _Scheduled(_Regression):
    def configure_optimizers(self) -> dict:  # type: ignore[override]
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "schedulers": [StepLR(optimizer, 1, gamma=0.5)]}


def test_schedulers_step_after_each_optimizer_step_and_resume(tmp_path) -> None:  # type: ignore[no-untyped-def]
    def fit(max_steps: int) -> None:
        torch.manual_seed(0)
        trainer = mp.Trainer(
            mp.ManualParallelStrategy(),
            tmp_path,
            max_steps=max_steps,
            log_every=1,
            checkpoint_every=2,
            progress=False,
        )
        trainer.fit(_Scheduled(), _ramp)

    fit(2)
    fit(4)  # resumes at step 2 with the scheduler's state
    # lr is logged after the step's scheduler step: the rate the next step uses
    assert [r["lr"] for r in _records(tmp_path)] == [0.05, 0.025, 0.0125, 0.00625]


def test_configure_optimizers_dict_with_unknown_keys_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    class Bad(_Regression):
        def configure_optimizers(self) -> dict:  # type: ignore[override]
            return {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1), "lr_scheduler": 1}

    trainer = mp.Trainer(mp.ManualParallelStrategy(), tmp_path, max_steps=1, progress=False)
    with pytest.raises(
        mp.ConfigError, match=r"Bad.configure_optimizers\(\) returned a dict with keys"
    ):
        trainer.fit(Bad(), _ramp)


@pytest.mark.parametrize("resume_lr", ["checkpoint", "configured"])
def test_resume_reports_the_learning_rate_it_overrode(tmp_path, caplog, resume_lr: str) -> None:  # type: ignore[no-untyped-def]
    class Tuned(_Regression):
        def __init__(self, lr: float) -> None:
            super().__init__()
            self.lr = lr

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.lr)

    def fit(lr: float, max_steps: int) -> float:
        trainer = mp.Trainer(
            mp.ManualParallelStrategy(),
            tmp_path,
            max_steps=max_steps,
            log_every=1,
            progress=False,
            resume_lr=resume_lr,
        )
        trainer.fit(Tuned(lr), _ramp)
        return _records(tmp_path)[-1]["lr"]

    fit(0.1, 1)
    with caplog.at_level("WARNING", logger="manualpar.trainer"):
        lr = fit(0.02, 2)
    if resume_lr == "checkpoint":
        assert lr == 0.1
        assert (
            "optim param group 0: learning rate 0.1 restored from the checkpoint replaces the "
            "configured 0.02; pass Trainer(resume_lr='configured')"
        ) in caplog.text
    else:
        assert lr == 0.02
        assert "optim param group 0: learning rate 0.02 configured (the checkpoint had 0.1" in (
            caplog.text
        )


def test_bad_clip_and_resume_arguments() -> None:
    strategy = mp.ManualParallelStrategy()
    with pytest.raises(mp.ConfigError, match="Trainer: clip_grad_norm must be > 0 or None, got 0"):
        mp.Trainer(strategy, "x", max_steps=1, clip_grad_norm=0)
    with pytest.raises(ValueError, match=r"resume_lr must be one of \('checkpoint'"):
        mp.Trainer(strategy, "x", max_steps=1, resume_lr="new")


def test_a_scheduled_exact_resume_reports_no_learning_rate(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The restored lr is the restored schedule's (0.025 after 2 halvings), not the configured
    0.1: that is an exact resume, so nothing is logged; a changed base lr still is."""

    def fit(max_steps: int, model: _Regression) -> None:
        mp.Trainer(
            mp.ManualParallelStrategy(), tmp_path, max_steps=max_steps, log_every=1,
            checkpoint_every=2, progress=False,
        ).fit(model, _ramp)  # fmt: skip

    class Rebased(_Scheduled):
        def configure_optimizers(self) -> dict:  # type: ignore[override]
            optimizer = torch.optim.SGD(self.parameters(), lr=0.2)
            return {"optimizer": optimizer, "schedulers": [StepLR(optimizer, 1, gamma=0.5)]}

    fit(2, _Scheduled())
    with caplog.at_level("WARNING", logger="manualpar.trainer"):
        fit(4, _Scheduled())
    assert "learning rate" not in caplog.text
    assert [r["lr"] for r in _records(tmp_path)] == [0.05, 0.025, 0.0125, 0.00625]
    with caplog.at_level("WARNING", logger="manualpar.trainer"):
        fit(6, Rebased())
    assert (
        "optim param group 0: the schedule restored from the checkpoint (base learning rate "
        "0.1, now 0.00625) replaces the configured base 0.2; a scheduled run resumes its "
        "schedule, so start a new run (another out_dir) to train with another learning rate"
    ) in caplog.text
    assert "resume_lr='configured'" not in caplog.text


def test_a_resume_with_another_global_batch_is_refused_unless_allowed(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    dataset = torch.arange(64.0).reshape(32, 2)

    def fit(batch: int, max_steps: int, accumulate: int = 1, **options: bool) -> mp.Trainer:
        trainer = mp.Trainer(
            mp.ManualParallelStrategy(),
            tmp_path,
            max_steps=max_steps,
            accumulate=accumulate,
            progress=False,
            **options,
        )
        trainer.fit(_Regression(), mp.dataset_batches(dataset, batch))
        return trainer

    fit(4, max_steps=2)
    with pytest.raises(mp.CheckpointMismatchError) as error:
        fit(8, max_steps=4)
    assert str(error.value) == (
        f"checkpoint {tmp_path / 'checkpoints' / 'step_00000002'}, 'run': the global batch "
        "differs: 4 samples a step (data batch 4 x accumulate 1) in the checkpoint, 8 samples "
        "a step (data batch 8 x accumulate 1) now. Data is addressed by step, so from this step "
        "on the run would read other samples than the one it resumes (skipping some, repeating "
        "others). Resume with the checkpoint's batch and accumulate, start a new run (another "
        "out_dir), or pass Trainer(allow_batch_change=True) if the change is planned (a "
        "batch-size schedule)"
    )
    assert fit(2, max_steps=3, accumulate=2).step == 3  # the same 4 samples a step
    with caplog.at_level(logging.WARNING, logger="manualpar.trainer"):
        assert fit(8, max_steps=4, allow_batch_change=True).step == 4
    assert (
        "the global batch changes: 4 samples a step (data batch 2 x accumulate 2) in the "
        "checkpoint, 8 samples a step (data batch 8 x accumulate 1) now (allow_batch_change=True)"
    ) in caplog.text
    latest = tmp_path / "checkpoints" / "step_00000004"
    manifest = json.loads((latest / "manualpar.json").read_text())
    assert manifest["records"]["run"]["global_batch"] == 8
    del manifest["records"]  # as written before checkpoints had records: nothing to compare
    (latest / "manualpar.json").write_text(json.dumps(manifest))
    assert fit(4, max_steps=5).step == 5
