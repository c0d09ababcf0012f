"""Tokenizer speed: building from GGUF metadata, encoding 1 MB of English prose, decoding it back.

    python -m benchmarks.bench_tokenizer                     # SmolLM2-135M and the Gemma 4 fixture vocab
    python -m benchmarks.bench_tokenizer --repeats 5 --gemma3 --llama-cpp

Issue 3's targets: encoding 1 MB of English prose with SmolLM2's vocabulary in under 2 s, and building
the tokenizer from the 262k-token `gemma4` vocabulary (tests/data/vocab/ggml-vocab-gemma-4.gguf) in
under 2 s. Build time is from the metadata mapping (`Tokenizer.from_metadata`); reading the metadata
from the file (`GGUFFile.open(...).metadata`) is reported separately.

The prose is the docstrings of Python's standard library (English, deterministic for a Python
version), cut to 1,000,000 characters. Every encode starts with an empty word cache (a fresh
tokenizer), so the figure includes the BPE merges of every distinct word. With `--llama-cpp`,
llama.cpp's own tokenizer (llama-cpp-python, vocab_only) is timed on the same text for comparison.
Printed figures are medians over the repeats.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ember.gguf_file import GGUFFile
from ember.sources import resolve_model
from ember.tokenizer import Tokenizer

GEMMA4_VOCAB = Path(__file__).resolve().parent.parent / "tests" / "data" / "vocab" / "ggml-vocab-gemma-4.gguf"
SKIPPED_MODULES = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"}


def stdlib_prose(size: int = 1_000_000) -> str:
    """Docstrings of the standard library's public modules, classes and functions, `size` characters."""
    warnings.simplefilter("ignore")
    stdlib = sys.base_prefix
    names = sorted(
        m.name
        for m in pkgutil.iter_modules()
        if getattr(m.module_finder, "path", "").startswith(stdlib)
        and "site-packages" not in getattr(m.module_finder, "path", "")
        and not m.name.startswith("_")
        and m.name not in SKIPPED_MODULES
    )
    parts: list[str] = []
    total = 0
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # some stdlib modules need optional system libraries
            continue
        members = [module, *(v for k, v in sorted(vars(module).items()) if not k.startswith("_"))]
        for obj in members:
            if not (inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                parts.append(doc)
                total += len(doc) + 2
                if total >= size:
                    return "\n\n".join(parts)[:size]
    text = "\n\n".join(parts)
    return (text * (size // max(len(text), 1) + 1))[:size]


def median_time(function: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_vocab(label: str, path: Path, text: str, repeats: int, llama_cpp: bool) -> None:
    read_s, metadata = median_time(lambda: GGUFFile.open(path).metadata, repeats)
    build_s, tok = median_time(lambda: Tokenizer.from_metadata(metadata), repeats)
    print(f"{label}: {tok!r}")
    print(f"  read metadata  {read_s:7.3f} s")
    print(f"  build          {build_s:7.3f} s")
    if not text:
        return
    encode_s, ids = median_time(lambda: Tokenizer.from_metadata(metadata).encode(text), repeats)
    fresh = Tokenizer.from_metadata(metadata)
    fresh.encode(text)
    warm_s, _ = median_time(lambda: fresh.encode(text), repeats)
    decode_s, decoded = median_time(lambda: tok.decode(ids), repeats)
    mb = len(text.encode("utf-8")) / 1e6
    rate = len(text) / encode_s / 1e6
    print(f"  encode {mb:.2f} MB  {encode_s:7.3f} s  ({rate:.2f} M chars/s, {len(ids)} tokens)")
    print(f"  encode again   {warm_s:7.3f} s  (word cache warm)")
    print(f"  decode         {decode_s:7.3f} s  (round trip {'exact' if decoded == text else 'differs'})")
    if llama_cpp:
        bench_llama_cpp(path, text, ids, repeats)


def bench_llama_cpp(path: Path, text: str, ids: object, repeats: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    data = text.encode("utf-8")
    size = len(data) + 16
    buffer = (llama_cpp.llama_token * size)()

    def tokenize() -> list[int]:
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buffer, size, True, False)
        return list(buffer[:n])

    seconds, theirs = median_time(tokenize, repeats)
    print(f"  llama.cpp encode {seconds:5.3f} s  (same ids: {theirs == ids})")
    llama_cpp.llama_model_free(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gemma3", action="store_true", help="also Gemma 3 270M (a ~240 MB download)")
    parser.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (llama-cpp-python)")
    args = parser.parse_args()
    text = stdlib_prose()
    bench_vocab("SmolLM2-135M", resolve_model("smollm2-135m").path, text, args.repeats, args.llama_cpp)
    bench_vocab("Gemma 4 vocab fixture", GEMMA4_VOCAB, text, args.repeats, args.llama_cpp)
    if args.gemma3:
        bench_vocab("Gemma 3 270M", resolve_model("gemma3-270m").path, text, args.repeats, args.llama_cpp)


if __name__ == "__main__":
    main()
