"""manualpar's log lines carry the rank that wrote them."""

from __future__ import annotations

import logging

import pytest

from manualpar.loop.logs import log_with_rank


@pytest.fixture
def bare_logger(monkeypatch: pytest.MonkeyPatch) -> logging.Logger:
    logger = logging.getLogger("manualpar")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    return logger


def test_every_rank_warns_with_its_prefix_and_only_rank_0_informs(bare_logger, capsys):
    log_with_rank(1, 4)
    logging.getLogger("manualpar.trainer").info("resumed from x")
    logging.getLogger("manualpar.checkpoint").warning("kept the previous checkpoint")
    assert capsys.readouterr().err == (
        "[rank 1/4] WARNING manualpar.checkpoint: kept the previous checkpoint\n"
    )
    bare_logger.handlers = []
    log_with_rank(0, 4)
    logging.getLogger("manualpar.trainer").info("resumed from x")
    assert capsys.readouterr().err == "[rank 0/4] INFO manualpar.trainer: resumed from x\n"


def test_an_application_handler_is_left_alone(bare_logger, capsys):
    mine = logging.StreamHandler()
    bare_logger.addHandler(mine)
    log_with_rank(0, 2)
    assert bare_logger.handlers == [mine]
