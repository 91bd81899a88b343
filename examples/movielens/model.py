"""A SASRec-style next-item model: a causal transformer over a user's last 50 items.

- the item table: an `EmbeddingCollection` sharded over the ranks (row-wise by default, or
  planned), trained by its fused Adam inside backward; its feature "history" looks up the
  items a user saw, its feature "catalog" every item once per step, so the loss is a softmax
  over ALL items (as RecBole's SASRec with loss_type="CE") whose gradient reaches every row
  through the lookup;
- the encoder (positions, a 2-layer post-norm transformer, 2 heads, GELU): replicated with
  `ddp` or sharded with `fsdp`, trained by a plain torch Adam;
- evaluation scores each user against every item without gathering the table
  (`target_ranks`: each rank scores its own rows) and ranks the target, ties by item id.

Hyper-parameters and init follow RecBole's SASRec defaults: hidden size 64, inner size 256,
dropout 0.5 (hidden and attention; none inside the feed-forward block), layer norm eps 1e-12,
every weight, the item rows included, drawn from normal(0, 0.02).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from protocol import MAX_HISTORY
from torch import nn

import manualpar as mp
from manualpar.embeddings import (
    Adam,
    EmbeddingCollection,
    EmbeddingConfig,
    ShardedEmbeddingCollection,
    SparseFeatures,
    row_wise,
    shard_embeddings,
    target_ranks,
)


@dataclass
class Histories:
    """A batch of users: item ids (batch, MAX_HISTORY) left-aligned, -1 after each history;
    `targets` (batch, MAX_HISTORY) the next item at every position (-1: none), or `target`
    (batch,) one target per user for evaluation."""

    items: torch.Tensor
    targets: torch.Tensor | None = None
    target: torch.Tensor | None = None
    features: SparseFeatures | None = None  # the lookup's input, built once (SASRec.features)

    def __len__(self) -> int:
        return len(self.items)


class Encoder(nn.Module):
    """Item rows plus positions through a causal post-norm transformer."""

    def __init__(self, dim: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.positions = nn.Embedding(MAX_HISTORY, dim)
        self.norm = nn.LayerNorm(dim, eps=1e-12)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout, activation="gelu", batch_first=True, layer_norm_eps=1e-12
        )
        # RecBole's feed-forward block drops out only its output; torch's layer also drops out
        # its inner activations at the same rate (RECBOLE_PROTOCOL.md, (i))
        layer.dropout = nn.Identity()  # type: ignore[assignment]  # (torch types it Dropout)
        self.transformer = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """RecBole's SASRec init: every linear and embedding weight normal(0, 0.02), biases 0,
        layer norms 1 and 0; from `seed`, the same on every rank. It matters: with torch's
        default init the model reached validation NDCG@10 0.023 after 8 epochs, with this one
        0.055 (one process, the same batches)."""
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0, 0.02, generator=generator)
            if isinstance(module, nn.MultiheadAttention):
                assert module.in_proj_weight is not None
                module.in_proj_weight.normal_(0, 0.02, generator=generator)
            for name, value in module.named_parameters(recurse=False):
                if name.endswith("bias"):
                    value.zero_()
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1)

    def forward(self, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(batch, length, dim) outputs; position t attends to positions <= t of its user."""
        length = rows.shape[1]
        x = rows + self.positions(torch.arange(length, device=rows.device))
        x = self.dropout(self.norm(x))
        # both masks bool, True = may not attend (torch's convention; `mask` is True at items)
        causal = torch.ones(length, length, dtype=torch.bool, device=rows.device).triu(1)
        return self.transformer(x, mask=causal, src_key_padding_mask=~mask, is_causal=True)


def _attention_init(module: nn.Module) -> bool:
    """torch's own init of attention projections (MultiheadAttention has no public
    reset_parameters); every other layer keeps torch's default init."""
    if isinstance(module, nn.MultiheadAttention):
        module._reset_parameters()
        return True
    return False


class SASRec(mp.ParallelModule):
    def __init__(
        self,
        num_items: int,
        *,
        dim: int = 64,
        layers: int = 2,
        heads: int = 2,
        dropout: float = 0.5,
        lr: float = 1e-3,
        dense: str = "ddp",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.num_items, self.dim, self.lr, self.dense, self.seed = num_items, dim, lr, dense, seed
        # drawn uniform here, normal(0, 0.02) as RecBole's once sharded (setup)
        table = EmbeddingConfig(
            "item", num_items, dim, feature_names=("history", "catalog"), init_bound=0.02 * 3**0.5
        )
        # (sharded and wrapped in setup)
        self.items: EmbeddingCollection | ShardedEmbeddingCollection = EmbeddingCollection(
            [table], seed=seed
        )
        self.encoder: nn.Module = Encoder(dim, layers, heads, dropout)
        self.ranking = mp.metrics.RankingMetrics(ks=(10, 20))  # exact over every rank's users

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        assert isinstance(self.items, EmbeddingCollection)  # (setup runs once)
        self.items = shard_embeddings(
            self.items, strategy, plan={"item": row_wise()}, rule=Adam(lr=self.lr)
        )
        self._init_item_rows()
        mp.materialize(self, strategy, seed=self.seed, init_fn=_attention_init)
        encoder = self.encoder
        assert isinstance(encoder, Encoder)
        encoder.init_weights(self.seed)  # whole on every rank, then replicated or sharded
        wrap = mp.fsdp if self.dense == "fsdp" else mp.ddp
        self.encoder = wrap(encoder, strategy)

    @torch.no_grad()
    def _init_item_rows(self) -> None:
        """RecBole's item rows: normal(0, 0.02) from the seed, the same whole table on every
        rank, each rank keeping its own rows (a table's init is uniform only)."""
        generator = torch.Generator().manual_seed(self.seed)
        rows = torch.empty(self.num_items, self.dim).normal_(0, 0.02, generator=generator)
        self.items.load_state_dict({"tables.item.weight": rows}, strict=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=self.lr)

    # ---- the model -----------------------------------------------------------------------------
    def features(self, batch: Histories, catalog: bool) -> SparseFeatures:
        """The item table's input for `batch` (kept on the batch: the object prefetch sends
        ahead is the object forward looks up): the histories, and every item if `catalog`."""
        if batch.features is None:
            real = batch.items >= 0
            every = torch.arange(self.num_items) if catalog else torch.zeros(0, dtype=torch.int64)
            catalog_lengths = torch.zeros(len(batch), dtype=torch.int64)
            if len(batch) and catalog:
                catalog_lengths[0] = self.num_items  # the whole catalog in the first sample's bag
            batch.features = SparseFeatures(
                ("history", "catalog"),
                torch.cat([batch.items[real], every]),
                torch.cat([real.sum(1), catalog_lengths]),
            )
        return batch.features

    def prefetch(self, batch: Histories) -> None:
        """The next training batch's ids start travelling now: the Trainer calls this before
        each step (TrainPipeline; the numbers are those of an unpipelined step)."""
        assert isinstance(self.items, ShardedEmbeddingCollection)  # (after setup)
        self.items.prefetch(self.features(batch, catalog=True))

    def encode(self, batch: Histories, catalog: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(batch, MAX_HISTORY, dim) outputs, and every item's row if `catalog`."""
        looked_up = self.items(self.features(batch, catalog))
        rows, mask = looked_up["history"].to_padded(MAX_HISTORY)
        out = self.encoder(rows, mask)
        return out, looked_up["catalog"].values if catalog else None

    def training_step(self, batch: Histories, step: int) -> dict[str, torch.Tensor]:
        """Cross-entropy over every item at every position that has a next item."""
        assert batch.targets is not None
        out, catalog = self.encode(batch, catalog=True)
        assert catalog is not None
        has_target = batch.targets >= 0
        logits = out[has_target] @ catalog.T
        return {"loss": F.cross_entropy(logits, batch.targets[has_target])}

    @torch.no_grad()
    def user_vectors(self, batch: Histories) -> torch.Tensor:
        """Each user's output at their last item: what scores the next one."""
        out, _ = self.encode(batch, catalog=False)
        last = (batch.items >= 0).sum(1) - 1
        return out[torch.arange(len(batch)), last.clamp(min=0)]

    @torch.no_grad()
    def ranks(self, batch: Histories) -> torch.Tensor:
        """The 1-based rank of each user's target among all items (ties: smaller id first)."""
        assert batch.target is not None
        return target_ranks(self.items, "item", self.user_vectors(batch), batch.target)

    def validation_step(self, batch: Histories) -> dict[str, object]:
        """Ranks this batch's targets; the Trainer computes the metrics over every rank's
        users once the pass is over (HR, NDCG, MRR at 10 and 20)."""
        self.ranking.update(self.ranks(batch))
        return {"ranking": self.ranking}
