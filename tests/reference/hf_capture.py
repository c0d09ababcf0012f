"""Capture HF boundary tensors with forward hooks over a prefill and single-token decode steps.

Per evaluation (the prompt as one batch, then one token at a time against HF's KV cache) and per layer:
the residual entering the layer, the `self_attn` output (O-projection, before the residual add), the
`mlp` output (before the residual add) and the layer output (a mixture of experts also its router's
logits and chosen experts); then the final-norm hidden state and the
logits, all for every row of the evaluation. Hooks are used rather than `output_hidden_states`, whose
last entry is the final-norm state, not the last layer's output (docs/families.md §0.5).

The attention and MLP outputs are each branch's contribution to the residual, as ember's stages define
them: OLMo 2's are its post-norms' outputs (`post_attention_layernorm`, `post_feedforward_layernorm`),
Granite's are the modules' outputs times `residual_multiplier` (transformers multiplies in the layer).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

__all__ = ["Evaluation", "capture", "load_hf_from_gguf"]

BOUNDARIES = ("before_layer", "after_attention", "after_mlp", "after_layer")


@dataclass
class Evaluation:
    """One forward call: rows are the evaluated tokens (positions start_position …)."""

    start_position: int
    token_ids: list[int]
    before_layer: list[np.ndarray] = field(default_factory=list)     # per layer, [T, H]
    after_attention: list[np.ndarray] = field(default_factory=list)  # per layer, [T, H]
    after_mlp: list[np.ndarray] = field(default_factory=list)        # per layer, [T, H]
    after_layer: list[np.ndarray] = field(default_factory=list)      # per layer, [T, H]
    router: list[np.ndarray] = field(default_factory=list)           # per MoE layer, [T, experts]
    chosen: list[np.ndarray] = field(default_factory=list)           # per MoE layer, [T, k] expert ids
    final_norm: np.ndarray | None = None                             # [T, H]
    logits: np.ndarray | None = None                                 # [T, V]


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _rows(tensor: torch.Tensor) -> np.ndarray:
    """[1, T, H] batch output to a float32 [T, H] copy."""
    return tensor.detach()[0].to(torch.float32).cpu().numpy().copy()


def _branches(layer: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The modules whose outputs are the attention's and the MLP's contributions to the residual."""
    if hasattr(layer, "post_feedforward_layernorm") and not hasattr(layer, "input_layernorm"):  # OLMo 2
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return layer.self_attn, layer.mlp


def _cache_kwarg(model: torch.nn.Module) -> str:
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def capture(model: torch.nn.Module, prompt_ids: list[int], decode_ids: list[int]) -> list[Evaluation]:
    """Run `prompt_ids` as one prefill, then each of `decode_ids` as a one-token step with the KV cache."""
    from transformers import DynamicCache

    decoder = model.model
    current: list[Evaluation] = []

    def on_layer_input(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            current[-1].before_layer.append(_rows(hidden))
        return hook

    def on_output(boundary, scale=1.0):
        def hook(module, args, output):
            getattr(current[-1], boundary).append(_rows(_first(output) * scale))
        return hook

    def on_router(module, args, output):  # a mixture's router: (logits, top-k weights, top-k experts)
        logits, _, chosen = output
        current[-1].router.append(logits.detach().to(torch.float32).cpu().numpy().copy())
        current[-1].chosen.append(chosen.detach().cpu().numpy().copy())

    def on_final_norm(module, args, output):
        current[-1].final_norm = _rows(output)

    handles = []
    residual_scale = getattr(model.config, "residual_multiplier", 1.0)  # Granite's
    for index, layer in enumerate(decoder.layers):
        attention, mlp = _branches(layer)
        handles.append(layer.register_forward_pre_hook(on_layer_input(index), with_kwargs=True))
        handles.append(attention.register_forward_hook(on_output("after_attention", residual_scale)))
        handles.append(mlp.register_forward_hook(on_output("after_mlp", residual_scale)))
        handles.append(layer.register_forward_hook(on_output("after_layer")))
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            handles.append(layer.mlp.gate.register_forward_hook(on_router))
    handles.append(decoder.norm.register_forward_hook(on_final_norm))

    evaluations: list[Evaluation] = []
    cache = DynamicCache(config=model.config)
    cache_kwarg = _cache_kwarg(model)
    steps = [list(prompt_ids)] + [[int(t)] for t in decode_ids]
    position = 0
    try:
        with torch.no_grad():
            for ids in steps:
                current.append(Evaluation(start_position=position, token_ids=ids))
                output = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True,
                               **{cache_kwarg: cache})
                current[-1].logits = _rows(output.logits)
                evaluations.append(current[-1])
                position += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    layers = len(decoder.layers)
    for evaluation in evaluations:
        for boundary in BOUNDARIES:
            if len(getattr(evaluation, boundary)) != layers:
                raise RuntimeError(f"captured {len(getattr(evaluation, boundary))} {boundary} tensors, "
                                   f"expected {layers}")
    return evaluations


def load_hf_from_gguf(path: str | Path, **config_overrides) -> torch.nn.Module:
    """transformers' own GGUF import (float32, eager attention) of a llama/qwen3 GGUF file.

    `config_overrides` fix what the import does not read, e.g. `head_dim` for qwen3 (it ignores
    `qwen3.attention.key_length` and assumes 128).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager",
        **config_overrides,
    )
    model.eval()
    return model
