"""What a step does, as the planner prices it (`Workload`): how many bags and ids a step looks
up per table, how popular they are, what the update rule needs, the wire dtypes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from manualpar.embeddings.config import ROW_WISE_STATE, EmbeddingBagConfig
from manualpar.embeddings.exchange_layout import FLOAT32_WIRE, WireDtypes
from manualpar.embeddings.optim.update_rules import RowWiseAdagrad, UpdateRule
from manualpar.embeddings.planning.exchange_bytes import is_sequence, own_bags_of

__all__ = ["Workload", "rule_costs", "sequence_padding"]


def rule_costs(rule: UpdateRule | None) -> tuple[Mapping[str, bool], bool]:
    """(state per row, whether it needs whole rows' gradients) of an update rule; by default
    shard_embeddings' row-wise Adagrad's, which does."""
    if rule is None:
        return ROW_WISE_STATE, RowWiseAdagrad.needs_full_rows
    return rule.STATE, rule.needs_full_rows or rule.max_row_grad_norm is not None


@dataclass(frozen=True)
class Workload:
    """What a step looks up: `batch_per_rank` samples a rank, `ids_per_bag[table]` ids per
    bag in each of the table's features (default 1), and the update rule's needs. A batch per
    feature (SparseFeatures.bags_per_key: a deduplicated user feature): `bags_per_feature`
    gives a feature's bags a rank sends per step, each looked up and sent once; the features
    it leaves out have one bag per sample. Such a batch (`variable`) also sends each route's
    bag count, and a row split returns every bag (the step compacts a full batch only)."""

    batch_per_rank: int = 512
    ids_per_bag: Mapping[str, float] = field(default_factory=dict)
    bags_per_feature: Mapping[str, float] = field(default_factory=dict)
    weighted: bool = False
    frozen: frozenset[str] = frozenset()
    full_rows: bool = False  # whole rows' gradients for column-split tables (row-wise rules)
    state: Mapping[str, bool] = field(default_factory=lambda: dict(ROW_WISE_STATE))
    rules: Mapping[str, tuple[Mapping[str, bool], bool]] = field(default_factory=dict)
    skew: float | Mapping[str, float] = 0.0  # Zipf exponent of the ids (0: uniform), or per table
    # sequence tables: the ids per sample their collection pads each feature to (its largest;
    # sequence_padding), by table; default the table's own
    padded_ids: Mapping[str, float] = field(default_factory=dict)
    # the dtypes the pooled rows and their gradients travel in (shard_embeddings' wire_dtype)
    wire: WireDtypes = FLOAT32_WIRE

    def skew_of(self, table: str) -> float:
        if isinstance(self.skew, Mapping):
            return float(self.skew.get(table, 0.0))
        return float(self.skew)

    def rule(self, table: str) -> tuple[Mapping[str, bool], bool]:
        """(optimizer state, needs full rows) of `table`: its own in `rules`, else the shared."""
        return self.rules.get(table, (self.state, self.full_rows))

    def ids(self, config: EmbeddingBagConfig, name: str | None = None) -> float:
        """Ids a rank looks up in `config`'s table (`name`: its key here) per step, over all
        its features."""
        per_bag = float(self.ids_per_bag.get(name or config.name, 1.0))
        if not self._own_bags(config):
            return self.batch_per_rank * per_bag * len(config.feature_names)
        return per_bag * self.bags(config)

    @property
    def variable(self) -> bool:
        """Whether the batch has a feature with bags of its own (not one per sample)."""
        return any(n != self.batch_per_rank for n in self.bags_per_feature.values())

    def bags(self, config: EmbeddingBagConfig) -> float:
        """Bags a rank sends per step over `config`'s features: a feature in bags_per_feature
        its own, the others one per sample."""
        if not self._own_bags(config):
            return self.batch_per_rank * len(config.feature_names)
        return sum(
            float(self.bags_per_feature.get(f, self.batch_per_rank)) for f in config.feature_names
        )

    def _own_bags(self, config: EmbeddingBagConfig) -> bool:
        """Whether a feature of `config` has its own bag count; PlanError for one a step
        cannot take (a sequence table's, a negative count)."""
        return bool(own_bags_of(config, self.bags_per_feature))


def sequence_padding(
    tables: Mapping[str, EmbeddingBagConfig],
    ids_per_bag: Mapping[str, float],
    collection_of: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Per sequence table (EmbeddingConfig), the ids per sample its collection pads every
    feature to: the largest `ids_per_bag` of the sequence tables in its collection
    (`collection_of`: table key -> collection; default one collection)."""
    groups: dict[str, list[str]] = {}
    for key, config in tables.items():
        if is_sequence([config]):
            groups.setdefault((collection_of or {}).get(key, ""), []).append(key)
    return {
        key: max(float(ids_per_bag.get(k, 1.0)) for k in keys)
        for keys in groups.values()
        for key in keys
    }
