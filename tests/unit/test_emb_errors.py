"""Bad embedding inputs fail at the call that received them, naming what, where and what to do.

Each case asserts the exact exception type and the parts of the message a user needs: the
feature or table, the bad value, and the fix. A bad batch on one rank of sharded tables is in
tests/dist/test_emb_errors_ranks.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_tables import GOOD, tiny_tables
from tiny_tables import good_batch as _batch
from tiny_tables import raises as _raises

import manualpar as mp
from manualpar.embeddings import (
    SGD,
    Adam,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingPlan,
    RowWiseAdagrad,
    SparseFeatures,
    TablePlacement,
    column_wise,
    row_wise,
    shard_embeddings,
    table_wise,
)
from manualpar.errors import BuilderError, EmbeddingInputError, PlanError

TABLES = tiny_tables()


# ---- ids -------------------------------------------------------------------------------------
def test_id_out_of_range_names_feature_table_rows_value_and_sample() -> None:
    ebc = EmbeddingBagCollection(TABLES)
    with _raises(
        EmbeddingInputError,
        "feature 'last_item' (table 'item', 5 rows): id 5 at "
        "position 1 of the feature's ids (sample 1) is out of range; ids must be in "
        "[0, 5). If these are raw ids, set EmbeddingBagConfig(raw_ids=HashIds(...)) or "
        "raw_ids=ManagedCollisions(...) on the table; otherwise hash or clamp them first",
    ):
        ebc(_batch(last_item=[[2], [5]]))


def test_negative_id_names_feature_and_value() -> None:
    ebc = EmbeddingBagCollection(TABLES)
    with _raises(
        EmbeddingInputError,
        "feature 'user' (table 'user', 10 rows): id -3 at "
        "position 2 of the feature's ids (sample 1) is negative; ids must be in [0, 10)",
    ):
        ebc(_batch(user=[[1], [2, -3]]))


def test_float_ids_are_refused_with_the_conversion_to_make() -> None:
    with _raises(
        EmbeddingInputError,
        "SparseFeatures.values (features ['user']) must hold "
        "integer ids (int64 or int32), got torch.float32; convert with .long()",
    ):
        SparseFeatures(("user",), torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))


def test_float_lengths_are_refused() -> None:
    with _raises(
        EmbeddingInputError,
        "SparseFeatures.lengths (features ['user']) must hold integer bag lengths",
        "got torch.float32; convert with .long()",
    ):
        SparseFeatures(("user",), torch.tensor([1, 2]), torch.tensor([1.0, 1.0]))


def test_two_dimensional_ids_are_refused() -> None:
    with _raises(
        EmbeddingInputError,
        "SparseFeatures.values must be a 1-D tensor, got a tensor of shape (1, 2); use from_dict()",
    ):
        SparseFeatures(("user",), torch.tensor([[1, 2]]), torch.tensor([1, 1]))


# ---- lengths and ids -------------------------------------------------------------------------
def test_lengths_and_ids_disagree() -> None:
    with _raises(
        EmbeddingInputError,
        "lengths add up to 2 ids (per feature {'user': 2, 'item': "
        "0}) but values holds 3; lengths and ids must describe the same bags",
    ):
        SparseFeatures(("user", "item"), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 0, 0]))


def test_lengths_not_one_per_feature_and_sample() -> None:
    with _raises(
        EmbeddingInputError,
        "lengths has 3 entries, not a multiple of the 2 keys "
        "['user', 'item']: expected one length per (key, sample)",
    ):
        SparseFeatures(("user", "item"), torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))


def test_negative_length_names_feature_and_sample() -> None:
    with _raises(
        EmbeddingInputError, "feature 'item': negative bag length -1 for sample 1", "must be >= 0"
    ):
        SparseFeatures(("user", "item"), torch.tensor([1, 2]), torch.tensor([1, 1, 1, -1]))


def test_features_with_different_sample_counts() -> None:
    with _raises(
        EmbeddingInputError,
        "every feature needs one bag per sample, got bag counts "
        "{'user': 2, 'item': 1}; use an empty list for a sample without ids",
    ):
        SparseFeatures.from_dict({"user": [[1], [2]], "item": [[0]]})


def test_weights_of_the_wrong_shape() -> None:
    with _raises(
        EmbeddingInputError,
        "weights must be a float tensor with one weight per id "
        "(shape (2,)), got torch.float32 of shape (1,)",
    ):
        SparseFeatures(("user",), torch.tensor([1, 2]), torch.tensor([1, 1]), torch.tensor([1.0]))


# ---- features --------------------------------------------------------------------------------
def test_unknown_feature_lists_the_tables_features() -> None:
    ebc = EmbeddingBagCollection(TABLES)
    with _raises(
        EmbeddingInputError,
        "unknown features ['clicks']: no table looks them up; the "
        "tables' features are ['user', 'item', 'last_item']",
    ):
        ebc(_batch(clicks=[[1], [1]]))


def test_missing_feature_says_to_send_empty_bags() -> None:
    ebc = EmbeddingBagCollection(TABLES)
    with _raises(
        EmbeddingInputError,
        "features ['last_item'] are missing from the batch",
        "give a sample no ids with an empty bag",
    ):
        ebc(SparseFeatures.from_dict({"user": [[1], [2]], "item": [[0], [1]]}))


def test_not_a_sparse_batch() -> None:
    with _raises(
        EmbeddingInputError,
        "expected SparseFeatures, got dict; build one with SparseFeatures.from_dict(",
    ):
        EmbeddingBagCollection(TABLES)(GOOD)


# ---- table configs ---------------------------------------------------------------------------
def test_feature_names_given_as_one_string() -> None:
    with _raises(
        EmbeddingInputError,
        "table 'item': feature_names must be a sequence of names, "
        "got the string 'item'; write feature_names=('item',)",
    ):
        EmbeddingBagConfig("item", 5, 4, feature_names="item")  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [0, True, 2.5])
def test_table_size_must_be_a_positive_int(rows: object) -> None:
    with _raises(
        EmbeddingInputError, f"table 'user': num_embeddings must be a positive int, got {rows!r}"
    ):
        EmbeddingBagConfig("user", rows, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["us\x00er", "user\n", 7])
def test_a_table_name_must_be_a_string_without_unprintable_characters(name: object) -> None:
    with _raises(
        EmbeddingInputError,
        f"table name {name!r} must be a non-empty string without '/', '.' or unprintable "
        "characters",
    ):
        EmbeddingBagConfig(name, 5, 4)  # type: ignore[arg-type]
    with _raises(
        EmbeddingInputError,
        f"table 'user': feature name {name!r} must be a non-empty string without unprintable "
        "characters",
    ):
        EmbeddingBagConfig("user", 5, 4, feature_names=("ok", name))  # type: ignore[arg-type]


@pytest.mark.parametrize("what", ["num_embeddings", "embedding_dim"])
def test_a_table_size_past_int64_is_refused(what: str) -> None:
    sizes = {"num_embeddings": 5, "embedding_dim": 4, what: 2**63}
    with _raises(
        EmbeddingInputError,
        f"table 'user': {what} must be at most 2**63 - 1 (a tensor's sizes are int64), got {2**63}",
    ):
        EmbeddingBagConfig("user", **sizes)


def test_a_feature_looked_up_by_two_tables() -> None:
    with _raises(
        EmbeddingInputError,
        "feature 'user' is listed by tables 'user' and 'other'; a "
        "feature must look up exactly one table",
    ):
        EmbeddingBagCollection(
            [TABLES[0], EmbeddingBagConfig("other", 3, 4, feature_names=("user",))]
        )


# ---- plans -----------------------------------------------------------------------------------
def test_plan_for_another_world_size() -> None:
    plan = EmbeddingPlan(2, {"user": table_wise(0), "item": table_wise(1)})
    with _raises(
        PlanError,
        "this plan was made for world size 2, but the job has 1 ranks; make "
        "a plan for 1 ranks (plan='auto' does)",
    ):
        shard_embeddings(
            EmbeddingBagCollection(TABLES), mp.ManualParallelStrategy(), plan, SGD(lr=0.1)
        )


def test_plan_that_leaves_a_table_out() -> None:
    with _raises(PlanError, "the plan leaves out tables ['item']; every table needs a placement"):
        shard_embeddings(
            EmbeddingBagCollection(TABLES),
            mp.ManualParallelStrategy(),
            {"user": table_wise(0)},
            SGD(lr=0.1),
        )


def test_plan_with_an_unknown_table() -> None:
    plan = EmbeddingPlan(1, {"user": table_wise(0), "item": table_wise(0), "ads": table_wise(0)})
    with _raises(
        PlanError,
        "the plan places tables ['ads'] that the collection does not have; "
        "remove them or fix their names (its tables are ['user', 'item'])",
    ):
        plan.validate(TABLES, 1)


@pytest.mark.parametrize(
    ("placement", "bad", "launch"),
    [
        (table_wise(3), "[3]", 4),
        (column_wise((0, -1)), "[-1]", None),
        (row_wise((0, 2)), "[2]", 3),
    ],
    ids=["table_wise_3", "column_wise_minus_1", "row_wise_0_2"],
)
def test_plan_naming_a_rank_that_does_not_exist(
    placement: TablePlacement, bad: str, launch: int | None
) -> None:
    plan = EmbeddingPlan(2, {"user": placement, "item": table_wise(0)})
    hint = (
        f", or launch the job on at least {launch} ranks (one node: torchrun --nproc-per-node "
        f"{launch})"
        if launch
        else ""
    )
    with _raises(
        PlanError,
        f"table 'user' ({placement}): ranks {bad} do not exist in a job of 2 "
        f"ranks; use ranks in [0, 2){hint}",
    ):
        plan.validate(TABLES, 2)


def test_plan_errors_from_bad_values() -> None:
    with _raises(PlanError, "a plan's world_size must be an int >= 1, got 0"):
        EmbeddingPlan(0, {})
    with _raises(PlanError, "table_wise: ranks must be integers, got ['0']"):
        table_wise("0")  # type: ignore[arg-type]
    with _raises(
        PlanError,
        "sharding must be one of ('table_wise', 'row_wise', 'column_wise', "
        "'table_row_wise', 'data_parallel'), got 'diagonal'",
    ):
        TablePlacement("diagonal")
    with _raises(PlanError, "a plan must be JSON from EmbeddingPlan.to_json()"):
        EmbeddingPlan.from_json("world_size: 2")
    with _raises(PlanError, "not a plan: KeyError('world_size')"):
        EmbeddingPlan.from_json('{"tables": {}}')


def test_too_many_row_blocks_for_a_small_table() -> None:
    plan = EmbeddingPlan(2, {"user": row_wise(), "item": table_wise(0)})
    with _raises(
        PlanError, "table 'user' (row_wise): 1 rows cannot be split over 2 ranks; use table_wise"
    ):
        plan.validate([EmbeddingBagConfig("user", 1, 4), TABLES[1]], 2)


# ---- builder misuse --------------------------------------------------------------------------
def test_sharding_the_same_collection_twice() -> None:
    strategy = mp.ManualParallelStrategy()
    ebc = EmbeddingBagCollection(TABLES)
    shard_embeddings(ebc, strategy, "auto", SGD(lr=0.1))
    with _raises(
        BuilderError,
        "shard_embeddings(): module EmbeddingBagCollection was already set "
        "up by shard_embeddings(); call each builder once per module",
    ):
        shard_embeddings(ebc, strategy, "auto", SGD(lr=0.1))


def test_sharding_without_an_update_rule() -> None:
    with _raises(
        BuilderError, "shard_embeddings(): pass rule=SGD/Adagrad/RowWiseAdagrad/Adam(lr=...)"
    ):
        shard_embeddings(EmbeddingBagCollection(TABLES), mp.ManualParallelStrategy(), "auto")


# ---- optimizers ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SGD(lr=-1), "SGD: lr must be a finite number >= 0, got -1"),
        (lambda: SGD(lr="0.1"), "SGD: lr must be a finite number >= 0, got '0.1'"),
        (lambda: SGD(lr=float("nan")), "SGD: lr must be a finite number >= 0, got nan"),
        (lambda: RowWiseAdagrad(lr=0.1, eps=0), "RowWiseAdagrad: eps must be a finite number > 0"),
        (
            lambda: Adam(lr=0.1, betas=(1.5, 0.9)),
            "Adam: betas must be two numbers in [0, 1), got (1.5, 0.9)",
        ),
    ],
    ids=["negative_lr", "string_lr", "nan_lr", "zero_eps", "adam_beta"],
)
def test_bad_optimizer_settings(make, message: str) -> None:
    with _raises(BuilderError, message):
        make()


def test_bad_learning_rate_set_during_training() -> None:
    emb = shard_embeddings(
        EmbeddingBagCollection(TABLES), mp.ManualParallelStrategy(), "auto", SGD(lr=0.1)
    )
    emb.fused_optimizer.lr = 0.05
    with _raises(BuilderError, "fused optimizer: lr must be a finite number >= 0, got inf"):
        emb.fused_optimizer.lr = float("inf")
    assert emb.fused_optimizer.lr == 0.05


def test_a_collection_converted_to_bfloat16_is_refused_not_silently_kept_float32() -> None:
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig("user", 8, 4), EmbeddingBagConfig("item", 8, 4)]
    ).to(torch.bfloat16)
    with pytest.raises(
        BuilderError,
        match=r"shard_embeddings\(\): table 'user' is torch.bfloat16 but its config says "
        r"torch.float32 \(tables: \['item', 'user'\]\); sharded tables hold rows in their "
        r"config's dtype, .* set EmbeddingBagConfig\(dtype=torch.float16 or torch.bfloat16\)",
    ):
        shard_embeddings(ebc, mp.ManualParallelStrategy(), plan="auto", rule=SGD(lr=0.1))


def test_an_unsupported_table_dtype_is_refused_with_the_supported_ones() -> None:
    with _raises(
        EmbeddingInputError,
        "table 'user': dtype torch.float64 is not supported; use one of torch.float32, "
        "torch.float16, torch.bfloat16",
    ):
        EmbeddingBagConfig("user", 8, 4, dtype=torch.float64)
