"""`python -m manualpar plan`: a sharding plan for tables and a world size, without any process.

Sizing a job before it runs: how many ranks or how much memory per rank the tables need, and a
plan file that a training script can load (`EmbeddingPlan.from_json`, e.g. examples/recsys's
`--plan FILE`). The placement itself comes from manualpar.embeddings.planning; this
module only reads the command line into it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import torch

from manualpar import EmbeddingInputError
from manualpar.cli.plan_layouts import layouts_text, plan_layouts
from manualpar.cli.plan_values import (
    UsageError,
    bags_per_feature_of,
    disk_options,
    parse_bytes,
    precisions_of,
    replica_choices,
    topology_of,
    wire_dtypes_of,
)
from manualpar.deprecated import warn_deprecated
from manualpar.embeddings import (
    SGD,
    Adagrad,
    Adam,
    EmbeddingBagConfig,
    RowWiseAdagrad,
    UpdateRule,
)
from manualpar.embeddings.planning import (
    DEFAULT_BATCH_PER_RANK,
    DTYPE_NAMES,
    TOPOLOGY_PRESETS,
    UNIFORM_PLANS,
    PlanConstraints,
    Workload,
    check_tables,
    costs_text,
    expected_sent_bytes,
    format_bytes,
    per_rank_text,
    plan_tables,
    plan_uniform,
    raw_ids_from_json,
    remapper_bytes_on_ranks,
    rule_costs,
    table_dtype,
)

__all__ = ["PLANS", "UsageError", "add_arguments", "parse_bytes", "parse_table", "run"]

PLANS = ("auto", "memory", *UNIFORM_PLANS)
RULES: dict[str, type[UpdateRule]] = {
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": Adagrad,
    "adam": Adam,
    "sgd": SGD,
}
TABLE_SPEC = "NAME:ROWS:DIM[:FEATURE,...]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` command's options (choices are checked in run(), for one-line errors)."""
    add = parser.add_argument
    add(
        "--table",
        action="append",
        default=[],
        metavar=TABLE_SPEC,
        help="a table (repeat); the feature defaults to the table's name",
    )
    add(
        "--tables",
        metavar="FILE.json",
        help="a JSON list of objects with EmbeddingBagConfig's fields",
    )
    add(
        "--table-dtype",
        default="fp32",
        help=f"how the --table tables store rows: {', '.join(DTYPE_NAMES)} (default fp32); "
        "weights are counted in it, optimizer state as float32",
    )
    add("--world-size", type=int, required=True, help="ranks of the job")
    add(
        "--plan",
        default="auto",
        help=f"one of {', '.join(PLANS)} (default auto: the fastest predicted plan; memory: "
        "the earlier placement by memory alone)",
    )
    add(
        "--topology",
        default=None,
        metavar="NAME|FILE",
        help=f"the machine: a preset ({', '.join(TOPOLOGY_PRESETS)}) or a JSON file from "
        "`python -m manualpar calibrate`; its device memory is the budget unless "
        "--memory-budget says otherwise (default: cpu-host, no budget)",
    )
    add(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="bytes per rank for weights + optimizer state, e.g. 2GiB, 512MiB, 1000000",
    )
    add(
        "--rule",
        default=None,
        help=f"update rule whose state is counted: {', '.join(RULES)} (default rowwise_adagrad)",
    )
    add("--optimizer", default=None, help=argparse.SUPPRESS)  # --rule before 0.3: warns
    add(
        "--ranks-per-node",
        type=int,
        default=None,
        help="for table_row_wise and auto: ranks per node (default: all ranks on one node)",
    )
    add(
        "--batch-per-rank",
        type=int,
        default=None,
        help="samples a rank per step, for the cost model and the predicted bytes and times "
        f"(default {DEFAULT_BATCH_PER_RANK}); also prints the bytes of each rank's exchanges",
    )
    add(
        "--ids-per-bag",
        type=float,
        default=1.0,
        help="mean ids a sample per feature, spread evenly over the rows (default 1)",
    )
    add(
        "--bags-per-feature",
        action="append",
        default=[],
        metavar="FEATURE=BAGS",
        help="a batch per feature (SparseFeatures.bags_per_key): the bags a rank sends per step "
        "for FEATURE (repeat, or FEATURE=BAGS,...); the others have one per sample. Priced by "
        "the cost model, and by the bytes line with --batch-per-rank",
    )
    add(
        "--precisions",
        default=None,
        metavar="DTYPE,...",
        help="row dtypes the planner may choose per table, most precise first, e.g. fp32,bf16: "
        "a table takes a less precise one only where memory forces it, before going to disk",
    )
    add(
        "--wire-dtypes",
        default=None,
        metavar="NAME,...",
        help="wire dtypes the planner may give the exchanges, most precise first, e.g. "
        "fp32,bf16 (names: fp32, bf16, fp16, fp8): it takes the one the predicted step is "
        "fastest with and writes it into the plan (default: float32)",
    )
    add(
        "--skew",
        type=float,
        default=0.0,
        help="Zipf exponent of the ids' popularity, e.g. 1.05 (default 0: uniform); skewed ids "
        "touch fewer distinct rows, which favours caches and 2-D meshes",
    )
    add(
        "--replicas",
        default="1",
        metavar="N|auto",
        help="plan for the shard dim of an N x (world / N) mesh (each shard group a full copy "
        "of the tables, gradients summed across the copies); auto compares 1, 2, 4 and 8 and "
        "keeps the fastest predicted (default 1: a 1-D plan)",
    )
    add(
        "--disk-cache",
        default=None,
        metavar="SIZE",
        help="plan with a disk tier whose cache takes SIZE per rank (DiskTier(cache_bytes=)): "
        "over the budget, the largest tables go on disk until the rest plus the cache fit",
    )
    add(
        "--pin",
        action="append",
        default=[],
        metavar="TABLE=PLACEMENT",
        help="keep TABLE's placement (repeat): disk (rows over every rank, on disk; needs "
        "--disk-cache), row_wise, data_parallel or table_wise:RANK; the rest is planned around it",
    )
    add("--json", metavar="OUT", default=None, help="also write the plan's JSON to OUT")


def parse_table(spec: str, dtype: torch.dtype = torch.float32) -> EmbeddingBagConfig:
    """NAME:ROWS:DIM[:FEATURE,...] -> EmbeddingBagConfig (rows stored in `dtype`)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[1:3]):
        raise UsageError(
            f"--table {spec!r}: expected {TABLE_SPEC} with integer ROWS and DIM, "
            "e.g. user:1000000:64 or item:500000:64:item,last_item"
        )
    features = tuple(f for f in parts[3].split(",") if f) if len(parts) == 4 else ()
    return EmbeddingBagConfig(
        parts[0], int(parts[1]), int(parts[2]), feature_names=features, dtype=dtype
    )


def load_tables(path: str) -> list[EmbeddingBagConfig]:
    """A JSON list of EmbeddingBagConfig fields (name, num_embeddings, embedding_dim, ...)."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UsageError(f"--tables {path}: cannot read a JSON list: {error}") from None
    fields = [f.name for f in dataclasses.fields(EmbeddingBagConfig)]
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise UsageError(f"--tables {path}: expected a JSON list of objects with fields {fields}")
    tables = []
    for index, entry in enumerate(entries):
        unknown = sorted(set(entry) - set(fields))
        missing = [f for f in fields[:3] if f not in entry]
        if unknown or missing:
            raise UsageError(
                f"--tables {path}: entry {index} has unknown fields {unknown} or "
                f"lacks {missing}; the fields are {fields}"
            )
        try:
            if isinstance(entry.get("dtype"), str):  # "bf16", "bfloat16"
                entry = {**entry, "dtype": table_dtype(entry["dtype"])}
            if "raw_ids" in entry:  # {"kind": "hash", "salt": 0}
                entry = {**entry, "raw_ids": raw_ids_from_json(entry["raw_ids"])}
            tables.append(EmbeddingBagConfig(**entry))
        except EmbeddingInputError as error:
            raise UsageError(f"--tables {path}: entry {index}: {error}") from None
        except TypeError as error:  # e.g. a number where a name belongs
            raise UsageError(f"--tables {path}: entry {index}: {error}") from None
    return tables


def _check_arguments(args: argparse.Namespace) -> None:
    if args.plan not in PLANS:
        raise UsageError(f"--plan {args.plan!r}: expected one of {', '.join(PLANS)}")
    _rule_of_optimizer(args)
    if args.rule not in RULES:
        raise UsageError(f"--rule {args.rule!r}: expected one of {', '.join(RULES)}")
    if args.world_size < 1:
        raise UsageError(f"--world-size {args.world_size}: expected at least 1")
    per_node = args.ranks_per_node
    if per_node is not None and (per_node < 1 or args.world_size % per_node):
        raise UsageError(
            f"--ranks-per-node {per_node}: expected a divisor of --world-size {args.world_size}"
        )
    if not args.table and not args.tables:
        raise UsageError(f"no tables: pass --table {TABLE_SPEC} (repeatable) or --tables FILE")
    _check_workload(args)


def _rule_of_optimizer(args: argparse.Namespace) -> None:
    """`--optimizer`, the spelling of `--rule` before 0.3, read as `--rule` with a warning."""
    if args.optimizer is not None:
        if args.rule is not None:
            raise UsageError("--optimizer is --rule's spelling before 0.3: pass --rule alone")
        warn_deprecated("python -m manualpar plan --optimizer", stacklevel=2)
        args.rule = args.optimizer
    args.rule = args.rule or "rowwise_adagrad"


def _check_workload(args: argparse.Namespace) -> None:
    """The step's numbers: a NaN or an infinity would price every plan alike."""
    if args.batch_per_rank is not None and args.batch_per_rank < 1:
        raise UsageError(
            f"--batch-per-rank {args.batch_per_rank}: expected samples a rank per step, at least 1"
        )
    if not (math.isfinite(args.ids_per_bag) and args.ids_per_bag >= 0):
        raise UsageError(f"--ids-per-bag {args.ids_per_bag}: expected a finite mean >= 0")
    if not (math.isfinite(args.skew) and args.skew >= 0):
        raise UsageError(f"--skew {args.skew}: expected 0 (uniform) or a finite Zipf exponent > 0")


def run(args: argparse.Namespace) -> int:
    """Print the plan (and write its JSON); errors are ManualParErrors (one line, exit 2)."""
    _check_arguments(args)
    try:
        dtype = table_dtype(args.table_dtype)
    except EmbeddingInputError as error:
        raise UsageError(f"--table-dtype: {error}") from None
    tables = [parse_table(spec, dtype) for spec in args.table]
    tables += load_tables(args.tables) if args.tables else []
    check_tables(tables)
    topology = topology_of(args)
    budget = parse_bytes(args.memory_budget) if args.memory_budget is not None else None
    if budget is None and args.topology is not None:
        budget = topology.device_memory_bytes
    rule = RULES[args.rule](lr=0.01)  # only its state's shape matters here
    batch = DEFAULT_BATCH_PER_RANK if args.batch_per_rank is None else args.batch_per_rank
    pooling = {config.name: args.ids_per_bag for config in tables}
    state, full_rows = rule_costs(rule)
    own = bags_per_feature_of(args, tables, batch)
    workload = Workload(batch, pooling, own, state=state, full_rows=full_rows, skew=args.skew)
    disk_tier, pinned = disk_options(args)
    if args.precisions and (disk_tier is not None or pinned):  # plan_by_cost has no disk rule
        raise UsageError(
            "--precisions with --disk-cache or --pin: the precision search does not place tables "
            "on disk or keep pins yet; plan precisions without them, or pin dtypes in the tables"
        )
    wires = wire_dtypes_of(args)
    if args.plan in ("auto", "memory"):
        place: Any = functools.partial(
            plan_tables,
            constraints=PlanConstraints(disk_tier=disk_tier, pinned=pinned, wire_dtypes=wires),
            price="time" if args.plan == "auto" else "memory",
            topology=topology,
            batch_per_rank=batch,
            pooling_factors=pooling,
            bags_per_feature=own,
            skew=args.skew,
        )
    elif disk_tier is not None or pinned:
        raise UsageError("--disk-cache and --pin: only --plan auto and --plan memory take them")
    else:
        place = functools.partial(plan_uniform, args.plan)
    layouts, refused = plan_layouts(
        tables,
        replica_choices(args.replicas, topology),
        topology,
        workload,
        budget,
        precisions_of(args),
        functools.partial(place, memory_budget_bytes=budget, rule=rule),
        cost_kwargs=args.plan in ("auto", "memory"),
        disk_tier=disk_tier,
        wire_dtypes=wires,
    )
    best = min(layouts, key=lambda layout: layout.slowest(topology))
    replicas, plan, costs, tables = best.replicas, best.plan, best.costs, best.tables
    if len(layouts) + len(refused) > 1:
        print(layouts_text(layouts, refused, topology, replicas))
    plan.validate(tables, args.world_size // replicas)
    per_rank = plan.bytes_per_rank(tables, rule.STATE)
    print(plan.describe(tables))
    if not isinstance(rule, RowWiseAdagrad):
        what = (
            f"weights + {type(rule).__name__} state"
            if rule.STATE
            else f"weights only, {type(rule).__name__} keeps no state"
        )
        print(f"  bytes per rank ({what}): " + per_rank_text(per_rank, format_bytes))
    remappers = remapper_bytes_on_ranks(plan, tables)
    if any(remappers):  # int64 state per row, beside the tables (ids/buckets.py)
        print("  managed-collision remappers per rank: " + per_rank_text(remappers, format_bytes))
    if args.batch_per_rank is not None and replicas == 1:
        print(_traffic(tables, plan, args.batch_per_rank, args.ids_per_bag, rule, own))
    print(costs_text(costs, topology, batch, replicas))
    if args.json:
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(plan.to_json() + "\n")
        except OSError as error:
            raise UsageError(f"--json {args.json}: cannot write the plan: {error}") from None
        print(f"plan written to {args.json}")
    return 0


def _traffic(
    tables: list[EmbeddingBagConfig],
    plan: Any,
    batch: int,
    ids_per_bag: float,
    rule: UpdateRule,
    own: dict[str, float],
) -> str:
    """The expected bytes one step's exchanges send per rank (planning/exchange_bytes.py), a
    batch per feature's (`own`) as a real step sends its bags
    (tests/dist/test_emb_planning_variable_batch_ranks.py)."""
    per_bag = {f: ids_per_bag for config in tables for f in config.feature_names}
    full_rows = rule_costs(rule)[1]
    wire = {"wire": plan.wire} if plan.wire is not None else {}  # the planner's pick
    per_rank = expected_sent_bytes(
        tables, plan, batch, per_bag, full_rows=full_rows, bags_per_feature=own, **wire
    )
    sent = [int(value) for value in per_rank]
    bags = "".join(f", {feature} {count:g} bags" for feature, count in own.items())
    return (
        f"  bytes sent per rank and step ({batch} samples, {ids_per_bag:g} ids per bag{bags}): "
        + per_rank_text(sent, format_bytes)
    )
