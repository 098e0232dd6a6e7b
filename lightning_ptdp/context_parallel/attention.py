"""Attention over a sequence split across the context-parallel ranks: the block's own
``F.scaled_dot_product_attention`` calls (transformers' sdpa, litgpt, nanoGPT, torchtitan) and
attention written out with matmul (transformers' eager). Each rank keeps its queries and
all-gathers the layer's keys and values (the Llama 3 paper's choice over ring passing): one
collective per layer, exact for any mask the model passes to its blocks and any SDPA backend, GQA
included (only the KV heads travel). Under causal attention each of the rank's two chunks attends
to the keys up to its own end (lower-right causal), so every rank does the same work.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from lightning_ptdp.context_parallel.layout import CPGroup, gather_keys_values, own_chunks
from lightning_ptdp.core.sdpa import sdpa_args

_PRODUCTS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm}
_BIASED = {
    torch.baddbmm,
    torch.Tensor.baddbmm,
}  # bias + a @ b: scores with their bias in one call, heads folded into the batch
_MATMULS = {*_PRODUCTS, *_BIASED, torch.einsum}
_CONVS = {F.conv1d, torch.conv1d}
_NEW_TENSORS = {torch.Tensor.new_ones, torch.Tensor.new_zeros, torch.Tensor.new_full, torch.Tensor.new_empty}
_FIX = (
    "set attn_implementation='sdpa' (transformers) or call F.scaled_dot_product_attention, or context_parallel_size=1"
)


def _user_line() -> str:
    """The first frame outside torch and this package: the model's own source line."""
    for frame in inspect.stack()[2:]:
        name = frame.filename
        if "lightning_ptdp" not in name and "/torch/" not in name:
            return f"{name}:{frame.lineno} ({(frame.code_context or ['?'])[0].strip()})"
    return "?"


class ContextAttention(TorchFunctionMode):
    """Active inside one block's forward while the block holds ``local`` of ``length`` tokens.

    SDPA calls gather their keys and values. Attention written out (transformers' eager: scores =
    q @ k^T, a mask sliced to the key length, softmax, @ v) gathers k^T at the first product and v
    at the second, and reads the mask's columns up to the whole length instead of the local one."""

    def __init__(
        self,
        cp: CPGroup,
        block: str,
        local: int,
        length: int,
        buffers: list[torch.Tensor],
        masks: "ChunkMasks",
        inputs: list[torch.Tensor] = (),
    ) -> None:
        super().__init__()
        self.cp, self.block, self.local, self.length = cp, block, local, length
        self.buffers, self.masks, self.inputs = buffers, masks, inputs
        self.calls = 0
        self.squares: list[torch.Tensor] = []  # the [T, T] made here over the whole sequence (this forward)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        squares = []  # the inputs that are squares made here: only once this forward made one
        if self.squares:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            squares = [t for t in tensors if self._is_square(t)]
            if squares and any(self._is_query_rows(t) for t in tensors if not self._is_square(t)):
                args, kwargs = tree_map(self._rows_if_whole_square, (args, kwargs))  # its rows meet local queries
                squares = []
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func in _CONVS:
            self._check_convolution(*args, **kwargs)
        if func in _PRODUCTS and len(args) >= 2:
            return self._product(func, args, kwargs)
        if func in _BIASED:
            return self._biased_product(func, *_batches_positional(args, kwargs))
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor):
            if self._is_key_mask(args[0]):
                args = (args[0], self._whole_keys(args[1]))
            elif (last := self._last_keys(*args)) is not None:
                args = (args[0], last)
            elif self._is_position_table(*args):
                return self._rows_of_table(args[0], args[1])
        out = func(*args, **kwargs)  # here, not in a helper: the certificate's diff reads this frame as the user's call
        if isinstance(out, torch.Tensor) and out.dim() >= 2:
            if squares and out.shape[-2:] == (self.length, self.length):
                self.squares.append(out)  # what the block computes from it by position stays whole
            elif out.shape[-2:] == (self.local, self.local) and _from_sizes(func, args, kwargs, out):
                out = self._whole_square(func, args, kwargs, out)  # made from sizes alone
        self._check_positions(func, out)
        if func in _MATMULS and isinstance(out, torch.Tensor) and out.dim() >= 2:
            if out.shape[-2:] == (self.local, self.local) and not any(isinstance(a, torch.nn.Parameter) for a in args):
                raise ValueError(
                    f"context parallelism: {self.block} multiplies two [{self.local}, {self.local}] sequence-by-"
                    f"sequence operands at {_user_line()}, an attention context parallelism does not recognise; "
                    f"it splits scaled_dot_product_attention calls and q @ k^T ... @ v written with matmul. {_FIX}"
                )
        return out

    def _check_convolution(self, x: Any, weight: Any, *args: Any, **kwargs: Any) -> None:
        """A convolution over the sequence ([batch, channels, local tokens], a kernel of more than one
        token: a state-space mixer's or a short conv's) mixes neighbours across the rank's chunks."""
        if isinstance(x, torch.Tensor) and x.dim() == 3 and x.size(-1) == self.local and weight.size(-1) > 1:
            raise ValueError(
                f"context parallelism: {self.block} convolves over the {self.local} tokens it holds (kernel "
                f"{weight.size(-1)}) at {_user_line()}; a convolution over the sequence would need its neighbours "
                "on the other ranks, which context parallelism does not exchange. Use context_parallel_size=1"
            )

    def _check_positions(self, func: Any, out: Any) -> None:
        if func is torch.arange and isinstance(out, torch.Tensor) and out.numel() == self.local and out.dim() == 1:
            raise ValueError(
                f"context parallelism: {self.block} computes torch.arange over the {self.local} tokens it holds at "
                f"{_user_line()}; positions made inside a block from the length it sees would be this rank's local "
                "ones, not the sequence's. Compute positions before the blocks and pass them in (as transformers, "
                "litgpt and nanoGPT do), or use context_parallel_size=1"
            )

    def _whole_square(self, func, args, kwargs, out: torch.Tensor) -> torch.Tensor:
        """A tensor made from sizes alone whose last two dims are the local length (a mask made inside
        the block: ``torch.ones(T, T).triu(1)``): made over the whole sequence instead, so what the
        block computes on it by position (triu, tril, a sliding window) holds for every position;
        attention then reads this rank's rows (``_rows_if_whole_square``)."""
        whole = tree_map(lambda v: self.length if type(v) is int and v == self.local else v, (args, kwargs))
        grown = func(*whole[0], **whole[1])
        if grown.shape[-2:] != (self.length, self.length):
            return out
        self.squares.append(grown)
        return grown

    def _is_query_rows(self, x: torch.Tensor) -> bool:
        return x.dim() >= 2 and x.size(-2) == self.local

    def _rows_if_whole_square(self, x: Any) -> Any:
        """A square made here over the whole sequence (``_whole_square``, or computed from one): this
        rank's rows; anything else as it is."""
        if isinstance(x, torch.Tensor) and self._is_square(x):
            return own_chunks(x, x.dim() - 2, self.cp)
        return x

    def _is_square(self, x: torch.Tensor) -> bool:
        return any(x is square for square in self.squares)

    def _product(self, func, args, kwargs):
        a, b = args[0], args[1]
        plain = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() >= 3 and b.dim() >= 3
        if plain and not _of_parameter(a) and not _of_parameter(b):
            if a.size(-1) == self.length and b.size(-2) == self.local:  # weights [.., local, length] @ v
                b = gather_keys_values(b, b.dim() - 2, self.cp)
            elif b.size(-1) == self.local and self.local in a.shape[:-1]:
                # q @ k^T: the keys along the last dim; the queries are a's rows, or a batch dim of it
                # (scores per query and head, [B, T, H, d] @ [B, 1, d, T], a sparse-attention indexer's)
                self.calls += 1
                b = gather_keys_values(b, b.dim() - 1, self.cp)
            return func(a, b, *args[2:], **kwargs)
        return func(*args, **kwargs)

    def _biased_product(self, func, args, kwargs):
        """``baddbmm(bias, q, k^T)``: the scores gather their keys as ``q @ k^T`` does, and a bias with a
        column per local key (zeros sized from the local length, a mask) gathers its columns with them."""
        bias, a, b = (*args, None, None, None)[:3]
        if all(isinstance(t, torch.Tensor) for t in (bias, a, b)) and a.dim() == b.dim() == 3:
            if a.size(-2) == self.local and b.size(-1) == self.local:
                self.calls += 1
                b = gather_keys_values(b, 2, self.cp)
                if bias.dim() >= 1 and bias.size(-1) == self.local:
                    bias = gather_keys_values(bias, bias.dim() - 1, self.cp)
                return func(bias, a, b, *args[3:], **kwargs)
        return func(*args, **kwargs)

    def _is_key_mask(self, x: Any) -> bool:
        """A mask over all keys the block received, [..., local or 1, length] (its rows were cut for this
        rank); not a tensor of the same shape made inside the block (a rotary cache [1, T, 1, 2 * head_dim]
        read up to head_dim, equal to the local length)."""
        return (
            isinstance(x, torch.Tensor)
            and x.dim() == 4
            and x.size(-1) == self.length
            and x.size(-2) in (1, self.local)
            and any(x is t for t in self.inputs)
        )

    def _last_keys(self, table: torch.Tensor, index: Any) -> Any:
        """A per-key table the block received, read for the last ``n_keys`` keys with the local count
        (MPT's ALiBi bias ``bias[:, :, n - key_length:]``, KV-cache style): the index reading them all,
        the scores holding every key. None for any other read."""
        items = index if isinstance(index, tuple) else (index,)
        last, size = items[-1] if items else None, table.size(-1) if table.dim() else 0
        received = any(table is t for t in self.inputs)
        if not received or not isinstance(last, slice) or last.step not in (None, 1) or size < self.length:
            return None
        start = last.start + size if isinstance(last.start, int) and last.start < 0 else last.start  # x[..., -n:]
        if start != size - self.local or last.stop not in (None, size) or size == self.local:
            return None
        return (*items[:-1], slice(size - self.length, None))

    def _is_position_table(self, table: torch.Tensor, index: Any) -> bool:
        """A buffer of the block (a rotary cache, nanoGPT's causal ``bias``) read up to the local
        length: ``cache[0:T]``, ``bias[:, :, :T, :T]``; its rows are positions. A slice after an
        Ellipsis reads the last dims, features (a rotary cache read by ``[..., :head_dim]``), even
        when head_dim equals the local length."""
        items = index if isinstance(index, tuple) else (index,)
        leading = items[: next((k for k, i in enumerate(items) if i is Ellipsis), len(items))]
        return any(table is b for b in self.buffers) and any(self._prefix(i) == self.local for i in leading)

    @staticmethod
    def _prefix(index: Any) -> Any:
        if isinstance(index, slice) and index.start in (None, 0) and index.step in (None, 1):
            return index.stop
        return None

    def _rows_of_table(self, table: torch.Tensor, index: Any) -> torch.Tensor:
        """Every position up to the whole length; then, along the first such dim (the queries'),
        this rank's positions. A second one (nanoGPT's keys) keeps them all."""
        items = index if isinstance(index, tuple) else (index,)
        whole = tuple(slice(0, self.length) if self._prefix(i) == self.local else i for i in items)
        first = next(d for d, i in enumerate(items) if self._prefix(i) == self.local)
        kept = sum(1 for i in items[:first] if i is None) - sum(1 for i in items[:first] if isinstance(i, int))
        return own_chunks(table[whole if isinstance(index, tuple) else whole[0]], first + kept, self.cp)

    def _whole_keys(self, index: Any) -> Any:
        """``mask[..., :n_keys]`` with the local key count read from the local keys: all keys."""
        if isinstance(index, tuple) and index and isinstance(index[-1], slice):
            last = index[-1]
            if last.start in (None, 0) and last.stop == self.local and last.step in (None, 1):
                return (*index[:-1], slice(last.start, self.length, last.step))
        return index

    def _attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        q, k, v, mask, dropout_p, is_causal, scale, gqa = sdpa_args(*args, **kwargs)
        local, length = self.local, self.length
        if q.size(-2) != local or k.size(-2) != local:  # not over this block's sequence (cross-attention)
            return F.scaled_dot_product_attention(*args, **kwargs)
        self.calls += 1
        k, v = gather_keys_values(k, k.dim() - 2, self.cp), gather_keys_values(v, v.dim() - 2, self.cp)
        common = dict(dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        if mask is not None:
            mask = self._rows_if_whole_square(mask)  # made in the block over every position: this rank's rows
            if mask.size(-1) != length or mask.size(-2) not in (1, local):
                raise ValueError(
                    f"context parallelism: the attention mask of {self.block} has shape {tuple(mask.shape)} at "
                    f"{_user_line()}; over {local} local queries and all {length} keys it must be [..., {local} or 1, "
                    f"{length}]. A mask the model passes to its blocks is cut for each rank; one built inside a block "
                    f"from the length it sees is not. {_FIX}"
                )
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **common)
        if not is_causal:
            return F.scaled_dot_product_attention(q, k, v, **common)
        chunk = local // 2
        outputs = []
        for j, g in enumerate(self.cp.chunks):  # each chunk: the keys up to its own end, lower-right causal
            end = (g + 1) * chunk
            rows = q.narrow(-2, j * chunk, chunk)
            outputs.append(self._lower_right(rows, k.narrow(-2, 0, end), v.narrow(-2, 0, end), common))
        return torch.cat(outputs, dim=-2)

    def _lower_right(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, common: dict) -> torch.Tensor:
        """Queries at the end of the keys, each seeing the keys up to its own position."""
        if q.is_cuda:  # flash and efficient attention take lower-right causal natively: no mask in memory
            from torch.nn.attention.bias import causal_lower_right

            if common["enable_gqa"]:  # CausalBias's kernels want every head's keys
                repeat = q.size(-3) // k.size(-3)
                k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
            bias = causal_lower_right(q.size(-2), k.size(-2))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, **{**common, "enable_gqa": False})
        mask = self.masks.get(q.size(-2), k.size(-2), q.dtype, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **common)


def _batches_positional(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``baddbmm(bias, batch1=q, batch2=k)`` as ``baddbmm(bias, q, k)``."""
    if len(args) == 1 and "batch1" in kwargs and "batch2" in kwargs:
        kwargs = dict(kwargs)
        args = (args[0], kwargs.pop("batch1"), kwargs.pop("batch2"))
    return args, kwargs


def _any_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(value))


def _from_sizes(func: Any, args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
    """A call that reads no tensor's values: a factory (``torch.ones(T, T)``), or a boolean mask made by
    a ``Tensor.new_*`` method, whose tensor gives only the device (a float ``x.new_empty(..., d)`` is a
    buffer like ``x``, whose last dim is features however long)."""
    if func in _NEW_TENSORS and args and isinstance(args[0], torch.Tensor):
        args = args[1:] if out.dtype == torch.bool else args
    return not _any_tensor((args, kwargs))


def _of_parameter(x: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.view(...)``, ``weight.t()``): never a sequence."""
    while x is not None:
        if isinstance(x, torch.nn.Parameter):
            return True
        x = x._base
    return False


class ChunkMasks:
    """Additive lower-right causal masks of this rank's two chunks, made once and shared by every
    layer, whose backward each keeps the mask it used: one copy per rank, not one per layer (CPU
    SDPA takes a mask, not lower-right causal). Owned by the model (apply.py), not a global."""

    def __init__(self) -> None:
        self._masks: dict[tuple, torch.Tensor] = {}

    def get(self, rows: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (rows, keys, dtype, device)
        if key not in self._masks:
            if len(self._masks) >= 8:  # another sequence length or dtype: the old ones are not reused
                self._masks.clear()
            allowed = torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)
            self._masks[key] = torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(~allowed, -torch.inf)
        return self._masks[key]
