"""Block hashes for prefix caching (torch-free): one id per *full* block of a token
sequence, chained over every token before it.

Block ``i`` of a sequence covers tokens ``[i * block_tokens, (i + 1) * block_tokens)``.
Its hash is BLAKE2b (8 bytes) over the previous block's hash and block ``i``'s token
ids, so two sequences share block ``i``'s hash only if they agree on *every* token up
to the end of block ``i`` -- which is exactly when block ``i``'s K/V are equal (a
causal model's K/V at a position depend on the tokens up to it and nothing after).
Block 0 chains from the *salt*: the model, its KV geometry and dtype (and an adapter,
if any), so that KV of different models, block sizes or dtypes never match
(:func:`cache_salt`). A trailing partial block has no hash: it is never cached.

Hashes are 16 lowercase hex digits: what the engine's prefix cache keys its blocks by,
what workers publish in their KV events and what the proxy's fleet index maps to
workers.

Examples
--------
>>> salt = cache_salt("tiny", block_tokens=4, dtype="float32")
>>> a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, salt)
>>> len(a), len(a[0])                         # two full blocks; token 9 is not cached
(2, 16)
>>> b = block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4, salt)
>>> a[0] == b[0], a[1] == b[1]                # shared first block, different second
(True, False)
>>> block_hashes([5, 6, 7, 8], 4, salt, parent=a[0]) == a[1:]   # continue a chain
True
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

from pdkv.errors import InvalidArgument

__all__ = ["HASH_CHARS", "block_hashes", "cache_salt", "is_block_hash"]

#: Characters of a block hash (hex of 8 bytes).
HASH_CHARS = 16

_HEX = frozenset("0123456789abcdef")


def cache_salt(model: str, *, block_tokens: int, dtype: str, adapter: str = "", extra: str = "") -> str:
    """The salt block 0 chains from: KV of two workers can be shared only if their salts
    are equal.

    Parameters
    ----------
    model : str
        What identifies the weights (a model name plus a digest of its config, or a path).
    block_tokens : int
        Tokens per block (blocks of different sizes cover different tokens).
    dtype : str
        The KV dtype (``"float32"``, ``"bfloat16"``...).
    adapter : str
        A LoRA adapter or other variant that changes K/V; empty for none.
    extra : str
        Anything else that changes K/V (a KV layout version, TP rank layout...).
    """
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidArgument(f"block_tokens must be a positive integer, got {block_tokens!r}")
    raw = "\x1f".join(("pdkv-prefix-v1", str(model), str(block_tokens), str(dtype), str(adapter), str(extra)))
    return hashlib.blake2b(raw.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def block_hashes(token_ids: Sequence[int], block_tokens: int, salt: str, *, parent: str | None = None,
                 limit: int | None = None) -> list[str]:
    """Hashes of the full blocks of ``token_ids``, in order.

    Parameters
    ----------
    token_ids : sequence of int
        Non-negative token ids (< 2**32).
    block_tokens : int
        Tokens per block.
    salt : str
        From :func:`cache_salt`; ignored when ``parent`` is given.
    parent : str, optional
        The hash of the block just before ``token_ids[0]`` (continue a chain).
    limit : int, optional
        Hash at most this many blocks.

    Raises
    ------
    InvalidArgument
        A token id outside ``[0, 2**32)``, a bad block size or a malformed parent.
    """
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise InvalidArgument(f"block_tokens must be a positive integer, got {block_tokens!r}")
    prev_hex = parent if parent is not None else salt
    if not is_block_hash(prev_hex):
        raise InvalidArgument(f"{'parent' if parent is not None else 'salt'} must be {HASH_CHARS} lowercase hex "
                              f"digits, got {prev_hex!r}")
    prev = bytes.fromhex(prev_hex)
    n = len(token_ids) // block_tokens
    if limit is not None:
        n = min(n, max(0, int(limit)))
    out: list[str] = []
    for i in range(n):
        chunk = token_ids[i * block_tokens:(i + 1) * block_tokens]
        try:
            data = struct.pack(f"<{block_tokens}I", *chunk)
        except struct.error:
            raise InvalidArgument(f"token ids must be integers in [0, 2**32), block {i} has {list(chunk)!r}") from None
        prev = hashlib.blake2b(prev + data, digest_size=8).digest()
        out.append(prev.hex())
    return out


def is_block_hash(value: object) -> bool:
    """True for a well-formed block hash (what a decoder checks every hash it accepts with)."""
    return isinstance(value, str) and len(value) == HASH_CHARS and _HEX.issuperset(value)
