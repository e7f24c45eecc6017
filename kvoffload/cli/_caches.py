"""Synthetic KV caches shaped like the layouts engines use, for the demo, the bench and the replay.

Owns nothing: it allocates tensors and hands them to the caller.
"""

from __future__ import annotations

from typing import Final

import torch

from kvoffload import InvalidArgumentError

__all__ = ["LAYOUTS", "MLA_WIDTH", "block_bytes", "build_cache"]

#: The cache layouts: per-layer ``[2, N, bs, heads, dim]`` (block dim 1), block-major
#: ``[N, 2, bs, heads, dim]``, MLA ``[N, bs, 576]``, one cross-layer tensor
#: ``[N, layers, 2, bs, heads, dim]``, and K and V as separate ``[N, bs, heads, dim]`` tensors.
LAYOUTS: Final = ("per-layer", "block-major", "mla", "cross-layer", "kv-separate")
#: Width of an MLA latent cache row (512 latent + 64 rope dims, as in DeepSeek-V3).
MLA_WIDTH: Final = 576


def block_bytes(layout_kind: str, *, layers: int, kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype) -> int:
    """Bytes one block of a :func:`build_cache` cache holds, all its tensors together (what the
    tools check against the memory before they allocate)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if layout_kind == "mla":
        return layers * block_size * MLA_WIDTH * itemsize
    return layers * 2 * block_size * kv_heads * head_dim * itemsize


def build_cache(
    layout_kind: str,
    *,
    num_blocks: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    fill: bool = True,
) -> tuple[dict[str, torch.Tensor], int | dict[str, int]]:
    """A KV cache of one of :data:`LAYOUTS` and its block dim(s).

    With ``fill`` every byte is random (generated on ``device`` from ``seed``); without, the memory
    is left uninitialised (for callers that write every block before reading it).
    """
    generator = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        if not fill:
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator, device=device)
        return raw.view(dtype).view(*shape)

    if layout_kind == "per-layer":
        return {f"layer{i}": rand(2, num_blocks, block_size, kv_heads, head_dim) for i in range(layers)}, 1
    if layout_kind == "block-major":
        return {f"layer{i}": rand(num_blocks, 2, block_size, kv_heads, head_dim) for i in range(layers)}, 0
    if layout_kind == "mla":
        return {f"layer{i}": rand(num_blocks, block_size, MLA_WIDTH) for i in range(layers)}, 0
    if layout_kind == "cross-layer":
        return {"kv": rand(num_blocks, layers, 2, block_size, kv_heads, head_dim)}, 0
    if layout_kind == "kv-separate":
        tensors: dict[str, torch.Tensor] = {}
        for i in range(layers):
            tensors[f"k{i}"] = rand(num_blocks, block_size, kv_heads, head_dim)
            tensors[f"v{i}"] = rand(num_blocks, block_size, kv_heads, head_dim)
        return tensors, 0
    raise InvalidArgumentError(f"layout = {layout_kind!r} must be one of {', '.join(LAYOUTS)}")
