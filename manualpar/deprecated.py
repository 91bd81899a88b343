"""Every deprecated spelling in one place: what it was, what replaces it, and a warning.

Old spellings keep working (user code is written against them) and warn once per call site
with the new one, so a search for a name finds its whole deprecation here.
"""

from __future__ import annotations

import warnings
from typing import TypeVar

from manualpar.errors import ConfigTypeError

__all__ = [
    "DEPRECATED",
    "LEFT_THE_EMBEDDINGS_FACE",
    "moved",
    "normalize_by",
    "renamed_keyword",
    "warn_deprecated",
]

T = TypeVar("T")
_PLANNING = "manualpar.embeddings.planning"
# Names that left `manualpar.embeddings` in 0.3 (the face a model author holds) -> the public
# namespace that carries them now; `manualpar.embeddings.<name>` still works and warns.
LEFT_THE_EMBEDDINGS_FACE = {
    **dict.fromkeys(
        (
            "CostPlan",
            "DEFAULT_BATCH_PER_RANK",
            "ExchangeBytes",
            "RankCosts",
            "TOPOLOGY_PRESETS",
            "Topology",
            "UNIFORM_PLANS",
            "Workload",
            "costs_text",
            "default_topology",
            "exchange_bytes",
            "expected_exchange_bytes",
            "expected_sent_bytes",
            "format_seconds",
            "load_topology",
            "placement_costs",
            "plan_by_cost",
            "plan_collections",
            "plan_costs",
            "plan_tables",
            "plan_uniform",
            "remapper_bytes_on_ranks",
            "rule_costs",
            "table_bytes",
            # the table lists and plan text the command line reads and prints
            "DTYPE_NAMES",
            "available_bytes",
            "check_tables",
            "dtype_name",
            "format_bytes",
            "per_rank_text",
            "raw_ids_from_json",
            "raw_ids_to_json",
            "table_dtype",
        ),
        _PLANNING,
    ),
    "full_tensors": "manualpar.checkpoint",
    "LocalShards": "manualpar.checkpoint",
    # internal: no model needs them (a collection builds its tables, features and shards)
    "EmbeddingTable": "manualpar.embeddings.modules.bag_collection",
    "JaggedFeature": "manualpar.embeddings.features",
    "Shard": "manualpar.embeddings.plan",
    "SHARDING_TYPES": "manualpar.embeddings.plan",
    "TABLE_DTYPES": "manualpar.embeddings.config",
    "EVICTION_POLICIES": "manualpar.embeddings.id_spaces",
    "block_bytes": "manualpar.embeddings.config",
}
# one meaning per word: the names a 0.3 rename replaced, by the public namespace that had them
_RENAMED = {
    "manualpar.embeddings": {"SparseOptimizer": "UpdateRule", "on_disk": "_on_disk"},
    "manualpar": {"Prefetched": "ReadAhead"},
    "manualpar.loop": {"Prefetched": "ReadAhead"},
}

# old spelling -> (new spelling, the version that renamed it)
DEPRECATED = {
    'normalize_by="world"': ('normalize_by="world_size"', "0.2"),
    "FusedOptimizer.optimizer": ("FusedOptimizer.rule", "0.2"),
    # the sparse update rule is a "rule" (emb.fused_optimizer.rule): an "optimizer" is a
    # torch.optim.Optimizer (the fused optimizer, the dense ones)
    "SparseOptimizer": ("UpdateRule", "0.3"),
    "shard_embeddings(optimizer=...)": ("shard_embeddings(rule=...)", "0.3"),
    "plan_tables(optimizer=...)": ("plan_tables(rule=...)", "0.3"),
    "plan_collections(optimizer=...)": ("plan_collections(rule=...)", "0.3"),
    "plan_uniform(optimizer=...)": ("plan_uniform(rule=...)", "0.3"),
    "python -m manualpar plan --optimizer": ("python -m manualpar plan --rule", "0.3"),
    # "on_disk" is the placement's field alone, and the keyword that sets it
    "on_disk(placement)": ("row_wise(..., on_disk=True) (or table_wise, ...)", "0.3"),
    # "prefetch" is a sharded collection's: sending a batch's ids ahead (emb.prefetch);
    # reading the data ahead in a thread is "read ahead"
    "Trainer(prefetch=...)": ("Trainer(read_ahead=...)", "0.3"),
    "Prefetched": ("ReadAhead", "0.3"),
    # the planner runs one search; what it minimizes is a price, not a second method
    "plan_tables(method=...)": ('plan_tables(price=...) (method="cost" is price="time")', "0.3"),
    "plan_collections(method=...)": (
        'plan_collections(price=...) (method="cost" is price="time")',
        "0.3",
    ),
    **{
        f"manualpar.embeddings.{name}": (f"{home}.{name}", "0.3")
        for name, home in LEFT_THE_EMBEDDINGS_FACE.items()
    },
}


def warn_deprecated(old: str, stacklevel: int = 3) -> None:
    """A FutureWarning (shown to users by default) naming `old`'s replacement."""
    new, since = DEPRECATED[old]
    warnings.warn(
        f"{old} was renamed {new} in manualpar {since}; the old spelling still works but "
        "will be removed",
        FutureWarning,
        stacklevel=stacklevel,
    )


def normalize_by(value: str) -> str:
    """A builder's `normalize_by`, with the pre-0.2 "world" read as "world_size"."""
    if value == "world":
        warn_deprecated('normalize_by="world"', stacklevel=4)
        return "world_size"
    return value


def moved(module: str, name: str) -> tuple[str, str]:
    """For a module's `__getattr__`: where `module.name`, a name that left `module` or was
    renamed, lives now, as (module, name), after a warning that gives its new spelling.
    An unknown name is the AttributeError Python would raise."""
    renamed = _RENAMED.get(module, {}).get(name)
    if renamed is not None:
        warn_deprecated("on_disk(placement)" if name == "on_disk" else name, stacklevel=4)
        return module, renamed
    home = LEFT_THE_EMBEDDINGS_FACE.get(name) if module == "manualpar.embeddings" else None
    if home is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warn_deprecated(f"{module}.{name}", stacklevel=4)
    return home, name


def renamed_keyword(old: str, value: T | None, old_value: T | None, new: str) -> T | None:
    """A call's value for a renamed keyword: the old keyword's (with a warning) when it was
    given (`old_value` not None), else the new one's. Both given is refused."""
    if old_value is None:
        return value
    if value is not None:
        raise ConfigTypeError(f"{old}: pass {new} alone, the two name the same thing")
    warn_deprecated(old, stacklevel=4)
    return old_value
