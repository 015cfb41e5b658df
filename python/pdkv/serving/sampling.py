"""Sampling parameters and token selection (greedy, temperature, top-p).

Random draws are keyed by ``(seed, output index)``: the token a request samples at
output position ``i`` depends only on its logits, its seed and ``i``, not on which
engine sampled the earlier tokens. So a request prefilled on one worker and decoded
on another (or preempted and recomputed) samples exactly what it would have sampled
in one engine, given the same seed.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import torch

from pdkv.errors import InvalidArgument

from .protocol import GenParams

__all__ = ["SamplingParams", "sample_tokens"]

_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams(GenParams):
    """How a request picks tokens and when it stops: the wire form's fields
    (:class:`~pdkv.serving.protocol.GenParams`), validated.

    Attributes
    ----------
    max_tokens : int
        Most tokens to generate (>= 1), the stop token included.
    temperature : float
        0 picks the most likely token (greedy, what ``generate(do_sample=False)``
        does); > 0 samples from ``softmax(logits / temperature)``.
    top_p : float
        Nucleus sampling: sample among the most likely tokens whose probabilities
        add up to at least ``top_p`` (0 < top_p <= 1; 1 disables it).
    seed : int, optional
        Seed of the request's random draws (default: a random one, see
        :attr:`RequestHandle.seed`). Ignored when greedy.
    stop_token_ids : tuple of int
        Tokens that end the request (in addition to the model's EOS); the stop token
        is the last output token.
    ignore_eos : bool
        Do not stop at the model's EOS tokens.
    index_offset : int
        Output position of the first token (>= 0): a request continued after ``n``
        tokens (a migrated stream, prompt = original prompt + those tokens) passes
        ``n`` so that its random draws are those of the uninterrupted request.
    """

    @classmethod
    def of(cls, params: GenParams) -> "SamplingParams":
        """The engine's form of wire parameters (validated: raises InvalidArgument)."""
        return cls(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                   seed=params.seed, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                   index_offset=params.index_offset)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidArgument(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.index_offset, int) or self.index_offset < 0:
            raise InvalidArgument(f"index_offset must be an integer >= 0, got {self.index_offset!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def new_seed() -> int:
    """A fresh random 63-bit seed."""
    return secrets.randbits(63)


def _draw_seed(seed: int, index: int) -> int:
    # splitmix64-style mix so that nearby (seed, index) pairs give unrelated streams.
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                  indices: Sequence[int]) -> list[int]:
    """Picks one token per row of ``logits``.

    Parameters
    ----------
    logits : torch.Tensor
        ``[N, vocab]``, any float dtype, any device.
    params : sequence of SamplingParams
        ``N`` entries, one per row.
    seeds, indices : sequence of int
        Per row: the request's seed and the output position being sampled.

    Returns
    -------
    list of int
        ``N`` token ids.
    """
    n = logits.shape[0]
    if not (len(params) == len(seeds) == len(indices) == n):
        raise InvalidArgument(f"{n} logits rows but {len(params)} params, {len(seeds)} seeds, "
                              f"{len(indices)} indices")
    # Greedy rows: argmax over the model's own logits (float32 like generate(); the
    # cast is exact, so ties break the same way).
    greedy = torch.argmax(logits.float(), dim=-1).tolist()
    out: list[int] = []
    for row, (p, seed, idx) in enumerate(zip(params, seeds, indices)):
        if p.greedy:
            out.append(int(greedy[row]))
            continue
        probs = torch.softmax(logits[row].float() / p.temperature, dim=-1)
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(_draw_seed(seed, idx))
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < p.top_p  # always keeps the first
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            choice = torch.multinomial(sorted_p, 1, generator=gen)
            out.append(int(order[choice]))
        else:
            out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
