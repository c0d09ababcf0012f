"""How much memory a model will need, estimated from its GGUF metadata before anything is allocated.

`estimate_memory` adds up the weights (the file's tensor bytes when they stay quantized, 4 bytes a value
for float32), the KV cache for the asked context (float32 keys and values of every layer that holds
them; sliding-window layers only their window), the activations of a prefill and the runtime (Python,
NumPy, numba/LLVM, the tokenizer). A mixture of experts' expert tensors (`…_exps.weight`, 3-D) kept
quantized are apart, `mapped`: they stay pages of the mapped file that a token reads only for the experts
it is routed to (Qwen3-30B-A3B: 8 of 128 a layer), page cache the kernel fills on demand and may drop
again, not memory the process holds; they are not in `total`, so an 18.6 GB Q4_K_M file whose experts
are 17 GB fits a 24 GB machine. The other weights are read whole for every token: counted as resident.
`check_memory` refuses a load that cannot fit in what the machine
(or its cgroup) has available, naming the figures and the context length that would fit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ember.errors import EmberError
from ember.gguf_file import GGUFFile

GIB = 1 << 30
# Python, NumPy, numba with its compiled kernels, MLflow-free engine imports and a 262k-token tokenizer:
# measured 0.21–0.33 GiB of resident memory before any weight (SmolLM2, Gemma 3, 2026-12-01).
RUNTIME_BYTES = 400 << 20
PREFILL_ROWS = 512  # the activations counted are those of a prefill of this many tokens (or the context)
QUERY_CHUNK = 128  # ember.ops.PREFILL_QUERY_CHUNK: rows of one attention score block
TILE_BYTES = 4 * 4 << 21  # up to 4 threads' scratch of ember.quant.matrix.TILE_VALUES float32 values
# Tables read only by rows: never held as float32, even in float32 mode (unless tied to the LM head).
ROW_TABLES = ("token_embd.weight", "per_layer_token_embd.weight")


class MemoryLimitError(EmberError):
    """The model would not fit in the memory this machine has available."""


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    activations: int
    runtime: int
    kv_bytes_per_token: int  # KV cache bytes per position of context (full-attention layers)
    context_length: int
    mapped: int = 0  # expert weights read from the mapped file as tokens route to them (not in `total`)

    @property
    def total(self) -> int:
        """The resident memory the load needs (the mapped expert weights are not in it)."""
        return self.weights + self.kv_cache + self.activations + self.runtime

    def describe(self) -> str:
        mapped = f", and {_gib(self.mapped)} of expert weights mapped from the file" if self.mapped else ""
        return (f"about {_gib(self.total)} (weights {_gib(self.weights)}, KV cache for "
                f"{self.context_length} tokens {_gib(self.kv_cache)}, activations {_gib(self.activations)}, "
                f"runtime {_gib(self.runtime)}{mapped})")


def _gib(size: float) -> str:
    return f"{size / GIB:.1f} GiB" if size >= GIB else f"{size / (1 << 20):.0f} MiB"


def kv_cache_bytes(specs: Sequence[tuple[int, int, int]], context_length: int) -> int:
    """float32 keys and values for layers given as (kv_heads, head_dim, window; 0 = full attention)."""
    total = 0
    for kv_heads, head_dim, window in specs:
        slots = min(window, context_length) if window else context_length
        total += 2 * kv_heads * slots * head_dim * 4
    return total


def estimate_memory(gguf: GGUFFile, config: object, cache_specs: Sequence[tuple[int, int, int]],
                    context_length: int, weights: str) -> MemoryEstimate:
    """The memory a load of `gguf` with this context and weight mode will need (see the module doc)."""
    tied = bool(getattr(config, "tied_embeddings", True))
    mapped = 0  # float32 mode dequantizes the experts too: resident
    if weights == "float32":
        weight_bytes = 0
        for name, info in gguf.tensors.items():
            read_by_rows = name in ROW_TABLES and not (tied and name == "token_embd.weight")
            values = 1
            for dim in info.shape:
                values *= dim
            weight_bytes += 0 if read_by_rows else 4 * values
    else:
        mapped = sum(info.nbytes for name, info in gguf.tensors.items() if is_expert_tensor(name, info.shape))
        weight_bytes = sum(info.nbytes for info in gguf.tensors.values()) - mapped
    hidden = int(config.hidden_size)
    feed_forward = int(config.feed_forward_length)
    heads = int(config.head_count)
    head_dim = int(config.head_dim)
    vocab = int(config.vocab_size)
    rows = min(PREFILL_ROWS, context_length)
    # hidden, normed, attention and MLP outputs, Q/K/V, gate/up and its scratch, attention heads
    per_row = 4 * hidden + 3 * heads * head_dim + 3 * feed_forward
    used = int(getattr(config, "expert_used_count", 0))
    if used:  # the mixture's scratch per (row, chosen expert) pair (ember.families.experts.ExpertScratch)
        expert_width = int(getattr(config, "expert_feed_forward_length", 0) or feed_forward)
        per_row += used * (3 * hidden + 3 * expert_width) + int(config.expert_count)
    scores = 2 * heads * min(QUERY_CHUNK, rows) * rows  # a score block and its mask, over the prompt's keys
    activations = 4 * (rows * per_row + scores + 2 * vocab) + TILE_BYTES
    full_specs = [(kv, hd, 0) for kv, hd, window in cache_specs if not window]
    return MemoryEstimate(
        weights=weight_bytes,
        kv_cache=kv_cache_bytes(cache_specs, context_length),
        activations=activations,
        runtime=RUNTIME_BYTES,
        kv_bytes_per_token=kv_cache_bytes(full_specs, 1),
        context_length=context_length,
        mapped=mapped,
    )


def is_expert_tensor(name: str, shape: Sequence[int]) -> bool:
    """Whether a tensor is a mixture's stacked experts (`blk.N.ffn_{gate,up,gate_up,down}_exps.weight`,
    [experts, out, in]): what `WeightStore.experts` reads expert by expert from the mapped file."""
    return len(shape) == 3 and name.endswith("_exps.weight")


LIMIT_ENV = "EMBER_MEMORY_LIMIT"  # e.g. "8G": plan with at most this much (a machine shared with others)


def parse_size(text: str) -> int:
    """Bytes from "8G", "512M", "1.5GiB", "4000000000"; ValueError otherwise."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (cleaned[:-1], cleaned[-1]) if cleaned[-1:] in units and cleaned[-1:] else (cleaned, "")
    value = float(number) * units[unit]
    if value <= 0:
        raise ValueError(text)
    return int(value)


def available_memory() -> int:
    """Bytes this process can still get: the system's available memory, or less under a cgroup limit or
    `$EMBER_MEMORY_LIMIT`."""
    import psutil

    available = int(psutil.virtual_memory().available)
    limit, used = _cgroup_file("memory.max"), _cgroup_file("memory.current")
    if limit is not None and used is not None:
        available = min(available, max(0, limit - used))
    cap = os.environ.get(LIMIT_ENV)
    if cap:
        try:
            available = min(available, parse_size(cap))
        except ValueError:
            raise EmberError(f"{LIMIT_ENV}={cap!r} is not a size (examples: 8G, 512M, 4000000000)") from None
    return available


def _cgroup_file(name: str) -> int | None:
    try:
        text = (Path("/sys/fs/cgroup") / name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def check_memory(estimate: MemoryEstimate, model_name: str, weights: str, available: int | None = None, *,
                 context_option: str = "context_length=",
                 weights_option: str = "weights='quantized'") -> None:
    """Raise MemoryLimitError, with the figures and the fix, when `estimate` exceeds what is available.

    `context_option` / `weights_option` spell the fixes as the caller's users write them (the runner:
    `model.context_length=`)."""
    available = available_memory() if available is None else available
    if estimate.total <= available:
        return
    fixed = estimate.total - estimate.kv_cache
    fixes = []
    if estimate.kv_bytes_per_token and fixed < available:
        fitting = (available - fixed) // estimate.kv_bytes_per_token
        fitting = min(fitting, estimate.context_length - 1)
        if fitting >= 256:
            fitting = fitting // 256 * 256
            fixes.append(f"pass {context_option}{fitting} or less")
    if weights == "float32":
        fixes.append(f"keep the weights quantized ({weights_option})")
    if not fixes:
        fixes.append("free memory or use a machine with more")
    raise MemoryLimitError(
        f"{model_name} needs {estimate.describe()} but {_gib(available)} is available: {' or '.join(fixes)}"
    )
