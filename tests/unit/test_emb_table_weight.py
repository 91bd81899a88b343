"""A step reads each table's weight from its module's registered parameters (table_weight), and
through the module where the weight is something else (a parametrization)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from manualpar.embeddings import EmbeddingBagConfig
from manualpar.embeddings.modules.bag_collection import EmbeddingTable, table_weight
from manualpar.embeddings.step.frozen import frozen_tables


class _Doubled(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 2


def test_table_weight_follows_a_replaced_or_parametrized_weight_and_its_frozen_flag() -> None:
    tables = nn.ModuleDict(
        {n: EmbeddingTable(EmbeddingBagConfig(n, 3, 2, feature_names=(n,)), 0) for n in "ab"}
    )
    first = tables["a"]
    assert table_weight(tables, "a") is first.weight
    first.weight = nn.Parameter(torch.ones(3, 2), requires_grad=False)  # a load with assign
    assert table_weight(tables, "a") is first.weight
    assert frozen_tables(tables, ["a", "b"]) == frozenset({0})
    parametrize.register_parametrization(tables["b"], "weight", _Doubled())
    assert torch.equal(table_weight(tables, "b"), tables["b"].weight)
    tables["b"].parametrizations.weight.original.requires_grad_(False)
    assert frozen_tables(tables, ["a", "b"]) == frozenset({0, 1})
