"""The ids exchange's rooms (step/ids_exchange.py) and point-to-point transfers on one process.

The exchange itself, its overflow and its refusals run on 3 processes:
tests/dist/test_emb_step_ids_exchange_ranks.py.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from manualpar import ConfigError, ManualParallelStrategy
from manualpar.embeddings.step.ids_exchange import HISTORY, room


def test_a_pairs_room_is_its_longest_recent_payload_plus_a_quarter_of_their_spread() -> None:
    assert room(deque(maxlen=HISTORY)) == 0  # no history: everything beyond travels apart
    assert room(deque([40, 40, 40], maxlen=HISTORY)) == 40  # steady: no padding
    assert room(deque([30, 50, 42], maxlen=HISTORY)) == 50 + 20 // 4
    old = deque([500, *[10] * HISTORY], maxlen=HISTORY)  # a long payload is forgotten
    assert room(old) == 10


def test_point_to_point_needs_another_rank() -> None:
    strategy = ManualParallelStrategy()
    with pytest.raises(ConfigError, match="needs another rank, but the group has one"):
        strategy.send_async(torch.zeros(2), 0)
    with pytest.raises(ConfigError, match="needs another rank"):
        strategy.receive_async(torch.zeros(2), 0)
