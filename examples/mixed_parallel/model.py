"""A small causal transformer language model: FSDP-sharded blocks between DDP embedding and head.

Declared on the meta device (`with mp.empty_init(): model = TinyLM(...)`), nothing is allocated
until `setup(strategy)`: fsdp() shards the transformer blocks (each rank allocates and
initializes only its shards, with the values the unsharded blocks would have), materialize()
allocates the token/position embedding and the final norm + head, and ddp() wraps those two. The
blocks hold almost all parameters, so they are what is worth sharding; the embedding and head
are small and replicated, with their gradients all-reduced by DDP.

`mesh="hsdp"` shards the blocks over pairs of ranks and replicates them across the pairs (HSDP on
`strategy.mesh(replicate=W/2, shard=2)`). `mesh="fsdp-tp"` adds tensor parallel: each block's MLP
is split over pairs of ranks (colwise then rowwise, one all-reduce per MLP) and fsdp shards the
blocks over the other dim of `strategy.mesh(dp=W/2, tp=2)`; the two ranks of a tp pair read the
same batch (`data_ranks`), and the embedding and head are averaged by DDP over the dp dim only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

import manualpar as mp

MESHES = ("flat", "hsdp", "fsdp-tp")


@dataclass(frozen=True)
class DataRanks:
    """Which share of each global batch a rank reads: its data-parallel index and count."""

    rank: int
    world_size: int


class Attention(nn.Module):
    """Causal multi-head self-attention (torch's fused scaled_dot_product_attention)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h d) -> three b h t d", three=3, h=self.heads)
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(rearrange(mixed, "b h t d -> b t (h d)"))


class Block(nn.Module):
    """Pre-norm transformer block; each one is its own FSDP unit (gathered one at a time)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, width: int, max_len: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(max_len, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token(tokens) + rearrange(self.position(positions), "t d -> 1 t d")


class TinyLM(mp.ParallelModule):
    """Next-token model: Embedding (ddp) -> Blocks (fsdp) -> LayerNorm + Linear head (ddp)."""

    def __init__(
        self,
        vocab: int,
        *,
        width: int = 64,
        depth: int = 4,
        heads: int = 4,
        max_len: int = 64,
        lr: float = 3e-3,
        seed: int = 0,
        mesh: str = "flat",
    ) -> None:
        super().__init__()
        if mesh not in MESHES:
            raise ValueError(f"mesh must be one of {MESHES}, got {mesh!r}")
        self.lr, self.seed, self.mesh = lr, seed, mesh
        self.data_ranks = DataRanks(0, 1)
        # (sharded and wrapped in setup)
        self.embed: nn.Module = Embedding(vocab, width, max_len)
        self.blocks: nn.Module = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        self.head: nn.Module = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))

    def setup(self, strategy: mp.ManualParallelStrategy) -> None:
        self.data_ranks = DataRanks(strategy.rank, strategy.world_size)
        pairs = 2 if strategy.world_size % 2 == 0 else 1
        dp = None
        if self.mesh == "flat":
            self.blocks = mp.fsdp(self.blocks, strategy, wrap=(Block,))  # only this rank's shards
        elif self.mesh == "hsdp":
            hsdp = strategy.mesh(replicate=strategy.world_size // pairs, shard=pairs)
            self.blocks = mp.fsdp(self.blocks, strategy, wrap=(Block,), mesh=hsdp)
        else:
            mesh = strategy.mesh(dp=strategy.world_size // pairs, tp=pairs)
            plan: dict[str, str] = {}
            for i, _ in enumerate(self.blocks.children()):
                plan |= {f"{i}.mlp.0": "colwise", f"{i}.mlp.2": "rowwise"}
            mp.tp(self.blocks, strategy, mesh=mesh["tp"], plan=plan)
            self.blocks = mp.fsdp(self.blocks, strategy, wrap=(Block,), mesh=mesh["dp"])
            dp = mesh["dp"]
            self.data_ranks = DataRanks(strategy.group_rank(dp), strategy.group_size(dp))
        mp.materialize(self, strategy, seed=self.seed)  # embed + head, equal on every rank
        self.embed = mp.ddp(self.embed, strategy, mesh=dp)
        self.head = mp.ddp(self.head, strategy, mesh=dp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, time, vocab) for the next token at every position."""
        return self.head(self.blocks(self.embed(tokens)))

    def losses(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Per-token cross-entropy (batch * time,)."""
        inputs, targets = (t.to(self._device()) for t in batch)
        logits = rearrange(self(inputs), "b t v -> (b t) v")
        return F.cross_entropy(logits, rearrange(targets, "b t -> (b t)"), reduction="none")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
        return self.losses(batch).mean()

    @torch.no_grad()
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        """Mean loss over the whole global batch: every rank's token losses summed, so the value
        does not depend on how the batch was split over ranks (tp pairs count theirs twice, in
        the sum and in the count alike)."""
        assert self.strategy is not None
        losses = self.losses(batch).double()
        totals = self.strategy.all_reduce(
            torch.stack(
                [
                    losses.sum(),
                    torch.tensor(float(losses.numel()), dtype=torch.float64, device=losses.device),
                ]
            ),
            op="sum",
        )
        return {"loss": float(totals[0] / totals[1])}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.dense_parameters(), lr=self.lr)

    def _device(self) -> torch.device:
        return self.strategy.device if self.strategy is not None else torch.device("cpu")
