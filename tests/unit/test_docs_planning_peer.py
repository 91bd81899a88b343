"""docs/planning-peer.md's side-by-side tables are compare_planners.py's markdown of the outputs
stored beside the page (docs/planning-peer/*.json), and those outputs' manualpar-model numbers
are what the cost model prices their plans at today. (The page stayed a latency high at short
payloads after the model priced a steady step's sizes riding with its ids, with nothing to say
so.) Nothing here plans: TorchRec's numbers and the planning times are the stored run's."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from example_modules import load_example

from manualpar.embeddings import EmbeddingPlan
from manualpar.embeddings.planning import load_topology

compare = load_example(Path("benchmarks/compare_planners.py"), "compare_planners_docs")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "planning-peer.md"
OUTPUTS = ROOT / "docs" / "planning-peer"
TABLES = ("compare_k1.json", "compare_k20.json")  # the page's "1 id" and "20 ids" sections
# the model's numbers of compare_planners.summary (the rest is the planners' or TorchRec's)
PRICED = (
    "slowest_rank_s",
    "median_rank_s",
    "sent_intra_max",
    "sent_intra_median",
    "sent_inter_max",
    "sent_inter_median",
    "memory_max",
    "memory_median",
)


def _stored(name: str) -> dict[str, Any]:
    return json.loads((OUTPUTS / name).read_text())


@pytest.mark.parametrize("name", TABLES)
def test_the_pages_tables_are_the_generators_markdown(name: str) -> None:
    page = PAGE.read_text()
    for result in _stored(name)["results"]:
        assert compare.table_markdown(result) in page, f"{name}: {result['world_size']} ranks"


@pytest.mark.parametrize("name", [*TABLES, "compare_h100_k1_1024_per_rank.json"])
def test_the_stored_plans_are_priced_as_the_cost_model_prices_them(name: str) -> None:
    stored = _stored(name)
    tables = compare.load_tables(str(ROOT / stored["args"]["tables"]))
    for result in stored["results"]:
        world, per_node = result["world_size"], result["ranks_per_node"]
        topology = load_topology(result["topology"], world, per_node)
        workload = compare.workload_of(tables, result["batch_per_rank"], result["ids_per_bag"])
        for planner, found in result["planners"].items():
            plan = EmbeddingPlan.from_dict(found["plan"])
            today = compare.summary(plan, tables, topology, workload)
            for key in PRICED:
                assert math.isclose(today[key], found[key], rel_tol=1e-9), (
                    f"{name}, {world} ranks, {planner}: {key} {found[key]} stored, {today[key]} "
                    "today: rerun the page's commands (docs/planning-peer.md) and update it"
                )
