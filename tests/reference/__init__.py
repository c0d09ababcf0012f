"""Test-only reference helpers: tiny random HF models, a converter-faithful GGUF writer, HF capture.

These modules import torch and transformers (the `test` extra). The product never imports them.
"""
