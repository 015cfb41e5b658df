"""The engine's model side: the paged KV pool the model computes into, packing a
step's scheduled tokens into one batch-1 sequence with its :class:`PagedBatch`,
the per-layer hook that streams K/V to layer sinks, and the forward pass with
sampling (see :mod:`pdkv.serving.engine`)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from pdkv.errors import InvalidArgument
from pdkv.layout import KVGeometry

from .attention import BATCH_KWARG, PAGED_ATTENTION, PagedBatch, SeqSpan
from .engine_types import EngineConfig, EngineRequest, LayerSink
from .kv_pool import PagedKVPool
from .sampling import sample_tokens

__all__ = ["ModelRunner", "StepInputs"]

log = logging.getLogger("pdkv.serving")

#: ``(input ids [1, T], positions [1, T], PagedBatch, [(packed row, request) to sample]])``.
StepInputs = tuple[torch.Tensor, torch.Tensor, PagedBatch, list[tuple[int, EngineRequest]]]


class ModelRunner:
    """Runs one Hugging Face causal LM over one paged KV pool.

    Parameters
    ----------
    model, config, block_order, pool
        As :class:`~pdkv.serving.engine.Engine` takes them.

    Raises
    ------
    InvalidArgument
        The model does not use paged attention, or ``pool`` does not match it.
    """

    def __init__(self, model: Any, config: EngineConfig, *, block_order: Sequence[int] | None = None,
                 pool: PagedKVPool | None = None) -> None:
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != PAGED_ATTENTION:
            raise InvalidArgument(
                f"the model uses attn_implementation={impl!r}; the engine needs {PAGED_ATTENTION!r} "
                f"(load it with pdkv.serving.load_model, or call "
                f"model.set_attn_implementation(pdkv.serving.register_paged_attention()))")
        self.model = model
        self.config = config
        param = next(model.parameters())
        if pool is None:
            pool = PagedKVPool.from_hf_config(model.config, num_blocks=config.num_blocks,
                                              block_tokens=config.block_tokens, dtype=param.dtype,
                                              device=param.device, block_order=block_order)
        else:
            want = KVGeometry.from_hf_config(model.config, num_blocks=config.num_blocks,
                                                  block_tokens=config.block_tokens, dtype=param.dtype)
            if block_order is not None:
                raise InvalidArgument("give block_order to the pool, not to the engine, when passing a pool")
            if pool.geometry != want or pool.device != param.device:
                raise InvalidArgument(f"the pool ({pool.geometry}, on {pool.device}) does not match the model "
                                      f"and config ({want}, on {param.device})")
        self.pool = pool
        self.num_threads = config.num_threads

    def pin_threads(self) -> None:
        """Sets torch's intra-op threads to ``config.num_threads`` (if given) before a step."""
        if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)

    def prepare(self, sched: list[tuple[EngineRequest, int]]) -> StepInputs:
        """Packs the scheduled tokens (lock held): ids ``[1, T]``, positions ``[1, T]``,
        the :class:`PagedBatch`, and ``(packed row, request)`` of the rows to sample."""
        ids: list[int] = []
        pos: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[tuple[int, EngineRequest]] = []
        sinks: list[tuple[LayerSink, int, int, tuple[int, ...]]] = []
        for req, n in sched:
            start = req.num_computed
            spans.append(SeqSpan(len(ids), n, start + n, tuple(req.block_ids)))
            if req.layer_sink is not None:
                sinks.append((req.layer_sink, start, start + n, tuple(req.block_ids)))
            ids.extend(req.tokens[start:start + n])
            pos.extend(range(start, start + n))
            if start + n == len(req.tokens):
                sample_rows.append((len(ids) - 1, req))
        device = self.pool.device
        batch = PagedBatch.build(self.pool, spans)
        if sinks:
            batch.on_layer_written = self._layer_hook(sinks)
        input_ids = torch.tensor([ids], dtype=torch.int64, device=device)
        positions = torch.tensor([pos], dtype=torch.int64, device=device)
        return input_ids, positions, batch, sample_rows

    def forward(self, inputs: StepInputs) -> tuple[list[EngineRequest], list[int]]:
        """Runs the model once over ``inputs`` and samples a token for every row to
        sample; returns those rows' requests and their tokens, in order."""
        input_ids, positions, batch, sample_rows = inputs
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                             logits_to_keep=torch.tensor([r for r, _ in sample_rows], dtype=torch.int64,
                                                         device=input_ids.device),
                             **{BATCH_KWARG: batch})
            logits = out.logits[0]  # [num samples, vocab]
            samplers = [req for _, req in sample_rows]
            tokens = sample_tokens(logits, [r.handle.params for r in samplers],
                                   [r.handle.seed for r in samplers],
                                   [r.handle.params.index_offset + len(r.handle.output_ids)
                                    for r in samplers]) if samplers else []
        return samplers, tokens

    def _layer_hook(self, sinks: list[tuple[LayerSink, int, int, tuple[int, ...]]]) -> Callable[[int], None]:
        """The step's ``on_layer_written``: tells each sink of the step's requests."""
        device = self.pool.device

        def on_layer_written(layer: int) -> None:
            if device.type == "cuda":  # the pool writes are queued on the stream: land them first
                torch.cuda.current_stream(device).synchronize()
            for sink, start, end, blocks in sinks:
                try:
                    sink(layer, start, end, blocks)
                except Exception:  # noqa: BLE001 - a sink must not break the forward
                    log.exception("layer sink failed (layer %d)", layer)

        return on_layer_written
