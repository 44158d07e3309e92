"""How many KV-cache tokens the engine may hold in flight (`--max-kv-tokens`).

A Metal out-of-memory is the most common way MLX servers die (mlx-lm#854): each sequence
in a batch grows its KV cache up to prompt + max_tokens, and eight 32k-token OCR outputs
at once outgrow a machine that runs each one easily. The engine therefore admits a new
sequence only while the sum of (prompt + max_tokens) over sequences in flight stays under
a budget; the default comes from the model's KV size per token and the memory left after
its weights.
"""

from __future__ import annotations

import os
from typing import Any

# Share of (machine memory - weights) the KV caches may use; the rest is activations,
# the vision tower, the feature cache and everything else on the machine.
KV_MEMORY_SHARE = 0.5
# Never below this: a budget smaller than one ordinary request helps no one.
MIN_KV_TOKENS = 4096


def kv_bytes_per_token(text_config: Any, dtype_bytes: int) -> int:
    """K and V, every layer, every KV head: the cache bytes one token costs."""
    layers = int(getattr(text_config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text_config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text_config, "num_key_value_heads", 0) or heads)
    head_dim = getattr(text_config, "head_dim", None)
    if not head_dim:
        hidden = int(getattr(text_config, "hidden_size", 0) or 0)
        head_dim = hidden // heads if heads else 0
    per_token = 2 * layers * kv_heads * int(head_dim) * dtype_bytes
    if per_token <= 0:
        raise ValueError("the model's text config does not give its KV size "
                         "(layers, heads, head_dim); pass --max-kv-tokens")
    return per_token


def default_max_kv_tokens(per_token: int, weight_bytes: int, memory_bytes: int) -> int:
    free = max(0, memory_bytes - weight_bytes)
    return max(MIN_KV_TOKENS, int(free * KV_MEMORY_SHARE) // per_token)


def machine_memory_bytes(device_info: dict[str, Any]) -> int:
    """Metal's recommended working set where there is one, else physical memory."""
    for key in ("max_recommended_working_set_size", "memory_size"):
        value = device_info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def model_budget(model: Any) -> tuple[int, int, int]:
    """(default budget, KV bytes per token, weight bytes) of a loaded mlx-vlm model.
    MLX thread only."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    flat: list[Any] = list(tree_flatten(model.parameters()))
    arrays = [pair[1] for pair in flat]
    weight_bytes = sum(int(a.nbytes) for a in arrays)
    floats = [a.dtype for a in arrays if mx.issubdtype(a.dtype, mx.floating)]
    dtype_bytes = floats[0].size if floats else 2
    text_config = getattr(model.config, "text_config", model.config)
    per_token = kv_bytes_per_token(text_config, dtype_bytes)
    memory = machine_memory_bytes(dict(mx.device_info()))
    return default_max_kv_tokens(per_token, weight_bytes, memory), per_token, weight_bytes
