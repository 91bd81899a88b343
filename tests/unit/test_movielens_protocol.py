"""The MovieLens ratings reader (manualpar.data) and the example's split: every GroupLens layout
reads to the same ratings, and the split is RecBole's leave-one-out by time (ties in file order,
nothing filtered, histories of 50)."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from example_modules import load_example

import manualpar as mp
from manualpar import DataFileError
from manualpar.data import movielens as ratings

protocol = load_example(Path("movielens/protocol.py"), "ml_protocol")

# (user, item, rating, time) in file order; user 7's items 30 and 31 share a timestamp
ROWS = [
    ("7", "30", "4", 100),
    ("9", "11", "3", 50),
    ("7", "31", "5", 100),
    ("7", "12", "1", 90),
    ("9", "30", "2", 40),
    ("7", "11", "2", 120),
    ("9", "12", "5", 60),
]


def _write_every_layout(directory: Path) -> list[Path]:
    inter = directory / "ml.inter"
    inter.write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ROWS)
    )
    u_data = directory / "u.data"
    u_data.write_text("".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ROWS))
    dat = directory / "ratings.dat"
    dat.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in ROWS))
    csv = directory / "ratings.csv"
    csv.write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r},{t}\n" for u, i, r, t in ROWS)
    )
    return [inter, u_data, dat, csv]


def test_every_layout_reads_the_same_ratings_in_file_order(tmp_path: Path) -> None:
    for path in _write_every_layout(tmp_path):
        read = ratings.read_ratings(path)
        assert read.users == [u for u, _, _, _ in ROWS], path
        assert read.items == [i for _, i, _, _ in ROWS], path
        assert read.timestamps == [float(t) for _, _, _, t in ROWS], path


def test_a_bad_line_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "u.data"
    path.write_text("1\t2\t3\t4\n1\t2\n")
    with pytest.raises(DataFileError, match=r"u\.data, line 2: cannot read '1\\t2'"):
        ratings.read_ratings(path)


def test_sequences_sort_by_time_keeping_file_order_for_ties(tmp_path: Path) -> None:
    sequences = protocol.user_sequences(ratings.read_ratings(_write_every_layout(tmp_path)[1]))
    # item ids by first appearance: 30 -> 0, 11 -> 1, 31 -> 2, 12 -> 3
    assert sequences.item_tokens == ["30", "11", "31", "12"]
    # user 7: 12 (90), 30 (100), 31 (100, after 30 in the file), 11 (120); user 9: 30, 11, 12
    assert sequences.items == [[3, 0, 2, 1], [0, 1, 3]]


def test_times_tie_as_recbole_rounds_them() -> None:
    """RecBole sorts by the timestamp scaled to [0, 1] and stored as float32: over ml-100k's
    range (18,561,928 s) a float32 step near 1 is about 1.1 s, so some timestamps a second
    apart tie and keep file order."""
    read = ratings.Ratings(
        users=["1", "1", "1", "1"],
        items=["a", "b", "c", "d"],
        timestamps=[874_724_710.0, 893_000_005.0, 893_000_004.0, 893_286_638.0],
        source="memory",
    )
    assert protocol.user_sequences(read).items == [[0, 1, 2, 3]]  # b before c: a tie
    raw = sorted(range(4), key=lambda i: read.timestamps[i])
    assert raw == [0, 2, 1, 3]  # what a sort by the raw timestamps would give


def test_leave_one_out_targets_and_histories() -> None:
    long_user = list(range(60))
    split = protocol.leave_one_out(protocol.Sequences([[3, 0, 2, 1], long_user], ["a"] * 60))
    assert split.train == [[3, 0], long_user[:58]]
    assert split.valid.targets.tolist() == [2, 58]
    assert split.test.targets.tolist() == [1, 59]
    # the test history holds the validation item; at most the last 50 items, -1 after
    assert split.test.histories[0, :4].tolist() == [3, 0, 2, -1]
    assert split.test.lengths.tolist() == [3, 50]
    assert split.test.histories[1].tolist() == long_user[9:59]
    assert split.valid.histories[1].tolist() == long_user[8:58]


def test_training_windows_hold_every_training_target_once() -> None:
    train = [list(range(100, 103)), list(range(120))]
    windows = protocol.training_windows(train)
    targets: list[int] = []
    for window in windows:
        items = window[window >= 0]
        assert 2 <= len(items) <= protocol.MAX_HISTORY + 1
        targets += items[1:].tolist()
    expected = [t for items in train for t in items[1:]]
    assert sorted(targets) == sorted(expected)
    # the last window of a long history ends at its last item and sees 50 items before it
    assert torch.equal(windows[1], torch.arange(69, 120))


def test_prefix_samples_are_recboles_training_samples() -> None:
    """RecBole's recipe: one sample per training target after a user's first item (targets
    s[1..n-3] of a user with n items), the history the up to 50 items before it."""
    long_user = list(range(100, 160))  # 60 items: 57 training targets, histories cut at 50
    split = protocol.leave_one_out(
        protocol.Sequences([[3, 0, 2, 1], [5, 6, 7], long_user], ["a"] * 160)
    )
    samples = protocol.prefix_samples(split.train)
    width = protocol.MAX_HISTORY
    assert samples.shape == (1 + 0 + 57, width + 1)
    got = [(row[:width][row[:width] >= 0].tolist(), int(row[width])) for row in samples]
    assert got[0] == ([3], 0)  # the 4-item user: one sample; the 3-item user: none
    assert got[1:] == [(long_user[max(0, j - width) : j], long_user[j]) for j in range(1, 58)]
    assert got[50] == (long_user[0:50], long_user[50])
    assert got[57] == (long_user[7:57], long_user[57])  # the last: s[n-3], 50 items before
    assert all(
        row[len(history) : width].eq(-1).all()
        for row, (history, _) in zip(samples, got, strict=True)
    )


def test_prefix_batches_put_each_target_at_its_history_end_only() -> None:
    model = load_example(Path("movielens/model.py"), "ml_model", {"protocol": protocol})
    batches = load_example(
        Path("movielens/batches.py"), "ml_batches", {"protocol": protocol, "model": model}
    )
    samples = protocol.prefix_samples([[4, 8, 15, 16, 23, 42], [7, 9]])
    data = batches.prefix_batches(samples, global_batch=6, seed=0)
    batch = data(0, SimpleNamespace(rank=0, world_size=1))
    width = protocol.MAX_HISTORY
    pairs = []
    for items, targets in zip(batch.items, batch.targets, strict=True):
        length = int((items >= 0).sum())
        assert targets.ne(-1).nonzero().flatten().tolist() == [length - 1]
        pairs.append((items[:length].tolist(), int(targets[length - 1])))
    expected = [(row[:width][row[:width] >= 0].tolist(), int(row[width])) for row in samples]
    assert sorted(pairs) == sorted(expected)  # the epoch's shuffle, every sample once


def _encoder(dropout: float) -> torch.nn.Module:
    model = load_example(Path("movielens/model.py"), "ml_model", {"protocol": protocol})
    encoder = model.Encoder(dim=8, layers=2, heads=2, dropout=dropout)
    encoder.init_weights(seed=3)
    return encoder


def test_the_feed_forward_block_drops_out_only_its_output_as_recboles() -> None:
    """RecBole's FeedForward is dense_2(gelu(dense_1(x))), dropout after it only; torch's
    encoder layer also drops out the inner activations. In training, what reaches each layer's
    second linear must be exactly gelu of the first's output."""
    encoder = _encoder(dropout=0.5).train()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in encoder.transformer.layers:
        inner: dict[str, torch.Tensor] = {}
        layer.linear1.register_forward_hook(lambda m, a, out, inner=inner: inner.update(h=out))
        layer.linear2.register_forward_hook(
            lambda m, args, out, inner=inner: seen.append((inner["h"], args[0]))
        )
    torch.manual_seed(0)
    encoder(torch.randn(4, protocol.MAX_HISTORY, 8), torch.ones(4, protocol.MAX_HISTORY).bool())
    assert len(seen) == 2
    for linear1_out, linear2_in in seen:
        assert torch.equal(linear2_in, F.gelu(linear1_out))


def test_the_encoder_computes_recboles_sasrec_layers() -> None:
    """In evaluation, the encoder equals RecBole 1.2.1's SASRec written out (layers.py:
    LayerNorm(items + positions); per layer, scaled dot-product attention with -10000 at padded
    and later keys, LayerNorm(dense(context) + x), LayerNorm(dense_2(gelu(dense_1(x))) + x)),
    in float64, at every position that holds an item."""
    encoder = _encoder(dropout=0.5).double().eval()
    length, dim, heads = protocol.MAX_HISTORY, 8, 2
    rows = torch.randn(
        3, length, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    mask = torch.arange(length) < torch.tensor([[50], [7], [1]])
    x = F.layer_norm(
        rows + encoder.positions.weight, (dim,), encoder.norm.weight, encoder.norm.bias, 1e-12
    )
    allowed = mask[:, None, None, :] & torch.ones(length, length, dtype=torch.bool).tril()
    additive = torch.where(allowed, 0.0, -10000.0).double()
    for layer in encoder.transformer.layers:
        attention = layer.self_attn
        q, k, v = F.linear(x, attention.in_proj_weight, attention.in_proj_bias).chunk(3, dim=-1)
        split = lambda t: t.view(3, length, heads, dim // heads).transpose(1, 2)  # noqa: E731
        scores = split(q) @ split(k).transpose(-1, -2) / (dim // heads) ** 0.5 + additive
        context = (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(3, length, dim)
        x = layer.norm1(attention.out_proj(context) + x)
        x = layer.norm2(layer.linear2(F.gelu(layer.linear1(x))) + x)
    with torch.no_grad():
        out = encoder(rows, mask)
    torch.testing.assert_close(out[mask], x[mask], rtol=0, atol=1e-10)


def test_the_item_rows_start_normal_with_recboles_std() -> None:
    """RecBole draws every item row from normal(0, 0.02); the example loads such a table, drawn
    from its seed, into the sharded collection (whose own init is uniform)."""
    model = load_example(Path("movielens/model.py"), "ml_model", {"protocol": protocol})
    strategy = mp.ManualParallelStrategy()
    try:
        with mp.empty_init():
            sasrec = model.SASRec(300, seed=5)
        sasrec.setup(strategy)
        with mp.full_tensors():
            rows = sasrec.items.state_dict()["tables.item.weight"]
    finally:
        strategy.teardown()
    generator = torch.Generator().manual_seed(5)
    assert torch.equal(rows, torch.empty(300, 64).normal_(0, 0.02, generator=generator))


@pytest.mark.parametrize(
    ("recipe", "batch", "patience"), [("windows", 32, 20), ("recbole", 2048, 11)]
)
def test_each_recipe_has_its_batch_and_patience(
    recipe: str, batch: int, patience: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A windows epoch is 75 steps: 10 epochs of patience stopped a seed before its best."""
    model = load_example(Path("movielens/model.py"), "ml_model", {"protocol": protocol})
    batches = load_example(
        Path("movielens/batches.py"), "ml_batches", {"protocol": protocol, "model": model}
    )
    siblings = {"protocol": protocol, "model": model, "batches": batches}
    train = load_example(Path("movielens/train.py"), "ml_train", siblings)
    monkeypatch.setattr("sys.argv", ["train.py", "--recipe", recipe])
    args = train.parse_args()
    assert (args.batch, args.patience) == (batch, patience)


def test_recbole_recipe_steps_as_one_dense_adam_over_table_and_encoder() -> None:
    """RecBole's SASRec trains its item table and encoder with one torch Adam. The example's
    step (the table's fused Adam inside backward, every row looked up by the catalog; the
    encoder's torch Adam) equals that on a plain copy for 5 steps of prefix batches. (The table
    adds eps as torch's SparseAdam does, before the bias correction; at these gradients, as on
    ml-100k, that moves no weight by 1e-6.)"""
    model = load_example(Path("movielens/model.py"), "ml_model", {"protocol": protocol})
    batches = load_example(
        Path("movielens/batches.py"), "ml_batches", {"protocol": protocol, "model": model}
    )
    generator = torch.Generator().manual_seed(1)
    users = [torch.randint(0, 30, (n,), generator=generator).tolist() for n in (60, 9, 4, 25)]
    data = batches.prefix_batches(protocol.prefix_samples(users), global_batch=16, seed=0)
    strategy = mp.ManualParallelStrategy()
    try:
        with mp.empty_init():
            sasrec = model.SASRec(30, dim=8, dropout=0.0, seed=2)
        sasrec.setup(strategy)
        ours = getattr(sasrec.encoder, "module", sasrec.encoder)  # (ddp on 1 rank: the module)
        encoder = copy.deepcopy(ours)
        with mp.full_tensors():
            start = sasrec.items.state_dict()["tables.item.weight"].clone()
        table = start.clone().requires_grad_()
        dense = sasrec.configure_optimizers()
        recboles = torch.optim.Adam([table, *encoder.parameters()], lr=1e-3)
        for step in range(5):
            batch = data(step, strategy)
            dense.zero_grad()
            sasrec.training_step(batch, step)["loss"].backward()  # the table steps here
            dense.step()
            real, has_target = batch.items >= 0, batch.targets >= 0
            out = encoder(table[batch.items.clamp(min=0)] * real[..., None], real)
            recboles.zero_grad()
            F.cross_entropy(out[has_target] @ table.T, batch.targets[has_target]).backward()
            recboles.step()
        with mp.full_tensors():
            rows = sasrec.items.state_dict()["tables.item.weight"]
    finally:
        strategy.teardown()
    assert (rows - start).abs().max() > 4e-3  # (Adam moves a row by about 1e-3 a step)
    torch.testing.assert_close(rows, table.detach(), rtol=0, atol=1e-6)
    for mine, theirs in zip(ours.parameters(), encoder.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
