"""Choosing a plan: the planner's public namespace, for the command line and power users.

The planner runs in stages, each a module family with a small typed interface (lowest first):
- the problem: `Topology` (the machine), `Workload` (what a step looks up), `PlanConstraints`
  (what every plan must respect) and `PlanOptions` (the machine and step it is priced for);
- candidates: the placements weighed for one table (candidates.py);
- prices: what a placement costs each rank (`RankCosts`, `placement_costs`, `plan_costs`), its
  bytes from the exchange's description (`expected_sent_bytes`, `exchange_bytes`);
- search: the placement under the constraints (search.py, memory_planner.py, disk_budget.py),
  then each collection's wire dtypes where several are allowed (`WireChoice`, wire_choice.py);
- explain: each table's note, the per-rank text (`costs_text`).
`plan_tables`, `plan_collections` and `plan_by_cost` run them in that order.
"""

from manualpar.embeddings.config import check_tables
from manualpar.embeddings.dtype_names import DTYPE_NAMES, dtype_name, table_dtype
from manualpar.embeddings.id_spaces import raw_ids_from_json, raw_ids_to_json
from manualpar.embeddings.kernels.row_memory import available_bytes
from manualpar.embeddings.plan import format_bytes
from manualpar.embeddings.plan_text import per_rank_text
from manualpar.embeddings.planning.collection_plans import plan_collections
from manualpar.embeddings.planning.constraints import PRICES, PlanConstraints, PlanOptions
from manualpar.embeddings.planning.cost_model import placement_costs, plan_costs
from manualpar.embeddings.planning.cost_planner import CostPlan, plan_by_cost
from manualpar.embeddings.planning.cost_text import costs_text, format_seconds
from manualpar.embeddings.planning.exchange_bytes import (
    ExchangeBytes,
    exchange_bytes,
    expected_exchange_bytes,
    expected_sent_bytes,
)
from manualpar.embeddings.planning.planner import (
    DEFAULT_BATCH_PER_RANK,
    UNIFORM_PLANS,
    default_topology,
    plan_tables,
    plan_uniform,
    table_bytes,
)
from manualpar.embeddings.planning.rank_costs import RankCosts
from manualpar.embeddings.planning.remapper_budget import remapper_bytes_on_ranks
from manualpar.embeddings.planning.topology import TOPOLOGY_PRESETS, Topology, load_topology
from manualpar.embeddings.planning.wire_choice import WireChoice
from manualpar.embeddings.planning.workload import Workload, rule_costs

__all__ = [
    "DEFAULT_BATCH_PER_RANK",
    "DTYPE_NAMES",
    "PRICES",
    "TOPOLOGY_PRESETS",
    "UNIFORM_PLANS",
    "CostPlan",
    "ExchangeBytes",
    "PlanConstraints",
    "PlanOptions",
    "RankCosts",
    "Topology",
    "WireChoice",
    "Workload",
    "available_bytes",
    "check_tables",
    "costs_text",
    "default_topology",
    "dtype_name",
    "exchange_bytes",
    "expected_exchange_bytes",
    "expected_sent_bytes",
    "format_bytes",
    "format_seconds",
    "load_topology",
    "per_rank_text",
    "placement_costs",
    "plan_by_cost",
    "plan_collections",
    "plan_costs",
    "plan_tables",
    "plan_uniform",
    "raw_ids_from_json",
    "raw_ids_to_json",
    "remapper_bytes_on_ranks",
    "rule_costs",
    "table_bytes",
    "table_dtype",
]
