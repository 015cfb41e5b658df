"""What the engine accepts: a request's prompt, token ids and sampling parameters
checked against the vocabulary, the model's positions and the KV pool, before it
queues or reserves anything (see :mod:`pdkv.serving.engine`)."""

from __future__ import annotations

from typing import Any, Sequence

from pdkv.errors import InvalidArgument

from .kv_pool import PagedKVPool
from .sampling import SamplingParams

__all__ = ["RequestChecks", "eos_ids"]


class RequestChecks:
    """Checks requests for one model and pool.

    Parameters
    ----------
    vocab_size : int
    max_model_len : int
        Longest prompt + output.
    pool : PagedKVPool
    """

    def __init__(self, vocab_size: int, max_model_len: int, pool: PagedKVPool) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.pool = pool

    def prompt(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
               prefill_only: bool) -> tuple[int, ...]:
        """The prompt as a tuple of ints, after checking the request (see
        :meth:`~pdkv.serving.engine.Engine.add_request`).

        Raises
        ------
        InvalidArgument
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise InvalidArgument(f"request {request_id!r} has an empty prompt")
        for t in prompt:
            self.token(t)
        total = len(prompt) + (0 if prefill_only else params.max_tokens)
        if total > self.max_model_len:
            raise InvalidArgument(f"request {request_id!r}: prompt ({len(prompt)}) + max_tokens "
                                  f"({params.max_tokens}) exceeds the model's {self.max_model_len} positions")
        # The last sampled token never needs KV.
        kv_tokens = len(prompt) if prefill_only else len(prompt) + params.max_tokens - 1
        if kv_tokens > self.pool.capacity_tokens:
            raise InvalidArgument(f"request {request_id!r} needs KV for up to {kv_tokens} tokens but the pool "
                                  f"holds {self.pool.capacity_tokens} ({self.pool.num_blocks} blocks of "
                                  f"{self.pool.block_tokens})")
        return prompt

    def token(self, t: int) -> None:
        """Raises InvalidArgument unless ``t`` is in the vocabulary."""
        if not 0 <= int(t) < self.vocab_size:
            raise InvalidArgument(f"token id {t} is outside the vocabulary [0, {self.vocab_size})")


def eos_ids(model: Any) -> tuple[int, ...]:
    """The model's EOS tokens: ``generation_config.eos_token_id``, else ``config.eos_token_id``."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))
