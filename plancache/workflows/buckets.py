"""Shape buckets: serve many sizes of one dimension with a few plans.

A request of size ``n`` runs the plan of the smallest bucket ``>= n`` on inputs padded
with zeros, and the caller reads the first ``n`` rows of the output. This is exact only
along a dimension whose rows do not interact: the batch dimension of convolutions,
matmuls and attention, and the sequence dimension of causal attention with equal query
and key lengths when the padding is at the end (no real query attends to a later key).
Nothing here checks that for you: choose the dimension by that rule.

Pure Python plus ``torch`` (imported by the functions that pad).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["pad_to", "powers_of_two", "round_up"]


def powers_of_two(largest: int, smallest: int = 1) -> list[int]:
    """``[smallest, 2*smallest, ..., >= largest]``: a bucket list with at most 2x padding."""
    if smallest < 1 or largest < smallest:
        raise ValueError(f"need 1 <= smallest <= largest, got {smallest}, {largest}")
    buckets = [smallest]
    while buckets[-1] < largest:
        buckets.append(buckets[-1] * 2)
    return buckets


def round_up(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``size``; ``ValueError`` if none does."""
    fitting = [b for b in buckets if b >= size]
    if size < 1 or not fitting:
        raise ValueError(f"size {size} fits no bucket of {sorted(buckets)}")
    return min(fitting)


def pad_to(tensor: Any, dim: int, size: int) -> Any:
    """``tensor`` zero-padded at the end of ``dim`` to ``size``, keeping its memory layout
    (channels-last stays channels-last). Returns ``tensor`` itself when it already fits."""
    import torch

    current = tensor.shape[dim]
    if current == size:
        return tensor
    if current > size:
        raise ValueError(f"dimension {dim} has {current} > {size}")
    shape = list(tensor.shape)
    shape[dim] = size
    # empty_like on a resized shape loses the layout; build it from the stride order.
    order = sorted(range(tensor.dim()), key=lambda d: tensor.stride(d), reverse=True)
    permuted = torch.zeros([shape[d] for d in order], dtype=tensor.dtype, device=tensor.device)
    out = permuted.permute(*[order.index(d) for d in range(tensor.dim())])
    out.narrow(dim, 0, current).copy_(tensor)
    return out
