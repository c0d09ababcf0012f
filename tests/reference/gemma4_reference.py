"""The transformers side of the Gemma 4 fidelity tests: a tiny `Gemma4ForCausalLM` and its boundary values.

`build_hf(spec, state)` makes a float32, eager-attention Gemma4ForCausalLM from a `Gemma4Spec` and loads
the given HF-named weights into it (every parameter and the `layer_scalar` buffers must be covered, which
also checks that `gemma4_gguf.hf_shapes` describes HF's real modules). `capture` runs a prefill and
one-token decode steps on HF's own KV cache and records, per evaluation and layer, Gemma 4's boundaries
(docs/families.md §3.6):

* before_layer: the residual entering the decoder layer;
* after_attention: the output of `post_attention_layernorm` (O projection, then the post-attention norm);
* after_mlp: the output of `post_feedforward_layernorm` (in a mixture-of-experts layer: of the dense FFN
  and the experts together);
* router (MoE layers): the router's logits, `router.proj`'s output, and the experts it chose (`router`'s
  top-k indices);
* after_layer: the decoder layer's output (after the residual adds, PLE and `layer_scalar`);
* final_norm: `model.norm`'s output; logits: `Gemma4ForCausalLM`'s logits (after the softcap).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from reference.gemma4_gguf import Gemma4Spec, hf_shapes

__all__ = ["Evaluation", "build_hf", "capture", "hf_state"]


def build_hf(spec: Gemma4Spec, state: dict[str, np.ndarray]) -> torch.nn.Module:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    experts = {"experts_implementation": "eager"} if spec.enable_moe_block else {}  # the per-expert loop
    config = Gemma4TextConfig(**spec.hf_kwargs(), **experts)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config).to(torch.float32).eval()
    target = model.state_dict()
    expected = set(target) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    if set(state) != expected or set(hf_shapes(spec)) != expected:
        raise ValueError(f"weights do not match HF's modules: missing {sorted(expected - set(state))}, "
                         f"extra {sorted(set(state) - expected)}")
    with torch.no_grad():
        for name, values in state.items():
            if tuple(target[name].shape) != values.shape:
                raise ValueError(f"{name}: shape {values.shape}, HF has {tuple(target[name].shape)}")
            target[name].copy_(torch.from_numpy(np.ascontiguousarray(values)))
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def hf_state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    tied = model.config.tie_word_embeddings
    return {name: tensor.detach().to(torch.float32).numpy().copy()
            for name, tensor in model.state_dict().items() if not (tied and name == "lm_head.weight")}


@dataclass
class Evaluation:
    """One forward call; rows are its tokens (positions start_position …)."""

    start_position: int
    token_ids: list[int]
    before_layer: list[np.ndarray] = field(default_factory=list)
    after_attention: list[np.ndarray] = field(default_factory=list)
    after_mlp: list[np.ndarray] = field(default_factory=list)
    after_layer: list[np.ndarray] = field(default_factory=list)
    router: list[np.ndarray] = field(default_factory=list)  # per MoE layer, [T, experts]
    chosen: list[np.ndarray] = field(default_factory=list)  # per MoE layer, [T, k] expert ids
    final_norm: np.ndarray | None = None
    logits: np.ndarray | None = None


def _rows(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach()[0].to(torch.float32).numpy().copy()


def capture(model: torch.nn.Module, prompt_ids: list[int], decode_ids: list[int]) -> list[Evaluation]:
    """Run `prompt_ids` as one prefill, then each of `decode_ids` as a one-token step on HF's cache."""
    from transformers import DynamicCache

    decoder = model.model
    current: list[Evaluation] = []

    def record(boundary: str, value: torch.Tensor) -> None:
        getattr(current[-1], boundary).append(_rows(value))

    def pre_layer(module, args, kwargs):
        record("before_layer", args[0] if args else kwargs["hidden_states"])

    def hook(boundary):
        def on_output(module, args, output):
            record(boundary, output[0] if isinstance(output, tuple) else output)
        return on_output

    def on_norm(module, args, output):
        current[-1].final_norm = _rows(output)

    def on_router_logits(module, args, output):  # router.proj: [T, experts]
        current[-1].router.append(output.detach().to(torch.float32).numpy().copy())

    def on_router(module, args, output):  # router: (probabilities, top-k weights, top-k experts)
        current[-1].chosen.append(output[2].detach().numpy().copy())

    handles = []
    for layer in decoder.layers:
        handles.append(layer.register_forward_pre_hook(pre_layer, with_kwargs=True))
        handles.append(layer.post_attention_layernorm.register_forward_hook(hook("after_attention")))
        handles.append(layer.post_feedforward_layernorm.register_forward_hook(hook("after_mlp")))
        handles.append(layer.register_forward_hook(hook("after_layer")))
        if getattr(layer, "enable_moe_block", False):
            handles.append(layer.router.proj.register_forward_hook(on_router_logits))
            handles.append(layer.router.register_forward_hook(on_router))
    handles.append(decoder.norm.register_forward_hook(on_norm))

    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    evaluations = []
    try:
        with torch.no_grad():
            position = 0
            for ids in [prompt_ids] + [[t] for t in decode_ids]:
                current.append(Evaluation(position, list(ids)))
                output = model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_kwarg: cache})
                current[-1].logits = _rows(output.logits)
                evaluations.append(current[-1])
                position += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    return evaluations
