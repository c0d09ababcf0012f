"""Benchmarks comparing ember with llama.cpp and transformers (run `python -m benchmarks.bench`)."""
