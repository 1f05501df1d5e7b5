"""How sfstore's vLLM connector sees vLLM's paged KV cache: the store geometry of a vLLM KV cache config, and views
of one block's layer (or of a batch of pages) in the store's layout, with no copy.

The connector (:mod:`sfstore.kvcache.vllm`) stores each block as the store's ``(layers, kv, tokens, heads, dim)``
so that a block saved from one cache layout (a GPU backend's split K/V cells, the CPU kernel's per-head rows, an
opaque latent-attention page) loads into any other with the same geometry.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from sfstore import errors
from sfstore._optional import require
from sfstore.kvcache.geometry import DTYPE_SIZES, KVGeometry

require("torch", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")
require("vllm", "vllm", "sfstore's vLLM KV connector (sfstore.kvcache.vllm)")

# E402: after the checks, so that a missing package is named with the extra that installs it
import torch  # noqa: E402
from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec  # noqa: E402

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KV_LAYOUTS", "KVLayout", "layout_for", "block_layer_view", "pages_as_layers"]

KV_LAYOUTS = ("auto", "split", "cpu", "opaque")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """A vLLM KV cache in the store's terms: the geometry of its blocks, which vLLM layer is which store layer, and
    how one block of one layer sits in vLLM's page (``mode``: ``"split"``, ``"cpu"`` or ``"opaque"``)."""

    geometry: KVGeometry
    layer_names: tuple[str, ...]  # store layer index -> vLLM layer name
    page_shape: tuple[int, int, int]  # one block of one layer in vLLM: (H, N, C)
    mode: str  # "split" | "cpu" | "opaque"

    @property
    def layer_index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.layer_names)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def layout_for(kv_cache_config: KVCacheConfig, mode: str = "auto", *, cpu_platform: bool | None = None) -> KVLayout:
    """The store geometry and block mapping for a vLLM ``KVCacheConfig`` (one attention spec for all layers)."""
    if mode not in KV_LAYOUTS:
        raise errors.ConfigError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, not {mode!r}")
    names: list[str] = []
    specs: list[Any] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise errors.NotSupportedOnHostError(
                f"SfstoreConnector stores attention KV caches only, not {type(spec).__name__} "
                f"(layers {group.layer_names[:3]}...)"
            )
        names.extend(group.layer_names)
        specs.append(spec)
    if not specs:
        raise errors.ConfigError("the vLLM KV cache config has no attention layers")
    first = specs[0]
    for s in specs[1:]:
        if (s.block_size, s.num_heads, s.state_content_size_bytes, s.dtype) != (
            first.block_size, first.num_heads, first.state_content_size_bytes, first.dtype
        ):
            raise errors.NotSupportedOnHostError(
                "SfstoreConnector needs one KV page shape for every layer; this model's groups differ "
                f"({first} vs {s}): hybrid models are not supported"
            )
    spec = first
    dtype = _dtype_name(spec.dtype)
    if dtype not in DTYPE_SIZES:
        raise errors.NotSupportedOnHostError(
            f"KV cache dtype {dtype} is not one sfstore stores ({', '.join(DTYPE_SIZES)})"
        )
    itemsize = DTYPE_SIZES[dtype]
    if spec.state_content_size_bytes % itemsize:
        raise errors.NotSupportedOnHostError(
            f"a KV page cell of {spec.state_content_size_bytes} bytes is not whole {dtype} elements"
        )
    cells = spec.state_content_size_bytes // itemsize
    heads = spec.num_heads
    tokens = spec.num_states if hasattr(spec, "num_states") else spec.block_size
    if tokens != spec.block_size:
        raise errors.NotSupportedOnHostError(
            f"SfstoreConnector needs one KV state per token (the spec stores {tokens} per block of {spec.block_size})"
        )
    dense = (
        not isinstance(spec, MLAAttentionSpec)
        and spec.num_head_slots is None
        and spec.state_content_bytes is None
        and spec.head_size == spec.head_size_v
        and cells == 2 * spec.head_size
        and str(getattr(spec.kv_quant_mode, "name", "NONE")) == "NONE"
    )
    if mode == "auto":
        if cpu_platform is None:
            from vllm.platforms import current_platform

            cpu_platform = bool(current_platform.is_cpu())
        mode = ("cpu" if cpu_platform else "split") if dense else "opaque"
    elif mode != "opaque" and not dense:
        raise errors.ConfigError(f"kv_layout {mode!r} needs a dense K/V cache; this model's ({spec}) takes 'opaque'")
    if mode == "opaque":
        geom = KVGeometry(len(names), spec.block_size, heads, cells, dtype, kv=1)
    else:
        geom = KVGeometry(len(names), spec.block_size, heads, spec.head_size, dtype, kv=2)
    return KVLayout(geom, tuple(names), (heads, spec.block_size, cells), mode)


def block_layer_view(layer_cache: torch.Tensor, block_id: int, layout: KVLayout) -> torch.Tensor:
    """A view of block ``block_id`` of one layer's ``[B, H, N, C]`` cache with the store's layer shape
    ``(kv, tokens, heads, dim)`` (strided, no copy)."""
    page = layer_cache[block_id]
    if tuple(page.shape) != layout.page_shape:
        raise errors.InvalidRequestError(
            f"a vLLM KV page is {tuple(page.shape)}, but the KV cache config says {layout.page_shape}"
        )
    h, n, c = layout.page_shape
    view: torch.Tensor
    if layout.mode == "split":  # cell = [K(d) | V(d)]
        view = page.view(h, n, 2, c // 2).permute(2, 1, 0, 3)
    elif layout.mode == "cpu":  # per head: N rows of K, then N rows of V (the CPU kernel's view of the page)
        view = page.view(h, 2, n, c // 2).permute(1, 2, 0, 3)
    else:  # opaque: (1, N, H, C)
        view = page.permute(1, 0, 2).unsqueeze(0)
    return view


def pages_as_layers(pages: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A view of a batch of pages (``[B, H, N, C]``: one layer's cache, or a staging copy of its pages) as the
    store's layers, ``[B, kv, tokens, heads, dim]`` (strided, no copy): ``pages_as_layers(c, l)[b]`` is
    ``block_layer_view(c, b, l)``. One copy through it moves a whole layer's blocks; ``RuntimeError`` where the
    pages' memory does not allow the view (a cache that is not contiguous across pages)."""
    b = pages.shape[0]
    h, n, c = layout.page_shape
    view: torch.Tensor
    if layout.mode == "split":
        view = pages.view(b, h, n, 2, c // 2).permute(0, 3, 2, 1, 4)
    elif layout.mode == "cpu":
        view = pages.view(b, h, 2, n, c // 2).permute(0, 2, 3, 1, 4)
    else:
        view = pages.permute(0, 2, 1, 3).unsqueeze(1)
    return view
