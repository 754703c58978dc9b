"""Compressed frozen ``Linear`` and ``Embedding`` layers that decompress their weight only while they run.

Inside a checkpointed block the recompute's decompression serves the layer's backward (unless
``keep_recomputed_weight`` is False), so a block LCSB skips costs no backward decompression. The codes are not
in ``state_dict()``: they are re-derived from the source weights, so checkpoints hold the float tensors only.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from lcsb_lightning.mebp._internal.formats import get_format
from lcsb_lightning.mebp._internal.stored import Packed, StoredFormat, select_rows
from lcsb_lightning.mebp._internal.stats import MeBPStats, checkpointed, recomputing
from lcsb_lightning.mebp._internal.storage import MappedWeights
from lcsb_lightning.mebp._internal.workspace import DecompressionWorkspace

#: Default largest number of weights decompressed at once (64 MiB in float32).
MAX_CHUNK_ELEMENTS = 1 << 24
#: Codes looked up per table lookup while decompressing (bounds the int32 scratch to 1 MiB).
INDEX_SCRATCH_ELEMENTS = 1 << 18


class _CompressedLinearFn(torch.autograd.Function):
    """``y = x W^T + b`` with ``W`` decompressed on the fly; only the input (and bias) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, layer: CompressedLinear) -> torch.Tensor:
        ctx.layer = layer
        ctx.has_bias = bias is not None
        ctx.weight_given_back = False
        phase = "backward" if recomputing() else "forward"
        chunks = layer.row_chunks()
        if len(chunks) == 1:
            weight = layer.decompress(x.dtype, phase)
            out = F.linear(x, weight, bias.to(x.dtype) if bias is not None else None)
            # Inside a checkpoint the first forward and the recompute must save alike. The checkpoint
            # drops what the first forward saves; the recompute's copy serves this layer's backward.
            # Nothing else outlives the call, so its buffer goes straight back to the workspace.
            save = checkpointed() and layer.keep_recomputed_weight and ctx.needs_input_grad[0]
            ctx.save_for_backward(weight if save else None)
            if not (save and recomputing()):
                layer.give_back(weight)
            return out
        ctx.save_for_backward(None)
        out = x.new_empty(*x.shape[:-1], layer.out_features)
        with layer.timed(phase, x.device):
            for rows in chunks:
                part = layer.decompress_rows(rows, x.dtype)
                out[..., rows] = F.linear(x, part, bias[rows].to(x.dtype) if bias is not None else None)
                layer.give_back(part)
        layer.decompress_count[phase] += 1
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        layer: CompressedLinear = ctx.layer
        (weight,) = ctx.saved_tensors
        if ctx.weight_given_back:  # a second backward through a retained graph: the buffer was reused
            weight = None
        grad_in = None
        if ctx.needs_input_grad[0]:
            chunks = layer.row_chunks()
            if weight is not None:
                grad_in = grad_out.matmul(weight.to(grad_out.dtype))
            elif len(chunks) == 1:
                weight = layer.decompress(grad_out.dtype, "backward")
                grad_in = grad_out.matmul(weight)
            else:
                with layer.timed("backward", grad_out.device):
                    for rows in chunks:
                        part = layer.decompress_rows(rows, grad_out.dtype)
                        term = grad_out[..., rows].matmul(part)
                        grad_in = term if grad_in is None else grad_in.add_(term)
                        layer.give_back(part)
                layer.decompress_count["backward"] += 1
        if weight is not None:
            layer.give_back(weight)
            ctx.weight_given_back = True
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[1]:
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_in, grad_bias, None


class _CompressedWeight:
    """Shared plumbing of the compressed layers: buffers ``weight`` (the codes), ``scales`` and ``mins``;
    ``stats`` and ``workspace`` are the converted model's (without them nothing is timed and every
    decompression allocates), ``weight_store`` its memory-mapped weights if any."""

    fmt: StoredFormat
    group_size: int
    weight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    decompress_count: dict[str, int]
    stats: MeBPStats | None
    workspace: DecompressionWorkspace | None
    weight_store: MappedWeights | None
    keep_recomputed_weight: bool

    def _store(self, packed: Packed, fmt: str | StoredFormat, group_size: int) -> None:
        assert isinstance(self, nn.Module)
        self.fmt = get_format(fmt)
        self.group_size = group_size
        for name, tensor in (("weight", packed.codes), ("scales", packed.scales), ("mins", packed.mins)):
            self.register_buffer(name, tensor, persistent=False)
        self.decompress_count = {"forward": 0, "backward": 0}
        self.stats = None
        self.workspace = None
        self.weight_store = None
        self.keep_recomputed_weight = True

    def packed(self, rows: torch.Tensor | slice | None = None) -> Packed:
        full = Packed(self.weight, self.scales, self.mins)
        return full if rows is None else select_rows(full, rows)

    def timed(self, phase: str, device: torch.device) -> ContextManager[None]:
        """Time a decompression into :attr:`stats` (a no-op without one)."""
        return self.stats.time_decompress(phase, device) if self.stats is not None else contextlib.nullcontext()

    def decompress_rows(self, rows: torch.Tensor | slice | None, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``rows`` (all with None) of the float weight, in a workspace buffer when there is one."""
        packed = self.packed(rows)
        try:
            if self.workspace is None:
                return self.fmt.dequantize(packed, self.group_size, dtype)
            out_rows, width = packed.codes.shape
            device = packed.codes.device
            out = self.workspace.borrow((out_rows, self.fmt.columns(packed)), dtype, device)
            if self.fmt.codes_per_byte == 1:  # one byte a code: no table lookup, no scratch
                return self.fmt.dequantize(packed, self.group_size, dtype, out=out)
            index_rows = max(1, min(out_rows, INDEX_SCRATCH_ELEMENTS // width))
            index = self.workspace.borrow((index_rows, width), torch.int32, device)
            try:
                return self.fmt.dequantize(packed, self.group_size, dtype, out=out, index_buffer=index)
            finally:
                self.workspace.give_back(index)
        finally:
            self.release_pages()

    def release_pages(self) -> None:
        """With memory-mapped weights, drop this layer's compressed pages from the process."""
        if self.weight_store is not None:  # every decompression: no Packed built here
            for tensor in (self.weight, self.scales, self.mins):
                if tensor is not None:
                    self.weight_store.release(tensor)

    def decompress(self, dtype: torch.dtype = torch.float32, phase: str = "forward") -> torch.Tensor:
        """The full float weight (counted and timed as a ``phase`` decompression); see :meth:`give_back`."""
        with self.timed(phase, self.weight.device):
            out = self.decompress_rows(None, dtype)
        self.decompress_count[phase] += 1
        return out

    def give_back(self, weight: torch.Tensor) -> None:
        """Return a weight from :meth:`decompress` to the workspace; it must not be read afterwards."""
        if self.workspace is not None:
            self.workspace.give_back(weight)


class CompressedLinear(_CompressedWeight, nn.Linear):
    """A frozen ``nn.Linear`` stored compressed; peft wraps it like any Linear, and its ``weight`` is the uint8
    code tensor (as for bitsandbytes' ``Linear4bit``), so peft keeps LoRA weights in float. Layers wider than
    ``max_chunk_elements`` decompress in row chunks (a 150k-row LM head never exists in float).

    Example::

        >>> layer = CompressedLinear.from_linear(nn.Linear(64, 8), fmt="int4", group_size=32)
        >>> layer(torch.randn(2, 64)).shape
        torch.Size([2, 8])
    """

    def __init__(self, in_features: int, out_features: int, packed: Packed, bias: torch.Tensor | None,
                 fmt: str | StoredFormat, group_size: int, max_chunk_elements: int = MAX_CHUNK_ELEMENTS) -> None:
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.max_chunk_elements = max_chunk_elements
        self._store(packed, fmt, group_size)
        self.bias = nn.Parameter(bias.detach().float(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, fmt: str | StoredFormat, group_size: int, packed: Packed | None = None
    ) -> CompressedLinear:
        """Compress ``linear`` (pass ``packed`` to share codes with a tied embedding)."""
        if packed is None:
            packed = get_format(fmt).quantize(linear.weight, group_size)
        return cls(linear.in_features, linear.out_features, packed, linear.bias, fmt, group_size)

    def reset_parameters(self) -> None:  # nn.Linear API; the compressed weight is frozen
        return None

    def row_chunks(self) -> list[slice]:
        step = max(1, self.max_chunk_elements // self.in_features)
        return [slice(start, min(start + step, self.out_features)) for start in range(0, self.out_features, step)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CompressedLinearFn.apply(x, self.bias, self)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, group_size={self.group_size}"


class CompressedEmbedding(_CompressedWeight, nn.Module):
    """A frozen ``nn.Embedding`` stored compressed; a lookup decompresses only the looked-up rows.

    Example::

        >>> emb = CompressedEmbedding.from_embedding(nn.Embedding(10, 64), fmt="int4", group_size=32)
        >>> emb(torch.tensor([[1, 2]])).shape
        torch.Size([1, 2, 64])
    """

    def __init__(self, packed: Packed, fmt: str | StoredFormat, group_size: int, padding_idx: int | None = None,
                 dtype: torch.dtype = torch.float32, embed_scale: torch.Tensor | float | None = None) -> None:
        super().__init__()
        self.dtype = dtype
        self.num_embeddings = packed.codes.shape[0]
        self.embedding_dim = get_format(fmt).columns(packed)
        self.padding_idx = padding_idx
        self._store(packed, fmt, group_size)
        scale = None if embed_scale is None else torch.as_tensor(embed_scale).detach().clone()  # Gemma 3's, ...
        self.register_buffer("embed_scale", scale, persistent=False)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, fmt: str | StoredFormat, group_size: int, packed: Packed | None = None
    ) -> CompressedEmbedding:
        if packed is None:
            packed = get_format(fmt).quantize(embedding.weight, group_size)
        dtype = embedding.weight.dtype if embedding.weight.is_floating_point() else torch.float32
        return cls(packed, fmt, group_size, embedding.padding_idx, dtype, getattr(embedding, "embed_scale", None))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        with self.timed("forward", self.weight.device):
            rows = self.fmt.dequantize(self.packed(flat), self.group_size, self.dtype)
            self.release_pages()
        self.decompress_count["forward"] += 1
        rows = rows.reshape(*input_ids.shape, self.embedding_dim)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt}, group_size={self.group_size}"
