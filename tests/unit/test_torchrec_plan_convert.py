"""TorchRec's shards, described as plain data, become manualpar plans that validate against the
tables, with the same ranks, and a note wherever the layout is only approximated."""

from __future__ import annotations

import pytest
from example_modules import load_example

from manualpar.embeddings import EmbeddingBagConfig, EmbeddingPlan

convert = load_example("benchmarks/torchrec_plan_convert.py", "torchrec_plan_convert")

ROWS, DIM = 40, 8


def shards(kind: str, ranks: list[int], sizes: list[int]) -> list[dict[str, object]]:
    """Row (kind "rows") or column blocks of the given sizes, on `ranks`, in order."""
    out, start = [], 0
    for rank, size in zip(ranks, sizes, strict=True):
        offset, size_2d = (
            ([start, 0], [size, DIM]) if kind == "rows" else ([0, start], [ROWS, size])
        )
        out.append({"rank": rank, "offset": offset, "size": size_2d})
        start += size
    return out


def table(name: str, kind: str, blocks: list[dict[str, object]], rows: int = ROWS) -> dict:
    return {
        "name": name,
        "num_embeddings": rows,
        "embedding_dim": DIM,
        "sharding_type": kind,
        "compute_kernel": "fused",
        "shards": blocks,
    }


def full(rank: int) -> list[dict[str, object]]:
    return [{"rank": rank, "offset": [0, 0], "size": [ROWS, DIM]}]


def test_every_kind_maps_to_the_same_layout_and_the_plan_validates() -> None:
    world, per_node = 4, 2
    described = [
        table("tw", "table_wise", full(3)),
        table("rw", "row_wise", shards("rows", [0, 1, 2, 3], [10, 10, 10, 10])),
        table("twrw", "table_row_wise", shards("rows", [2, 3], [20, 20])),
        table("cw", "column_wise", shards("cols", [1, 3], [4, 4])),
        table("dp", "data_parallel", [full(r)[0] for r in range(world)]),
    ]
    data = convert.to_manualpar_plan(world, per_node, described, {"torchrec": {"x": 1}})
    plan = EmbeddingPlan.from_dict(data)
    configs = [EmbeddingBagConfig(t["name"], ROWS, DIM) for t in described]
    plan.validate(configs, world)
    assert {name: (p.sharding, list(p.ranks)) for name, p in plan.tables.items()} == {
        "tw": ("table_wise", [3]),
        "rw": ("row_wise", []),
        "twrw": ("table_row_wise", [2, 3]),
        "cw": ("column_wise", [1, 3]),
        "dp": ("data_parallel", []),
    }
    assert not any(note.startswith("approximate") for note in plan.notes.values())
    assert data["torchrec"] == {"x": 1}
    # the shards manualpar derives hold the same ranks' rows and columns as TorchRec's
    cw = plan.shards(configs[3])
    assert [(s.rank, s.col_start, s.col_end) for s in cw] == [(1, 0, 4), (3, 4, 8)]


def test_blocks_manualpar_cannot_write_exactly_get_the_nearest_placement_and_a_note() -> None:
    world, per_node = 8, 8
    few_rows = table("few", "table_row_wise", shards("rows", list(range(8)), [1] * 3 + [0] * 5), 3)
    ceil_split = table("ceil", "row_wise", shards("rows", list(range(8)), [6] * 6 + [4, 0]), 40)
    twice = table("twice", "column_wise", shards("cols", [5, 5, 6, 6], [2, 2, 2, 2]))
    one_rank = table("one", "column_wise", shards("cols", [2, 2], [4, 4]))
    data = convert.to_manualpar_plan(world, per_node, [few_rows, ceil_split, twice, one_rank])
    plan = EmbeddingPlan.from_dict(data)
    plan.validate(
        [
            EmbeddingBagConfig("few", 3, DIM),
            EmbeddingBagConfig("ceil", 40, DIM),
            EmbeddingBagConfig("twice", ROWS, DIM),
            EmbeddingBagConfig("one", ROWS, DIM),
        ],
        world,
    )
    assert data["tables"] == {
        "few": {"sharding": "row_wise", "ranks": [0, 1, 2]},
        "ceil": {"sharding": "row_wise", "ranks": [0, 1, 2, 3, 4, 5, 6]},
        "twice": {"sharding": "column_wise", "ranks": [5, 6]},
        "one": {"sharding": "table_wise", "ranks": [2]},
    }
    notes = data["notes"]
    assert all(notes[name].startswith("approximate: torchrec") for name in data["tables"])
    assert "ranks [3, 4, 5, 6, 7] hold no row" in notes["few"]
    assert "row blocks of 4..6 where manualpar's even split makes 5..6" in notes["ceil"]
    assert "a rank holds two column blocks" in notes["twice"]


def test_a_shard_off_the_table_or_rank_outside_the_job_is_refused() -> None:
    past = table("t", "row_wise", shards("rows", [0, 1], [30, 30]))
    with pytest.raises(convert.ConversionError, match="runs past the table"):
        convert.to_manualpar_plan(2, 2, [past])
    with pytest.raises(convert.ConversionError, match="rank 5 outside"):
        convert.to_manualpar_plan(2, 2, [table("t", "table_wise", full(5))])
    with pytest.raises(convert.ConversionError, match="must divide"):
        convert.to_manualpar_plan(6, 4, [table("t", "table_wise", full(0))])
