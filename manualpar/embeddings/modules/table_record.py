"""A collection's checkpoint record (checkpoint/records.py): what gives its tables' rows their
meaning. A row of a raw-id table stands for the ids that hash (or were remapped) to it under the
table's salt and buckets: loaded under another `HashIds` salt, a raw id keeps its row by chance
(1 in `rows`), and under another managed salt or `bucket_rows` ids land in other buckets than
the remapper's loaded state places them in; either way almost every id silently reads a row
trained for other ids. Rows, dim and dtype are recorded too (for `inspect` and people), but
another rows or dim is refused by the load's shape check, which names both shapes; the raw-id
setting (kind, salt, bucket_rows) is what a load could not see and is checked here. The
eviction policy may change (it decides only which id a full bucket gives up next), and so may
the dtype (values are converted on load, with a range check, checkpoint/dtypes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from manualpar.embeddings.config import EmbeddingBagConfig
from manualpar.embeddings.dtype_names import dtype_name
from manualpar.embeddings.id_spaces import raw_ids_from_json, raw_ids_to_json
from manualpar.errors import CheckpointMismatchError, EmbeddingInputError

__all__ = ["TableRecords", "check_tables_record", "tables_record"]

_FREE = ("policy",)  # raw-id settings a load may change


def tables_record(configs: Sequence[EmbeddingBagConfig]) -> dict[str, Any]:
    """Each table's rows, dim, dtype and raw-id setting, by table name."""
    return {
        "tables": {
            c.name: {
                "rows": c.num_embeddings,
                "dim": c.embedding_dim,
                "dtype": dtype_name(c.dtype),
                "raw_ids": raw_ids_to_json(c.raw_ids),
            }
            for c in configs
        }
    }


def check_tables_record(
    configs: Sequence[EmbeddingBagConfig], saved: dict[str, Any], where: str
) -> None:
    """Refuse a checkpoint whose tables (those of the same name) have another raw-id setting,
    naming every difference; tables only one side has are left to the key check, other rows or
    dim to the shape check."""
    tables = saved.get("tables")
    if not isinstance(tables, dict):
        return
    problems = [
        problem
        for config in configs
        if isinstance(tables.get(config.name), dict)
        for problem in _differences(config, tables[config.name])
    ]
    if problems:
        raise CheckpointMismatchError(
            f"{where}: the tables were saved with other settings, so their rows would mean "
            f"other ids: {'; '.join(problems)}. Build the tables with the checkpoint's settings "
            "to load it, or start from fresh tables (another checkpoint directory) to train "
            "with the new ones"
        )


def _differences(config: EmbeddingBagConfig, saved: dict[str, Any]) -> list[str]:
    name, problems = config.name, []
    if "raw_ids" in saved and _fixed(saved["raw_ids"]) != _fixed(raw_ids_to_json(config.raw_ids)):
        problems.append(
            f"table {name!r}: raw_ids={_describe(saved['raw_ids'])} in the checkpoint, "
            f"raw_ids={_describe(raw_ids_to_json(config.raw_ids))} now"
        )
    return problems


def _fixed(raw_ids: Any) -> Any:
    """The raw-id settings a load must keep (all but the eviction policy)."""
    if not isinstance(raw_ids, dict):
        return raw_ids
    return {key: value for key, value in raw_ids.items() if key not in _FREE}


def _describe(raw_ids: Any) -> str:
    """HashIds(salt=1) for a recorded setting (as written in the record if it is not one)."""
    try:
        return repr(raw_ids_from_json(raw_ids))
    except EmbeddingInputError:
        return repr(raw_ids)


class TableRecords:
    """Mixin of the collections (unsharded and sharded): their checkpoint record."""

    configs: tuple[EmbeddingBagConfig, ...]

    def checkpoint_record(self) -> dict[str, Any]:
        """Each table's rows, dim, dtype and raw-id setting, saved in a checkpoint's manifest."""
        return tables_record(self.configs)

    def check_checkpoint_record(self, saved: dict[str, Any], where: str) -> None:
        """Refuse (CheckpointMismatchError) a checkpoint of tables with another raw-id setting:
        their rows would mean other ids."""
        check_tables_record(self.configs, saved, where)
