"""How a table reads its ids: rows already in [0, rows) (the default), or raw int64 ids from an
unbounded space, mapped to rows by a stable salted hash (`HashIds`) or by managed collisions
(`ManagedCollisions`: a remapper that gives each raw id a row of its own while there is room,
and evicts the least recently or least frequently seen id when there is not).

These are the settings only (`EmbeddingBagConfig(raw_ids=...)`); ids/hashing.py maps the ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from manualpar.errors import EmbeddingInputError

__all__ = [
    "EVICTION_POLICIES",
    "HashIds",
    "ManagedCollisions",
    "RawIds",
    "raw_ids_from_json",
    "raw_ids_to_json",
]

EVICTION_POLICIES = ("lru", "lfu")  # ManagedCollisions(policy=...): whose row a new id takes
_SALT_BITS = 64


def _check_salt(salt: object, what: str) -> None:
    if isinstance(salt, bool) or not isinstance(salt, int) or not 0 <= salt < 1 << _SALT_BITS:
        raise EmbeddingInputError(f"{what}: salt must be an int in [0, 2**64), got {salt!r}")


@dataclass(frozen=True)
class HashIds:
    """Raw ids hashed into rows: row = hash(id, salt) mod rows, the same on every run, machine
    and world size. Ids that hash to one row share it (collisions are not managed)."""

    salt: int = 0

    def __post_init__(self) -> None:
        _check_salt(self.salt, "HashIds")


@dataclass(frozen=True)
class ManagedCollisions:
    """Raw ids given rows as they arrive. An id hashes (with `salt`) to a bucket of
    `bucket_rows` rows and takes a free row there; in a full bucket it evicts the id seen least
    recently (`policy="lru"`) or least often (`"lfu"`), whose row it then shares the values of.
    The mapping is per-row state sharded, checkpointed and resharded with the table."""

    policy: str = "lru"
    salt: int = 0
    bucket_rows: int = 64

    def __post_init__(self) -> None:
        _check_salt(self.salt, "ManagedCollisions")
        if self.policy not in EVICTION_POLICIES:
            raise EmbeddingInputError(
                f"ManagedCollisions: policy must be one of {EVICTION_POLICIES}, got {self.policy!r}"
            )
        rows = self.bucket_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise EmbeddingInputError(
                f"ManagedCollisions: bucket_rows must be a positive int, got {rows!r}"
            )


# What EmbeddingBagConfig(raw_ids=...) takes: how raw int64 ids become rows.
RawIds = HashIds | ManagedCollisions


_KINDS: dict[str, type[HashIds] | type[ManagedCollisions]] = {
    "hash": HashIds,
    "managed": ManagedCollisions,
}


def raw_ids_to_json(raw_ids: RawIds | None) -> dict[str, object] | None:
    """A JSON-ready form of a table's `raw_ids`, with its kind ("hash" or "managed")."""
    if raw_ids is None:
        return None
    kind = "hash" if isinstance(raw_ids, HashIds) else "managed"
    return {"kind": kind, **vars(raw_ids)}


def raw_ids_from_json(entry: object) -> RawIds | None:
    """`raw_ids_to_json`'s inverse (callers name the file and entry around its errors)."""
    if entry is None:
        return None
    if not isinstance(entry, dict) or entry.get("kind") not in _KINDS:
        raise EmbeddingInputError(
            "raw_ids must be null or an object with kind 'hash' or 'managed' and "
            f'its settings, e.g. {{"kind": "hash", "salt": 0}}; got {entry!r}'
        )
    settings = {key: value for key, value in entry.items() if key != "kind"}
    try:
        return _KINDS[entry["kind"]](**settings)
    except TypeError as error:
        raise EmbeddingInputError(f"raw_ids {entry!r}: {error}") from None
