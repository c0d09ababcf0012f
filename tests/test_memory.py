"""Memory estimates before load, the refusal of what cannot fit, and the float32 fallback without numba."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import ember
from ember.families import FAMILIES, config_from_gguf
from ember.gguf_file import GGUFFile
from ember.memory import GIB, MemoryLimitError, check_memory, estimate_memory, kv_cache_bytes


def _estimate(path, context: int, weights: str = "quantized"):
    gguf = GGUFFile.open(path)
    config = config_from_gguf(gguf)
    return estimate_memory(gguf, config, FAMILIES[config.architecture].cache_specs(config), context, weights)


def test_kv_cache_counts_full_layers_at_the_context_and_sliding_layers_at_their_window():
    specs = [(2, 64, 0), (2, 64, 512), (4, 128, 0)]
    assert kv_cache_bytes(specs, 100) == 2 * 4 * 100 * (2 * 64 + 2 * 64 + 4 * 128)
    assert kv_cache_bytes(specs, 4096) == 2 * 4 * (4096 * 2 * 64 + 512 * 2 * 64 + 4096 * 4 * 128)


def test_smollm2_estimate_follows_the_file_and_the_context(smollm2_path):
    gguf = GGUFFile.open(smollm2_path)
    quantized = _estimate(smollm2_path, 2048)
    assert quantized.weights == sum(t.nbytes for t in gguf.tensors.values())  # the file's tensor bytes
    # float32: every value 4 bytes, except the tied embedding's rows are read from the float32 head
    float32 = _estimate(smollm2_path, 2048, "float32")
    assert 5 * quantized.weights < float32.weights < 6 * quantized.weights
    # 30 layers, 3 KV heads of 64: 2 · 4 bytes · 30 · 3 · 64 = 46080 bytes a token
    assert quantized.kv_bytes_per_token == 46080
    assert _estimate(smollm2_path, 8192).kv_cache == 8192 * 46080


def test_a_model_that_cannot_fit_is_refused_with_the_figures_and_a_context_that_fits(smollm2_path):
    estimate = _estimate(smollm2_path, 8192)
    room = estimate.total - estimate.kv_cache + 1000 * estimate.kv_bytes_per_token
    with pytest.raises(MemoryLimitError) as caught:
        check_memory(estimate, "smollm2-135m", "quantized", available=room)
    message = str(caught.value)
    assert message.startswith("smollm2-135m needs about ") and "KV cache for 8192 tokens" in message
    assert "pass context_length=768 or less" in message  # 1000 tokens fit; rounded down to 256s
    check_memory(estimate, "smollm2-135m", "quantized", available=estimate.total)  # fits exactly: no error
    with pytest.raises(MemoryLimitError, match=r"keep the weights quantized \(weights='quantized'\)"):
        check_memory(_estimate(smollm2_path, 256, "float32"), "m", "float32", available=200 << 20)


def test_load_refuses_before_allocating_under_a_memory_limit(smollm2_path, monkeypatch):
    monkeypatch.setenv("EMBER_MEMORY_LIMIT", "300M")
    with pytest.raises(MemoryLimitError, match="but 300 MiB is available"):
        ember.load_model(smollm2_path, context_length=8192)
    monkeypatch.setenv("EMBER_MEMORY_LIMIT", "lots")
    with pytest.raises(ember.EmberError, match="EMBER_MEMORY_LIMIT='lots' is not a size"):
        ember.load_model(smollm2_path)
    monkeypatch.setenv("EMBER_MEMORY_LIMIT", f"{4 * GIB}")
    assert ember.load_model(smollm2_path, context_length=256).weights == "quantized"


@pytest.mark.parametrize("how", ["EMBER_DISABLE_JIT", "numba missing"])
def test_without_numba_ember_falls_back_to_float32_with_one_notice(smollm2_path, smollm2, how):
    block = "import sys; sys.modules['numba'] = None\n" if how == "numba missing" else ""
    code = block + (
        "import ember\n"
        f"m = ember.load_model({str(smollm2_path)!r}, context_length=256)\n"
        "print(m.weights, m.generate('The capital of France is', max_new_tokens=6).token_ids)\n"
    )
    env = {**os.environ, "EMBER_DISABLE_JIT": "1"} if how == "EMBER_DISABLE_JIT" else dict(os.environ)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    notices = [line for line in done.stderr.splitlines() if "dequantized to float32 instead" in line]
    assert len(notices) == 1 and notices[0].startswith("ember: ")
    weights, tokens = done.stdout.split(" ", 1)
    assert weights == "float32"
    assert tokens.strip() == str(smollm2.generate("The capital of France is", max_new_tokens=6).token_ids)
