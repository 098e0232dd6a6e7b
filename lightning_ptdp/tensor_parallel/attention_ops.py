"""Attention written out or fused, as the sharded dim meets it: the heads a batch dim of q, k and
v (or of one, the other holding one key head whole on every rank), a softmax along another dim,
SDPA's operands split alike. Any other matmul of one sharded operand follows torch's rules. A mixin
of ``ShardPropagation`` (propagation.py)."""

from __future__ import annotations

from typing import Any

from torch import fx

from lightning_ptdp.tensor_parallel.discovery_types import Sharded, _shape


class AttentionOps:
    """The attention handlers of ``ShardPropagation``."""

    def _op_matmul(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """Attention written out (q @ k^T, softmax, @ v): the heads are a batch dim of both operands, or
        of one, the other holding one head whole on every rank (multi-query attention's key); any other
        product of one sharded operand follows torch's rules (a per-head weight cut at the call)."""
        a, b = node.args[0], node.args[1]
        split = [t for t in (a, b) if isinstance(t, fx.Node) and t in self.shard]
        dims = {self.shard[t].dim - len(_shape(t)) for t in split}
        heads = min(dims)
        if len(dims) == 2:  # one may be a single head, whole on every rank
            split = [t for t in split if not self._one_whole_head(t, heads)]
            heads = min((self.shard[t].dim - len(_shape(t)) for t in split), default=heads)
        other = [t for t in (a, b) if t not in split]
        if len(split) == 1 and not (heads < -2 and self._one_whole_head(other[0], heads)):
            # the heads against all of them whole (a weight per head, cut at the call), or a product
            # of this rank's rows or columns (a scan's state @ a whole C): torch's rules
            self._generic(node, split)
            return
        infos = [self.shard[t] for t in split]
        along = [i.dim - len(_shape(t)) for i, t in zip(infos, split)]
        if not split or any(d != heads for d in along) or heads >= -2 or len({i.ratio for i in infos}) > 1:
            raise self.fail(node, "multiplies a head-sharded tensor other than along a batch dim of both operands")
        if len({i.outer for i in infos}) > 1:
            raise self.fail(node, "multiplies tensors whose heads are folded differently")
        bounds = self._same_parts(node, split)
        self._mark(node, len(_shape(node)) + heads, Sharded(0, infos[0].ratio, bounds, infos[0].outer))

    def _one_whole_head(self, t: Any, dim: int) -> bool:
        """``t`` holds one head, the same on every rank, at ``dim`` (from the end) or broadcasts there."""
        if not isinstance(t, fx.Node) or _shape(t) is None:
            return False
        info, shape = self.shard.get(t), _shape(t)
        whole = info is None or info.ratio == 1 and not info.bounds and info.outer == 1
        return whole and (len(shape) < -dim or shape[dim] == 1)

    _op___matmul__ = _op_matmul
    _op_bmm = _op_matmul

    def _op_softmax(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        if dim is None or dim % len(_shape(src)) == info.dim:
            raise self.fail(node, "normalises over the sharded dim")
        self._mark(node, info.dim, info)

    _op_log_softmax = _op_softmax

    def _op_scaled_dot_product_attention(self, node: fx.Node, src: fx.Node, info: Sharded) -> None:
        """q split along its heads; k and v too, or one head whole on every rank that all of q's
        heads read (multi-query attention's key and value, a replicated part of a fused column)."""
        q, k, v = node.args[0], node.args[1], node.args[2]
        heads_dim = len(_shape(q)) - 3
        if q not in self.shard or self.shard[q].dim != heads_dim:
            raise self.fail(node, "gets q/k/v that are not all split along their heads dim")
        for t in (k, v):
            kv = self.shard.get(t) if isinstance(t, fx.Node) else None
            one_head = self._one_whole_head(t, heads_dim - len(_shape(q)))
            if kv is not None and kv.dim == heads_dim and not one_head:
                if kv.ratio != self.shard[q].ratio and not node.kwargs.get("enable_gqa", False):
                    raise self.fail(node, "gets different numbers of local query and key heads")
            elif not one_head:
                raise self.fail(node, "gets q/k/v that are not all split along their heads dim")
        mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
        if isinstance(mask, fx.Node) and _shape(mask) and len(_shape(mask)) == 4 and _shape(mask)[1] > 1:
            self._per_head_mask(node, mask, _shape(q)[heads_dim], self.shard[q].ratio)  # recorded shapes: global
        bounds = self._same_parts(node, [t for t in (q, k, v) if isinstance(t, fx.Node) and t in self.shard])
        self._mark(node, heads_dim, Sharded(heads_dim, self.shard[q].ratio, bounds))

    def _per_head_mask(self, node: fx.Node, mask: fx.Node, heads: int, ratio: int) -> None:
        """A mask of one (T, S) per head (made from the values by an inner row): split like q already, or
        whole with all heads and cut to the rank's heads at the call."""
        info = self.shard.get(mask)
        if info is not None and (info.dim, info.ratio, info.bounds, info.outer) == (1, ratio, (), 1):
            return
        if info is not None or _shape(mask)[1] != heads or ratio != self.tp_size or "site" not in node.meta:
            raise self.fail(node, "uses a per-head attention mask split otherwise than its heads")
        self._slice(node, {mask: 1})
