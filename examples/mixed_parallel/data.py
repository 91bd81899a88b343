"""Synthetic text: sequences of a fixed random second-order Markov chain over a small vocabulary.

Each pair of previous tokens (a, b) allows only a few next tokens, with fixed probabilities, and
the candidates are drawn at random per pair. The previous token alone says little about the next
one, so a model must attend to the token before it to beat the first-order entropy: the known
entropies (`Entropies`) show how much structure the model has found.

Batches are addressed by index: global batch `step` is drawn from a generator keyed by (seed,
step) and rank r takes its contiguous share, so the data does not depend on the world size and
a run resumed on another number of processes sees the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

NEXT_PROBS = (0.6, 0.25, 0.1, 0.05)  # the next-token distribution of every pair, over candidates
VALIDATION = 2**40  # validation batches start here, far from any training step


class Ranks(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


@dataclass(frozen=True)
class Entropies:
    """Reference losses in nats per token: what a model using k previous tokens can reach."""

    unigram: float  # no context: the stationary token frequencies
    first_order: float  # the previous token only
    rate: float  # the chain's entropy rate (both previous tokens): the best possible loss
    best: float  # the best mean loss over a sequence (its first target has one token of context)


class MarkovText:
    """Sequences of `seq_len + 1` tokens: inputs are [:-1], next-token targets [1:]."""

    def __init__(
        self,
        vocab: int = 16,
        seq_len: int = 64,
        *,
        batch_size: int = 48,
        eval_batch_size: int = 96,
        seed: int = 0,
    ) -> None:
        if vocab < len(NEXT_PROBS):
            raise ValueError(f"vocab must be at least {len(NEXT_PROBS)}, got {vocab}")
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        chain = torch.Generator().manual_seed(seed)
        candidates = torch.rand(vocab, vocab, vocab, generator=chain).argsort(-1)
        candidates = candidates[..., : len(NEXT_PROBS)]
        self.transition = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)  # [a, b, next]
        self.transition.scatter_(
            -1,
            candidates,
            torch.tensor(NEXT_PROBS, dtype=torch.float64).expand(vocab, vocab, -1).contiguous(),
        )
        self.pairs = self._stationary_pairs()  # [a, b]: probability of seeing a then b

    def _stationary_pairs(self) -> torch.Tensor:
        """The chain's stationary distribution over (a, b), by power iteration of the lazy chain
        (converges even if the chain is periodic)."""
        pairs = torch.full((self.vocab, self.vocab), 1.0 / self.vocab**2, dtype=torch.float64)
        for _ in range(2000):
            moved = torch.einsum("ab,abc->bc", pairs, self.transition)
            pairs = 0.5 * (pairs + moved)
        return pairs / pairs.sum()

    def entropies(self) -> Entropies:
        def h(p: torch.Tensor) -> torch.Tensor:
            return -(p * p.clamp_min(1e-300).log()).sum(-1)

        unigram = self.pairs.sum(0)
        first = (self.pairs.sum(0) * h(self.pairs / self.pairs.sum(1, keepdim=True))).sum()
        rate = (self.pairs * h(self.transition)).sum()
        best = (first + (self.seq_len - 1) * rate) / self.seq_len
        return Entropies(float(h(unigram)), float(first), float(rate), float(best))

    def sequences(self, index: int, size: int) -> torch.Tensor:
        """`size` sequences (size, seq_len + 1) of the batch keyed by (seed, index)."""
        generator = torch.Generator().manual_seed(self.seed * 2**42 + index)
        uniforms = torch.rand(size, self.seq_len + 1, generator=generator, dtype=torch.float64)
        start = _sample(
            self.pairs.flatten().cumsum(0).expand(size, -1).contiguous(), uniforms[:, :1]
        )
        tokens = torch.empty(size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0], tokens[:, 1] = start[:, 0] // self.vocab, start[:, 0] % self.vocab
        cdf = self.transition.cumsum(-1)
        for t in range(2, self.seq_len + 1):
            rows = cdf[tokens[:, t - 2], tokens[:, t - 1]]
            tokens[:, t] = _sample(rows, uniforms[:, t : t + 1])[:, 0]
        return tokens

    def _share(self, tokens: torch.Tensor, ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
        size = tokens.shape[0]
        if size % ranks.world_size:
            raise ValueError(
                f"batch size {size} is not a multiple of the world size {ranks.world_size}"
            )
        per_rank = size // ranks.world_size
        mine = tokens[ranks.rank * per_rank : (ranks.rank + 1) * per_rank]
        return mine[:, :-1], mine[:, 1:]

    def train(self, step: int, ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) of global training batch `step`."""
        return self._share(self.sequences(step, self.batch_size), ranks)

    def validation(self, index: int, ranks: Ranks) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the fixed evaluation batch `index` (0 is the one reported)."""
        return self._share(self.sequences(VALIDATION + index, self.eval_batch_size), ranks)


def _sample(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, row by row (right=True never picks a zero-probability token)."""
    return torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp_max(cdf.shape[-1] - 1)
