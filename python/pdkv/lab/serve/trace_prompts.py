"""Prompt content of trace requests, a pure function of ``(seed, request index)``.

:func:`token_prompt` gives token ids of the exact length (``/v1/completions`` takes a
list of ids as ``prompt``), :func:`text_prompt` gives text of about that many tokens
for servers that only accept text, such as ``/v1/chat/completions``.
"""

from __future__ import annotations

from typing import List, Union

from pdkv.lab.serve.trace_rng import STREAM_PROMPT_CONTENT, stream_rng

__all__ = ["Prompt", "text_prompt", "token_prompt"]

Prompt = Union[str, List[int]]

# Short, frequent English words: with a leading space, most are a single token in
# common BPE vocabularies (GPT-2, Llama, Mistral, Qwen, SmolLM).
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be has had "
    "not but he one or all their new first two its they time after there been who more year also may "
    "over other most some made when many about city can used would out state only world then her into "
    "during she these like such school known under being family work film about part around team since "
    "while both same three well through life later high left music early main game name place back "
    "house north south east west day group each very where last found small large number between what "
    "water light night river great long good old best land road book war line end power"
).split()


def token_prompt(
    length: int, *, seed: int = 0, index: int = 0, vocab_size: int = 1000, first_id: int = 100
) -> List[int]:
    """Deterministic token ids, exactly ``length`` of them.

    Parameters
    ----------
    length : int
        Number of ids, >= 0.
    seed, index : int
        Content key: the same ``(seed, index)`` gives the same ids; different indices
        give different prompts (no shared prefix for a prefix cache to exploit).
    vocab_size, first_id : int
        Ids are uniform on ``[first_id, vocab_size)``. The defaults are valid and
        avoid special tokens in every common vocabulary (ids 100..999).

    Returns
    -------
    list of int
    """
    if not 0 <= first_id < vocab_size:
        raise ValueError(f"need 0 <= first_id < vocab_size, got {first_id}, {vocab_size}")
    rng = stream_rng(seed, STREAM_PROMPT_CONTENT, index)
    return rng.integers(first_id, vocab_size, size=length).tolist()


def text_prompt(length: int, *, seed: int = 0, index: int = 0) -> str:
    """Deterministic English-like text of about ``length`` tokens.

    ``length`` space-separated common words; most tokenizers give one token per word,
    so the prompt is usually close to ``length`` tokens (the server's
    ``usage.prompt_tokens`` reports the exact count).

    Parameters
    ----------
    length : int
        Number of words, >= 0.
    seed, index : int
        Content key, as in :func:`token_prompt`.

    Returns
    -------
    str
    """
    rng = stream_rng(seed, STREAM_PROMPT_CONTENT, index)
    picks = rng.integers(0, len(_WORDS), size=length)
    return " ".join(_WORDS[i] for i in picks)
