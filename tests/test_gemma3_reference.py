"""Gemma 3 270M (the real Q4_K_M file) against transformers loading the same GGUF, float32, eager.

Both sides get the same exact token ids. Per evaluation (the prompt as one batch, then single-token
decode steps fed ember's greedy tokens) and per layer, the Gemma boundaries of the hook contract are
compared: the layer input, `after_attention` (HF `post_attention_layernorm` output), `after_mlp` (HF
`post_feedforward_layernorm` output) and the layer output, then the final-norm row and the logits.

Prompts: a short one; one of 508 tokens whose decode steps cross the 512-token window; one of about
600 tokens, so the prefill itself needs the sliding mask.

Run `python tests/test_gemma3_reference.py` to print the figures.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ember
from ember.experiments import Experiment, TensorAccess

pytestmark = [pytest.mark.slow, pytest.mark.reference]

LAYER_BOUNDARIES = ("before_layer", "after_attention", "after_mlp", "after_layer")
# max|Δ| / max|reference| per layer and evaluation. Layer outputs (before_layer/after_layer) to 1e-4. The
# attention and MLP outputs are normed and then added to a residual stream up to ~2300 in size, so their
# float32 rounding noise is larger relative to their own maximum: at the worst point seen (counting
# prompt, layer 15 attention), transformers float32 itself is 8.6e-5 away from transformers float64.
LAYER_RELATIVE_TOLERANCE = 1e-4
SUBLAYER_RELATIVE_TOLERANCE = 5e-4
LOGITS_ABSOLUTE_TOLERANCE = 1e-3
WINDOW = 512

CAPITALS = (
    "France Paris; Germany Berlin; Italy Rome; Spain Madrid; Portugal Lisbon; Austria Vienna; Greece Athens; "
    "Norway Oslo; Sweden Stockholm; Finland Helsinki; Denmark Copenhagen; Poland Warsaw; Hungary Budapest; "
    "Ireland Dublin; Belgium Brussels; Netherlands Amsterdam; Switzerland Bern; Czechia Prague; "
    "Slovakia Bratislava; Romania Bucharest; Bulgaria Sofia; Serbia Belgrade; Croatia Zagreb; Ukraine Kyiv; "
    "Russia Moscow; Turkey Ankara; Egypt Cairo; Morocco Rabat; Tunisia Tunis; Algeria Algiers; "
    "Nigeria Abuja; Ghana Accra; Kenya Nairobi; Ethiopia Addis Ababa; Senegal Dakar; Japan Tokyo; "
    "China Beijing; India New Delhi; Pakistan Islamabad; Thailand Bangkok; Vietnam Hanoi; Indonesia Jakarta; "
    "Malaysia Kuala Lumpur; Philippines Manila; Iran Tehran; Iraq Baghdad; Israel Jerusalem; Canada Ottawa; "
    "Mexico Mexico City; Cuba Havana; Jamaica Kingston; Colombia Bogota; Peru Lima; Chile Santiago; "
    "Argentina Buenos Aires; Uruguay Montevideo; Brazil Brasilia; Venezuela Caracas; Ecuador Quito; "
    "Bolivia Sucre; Australia Canberra; New Zealand Wellington; South Korea Seoul; Mongolia Ulaanbaatar; "
    "Nepal Kathmandu; Qatar Doha; Lebanon Beirut; Syria Damascus; Jordan Amman; "
    "Saudi Arabia Riyadh; Oman Muscat"
)


def capitals_prompt() -> str:
    pairs = [entry.strip().split(" ", 1) for entry in CAPITALS.split(";")]
    lines = "".join(f"The capital of {country} is {city}.\n" for country, city in pairs)
    return "Here is a list of countries and their capital cities.\n" + lines + "The capital of Iceland is"


def counting_prompt(last: int = 117) -> str:
    numbers = ", ".join(str(i) for i in range(1, last + 1))
    return ("Counting is one of the first things children learn at school. Here are the numbers from one to "
            f"two hundred, written with digits and separated by commas: {numbers},")


# name → (text, decode steps)
PROMPTS = {
    "short": ("The capital of France is", 8),
    "crosses_window_in_decode": (counting_prompt(), 12),
    "longer_than_window": (capitals_prompt(), 6),
}


# --------------------------------------------------------------------------- captures


@dataclass
class Evaluation:
    """One forward call's boundary tensors, each [T, H] per layer (logits: last row on ember's side)."""

    start_position: int
    token_count: int
    layers: dict[str, list[np.ndarray]] = field(default_factory=lambda: {b: [] for b in LAYER_BOUNDARIES})
    final_norm: np.ndarray | None = None
    logits: np.ndarray | None = None


class Capture(Experiment):
    """Observation only: copies every boundary tensor of every evaluation."""

    name = "gemma3_fidelity_capture"

    def __init__(self) -> None:
        self.evaluations: list[Evaluation] = []

    def _layer(self, boundary: str, ctx: Any, tensor: TensorAccess) -> None:
        execution = ctx.execution
        if boundary == "before_layer" and ctx.layer_index == 0:
            self.evaluations.append(Evaluation(execution.start_position, execution.input_token_count))
        self.evaluations[-1].layers[boundary].append(tensor.values().copy())

    def before_layer(self, ctx, hidden): self._layer("before_layer", ctx, hidden)
    def after_attention(self, ctx, attention_output): self._layer("after_attention", ctx, attention_output)
    def after_mlp(self, ctx, mlp_output): self._layer("after_mlp", ctx, mlp_output)
    def after_layer(self, ctx, hidden): self._layer("after_layer", ctx, hidden)

    def before_logits(self, ctx, hidden):
        self.evaluations[-1].final_norm = hidden.values().copy()

    def after_logits(self, ctx, logits):
        self.evaluations[-1].logits = logits.values().copy()


def hf_capture(hf_model: Any, prompt_ids: list[int], decode_ids: list[int]) -> list[Evaluation]:
    """Prefill then one-token steps on HF's own cache, with forward hooks at the Gemma boundaries."""
    import torch
    from transformers import DynamicCache

    decoder = hf_model.model
    evaluations: list[Evaluation] = []

    def rows(tensor: Any) -> np.ndarray:
        tensor = tensor[0] if isinstance(tensor, tuple) else tensor
        return tensor.detach()[0].to(torch.float32).numpy().copy()

    def keep(boundary: str, *, layer_input: bool = False):
        def hook(module, args, kwargs_or_output, *rest):
            if layer_input:
                value = args[0] if args else kwargs_or_output["hidden_states"]
            else:
                value = rest[0] if rest else kwargs_or_output
            evaluations[-1].layers[boundary].append(rows(value))
        return hook

    handles = []
    for layer in decoder.layers:
        layer_input = keep("before_layer", layer_input=True)
        handles.append(layer.register_forward_pre_hook(layer_input, with_kwargs=True))
        handles.append(layer.post_attention_layernorm.register_forward_hook(keep("after_attention")))
        handles.append(layer.post_feedforward_layernorm.register_forward_hook(keep("after_mlp")))
        handles.append(layer.register_forward_hook(keep("after_layer")))

    def on_final_norm(module, args, output):
        evaluations[-1].final_norm = rows(output)

    handles.append(decoder.norm.register_forward_hook(on_final_norm))
    cache = DynamicCache(config=hf_model.config)
    parameters = inspect.signature(hf_model.forward).parameters
    cache_argument = "cache" if "cache" in parameters else "past_key_values"  # renamed in transformers 5.x
    position = 0
    try:
        with torch.no_grad():
            for ids in [list(prompt_ids)] + [[t] for t in decode_ids]:
                evaluations.append(Evaluation(position, len(ids)))
                output = hf_model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1,
                                  **{cache_argument: cache})
                evaluations[-1].logits = rows(output.logits)
                position += len(ids)
    finally:
        for handle in handles:
            handle.remove()
    return evaluations


# --------------------------------------------------------------------------- comparison


def relative(ours: np.ndarray, reference: np.ndarray) -> float:
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


@dataclass
class Comparison:
    prompt_tokens: int
    generated: list[int]
    text: str
    worst_layer: tuple[float, str]  # (relative Δ, where) over layer inputs and outputs
    worst_sublayer: tuple[float, str]  # (relative Δ, where) over after_attention and after_mlp
    worst_logits: tuple[float, str]  # (max |Δ|, where)
    worst_final_norm: float


def compare(model: Any, hf_model: Any, text: str, steps: int) -> Comparison:
    prompt_ids = model.tokenize(text)
    capture = Capture()
    generation = model.generate(prompt_ids, max_new_tokens=steps + 1, experiments=[capture],
                                stop_at_eog=False)
    ours = capture.evaluations
    theirs = hf_capture(hf_model, prompt_ids, generation.token_ids[:steps])
    assert len(ours) == len(theirs) == steps + 1
    worst_layer = worst_sublayer = (0.0, "")
    worst_logits = (0.0, "")
    worst_final = 0.0
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert (a.start_position, a.token_count) == (b.start_position, b.token_count)
        where = "prefill" if index == 0 else f"decode@{a.start_position}"
        for boundary in LAYER_BOUNDARIES:
            for layer, (x, y) in enumerate(zip(a.layers[boundary], b.layers[boundary], strict=True)):
                found = (relative(x, y), f"{where} layer {layer} {boundary}")
                if boundary in ("before_layer", "after_layer"):
                    worst_layer = max(worst_layer, found)
                else:
                    worst_sublayer = max(worst_sublayer, found)
        worst_final = max(worst_final, relative(a.final_norm, b.final_norm[-1:]))
        worst_logits = max(worst_logits, (float(np.max(np.abs(a.logits - b.logits))), where))
        assert int(np.argmax(a.logits)) == int(np.argmax(b.logits)), where
    return Comparison(len(prompt_ids), generation.token_ids, generation.text, worst_layer, worst_sublayer,
                      worst_logits, worst_final)


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def model() -> Any:
    return ember.load_model("gemma3-270m", context_length=1024)


@pytest.fixture(scope="module")
def hf_model(gemma3_path: Path) -> Any:
    return load_hf(gemma3_path)


def load_hf(path: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="eager")
    hf.eval()
    return hf


def test_transformers_imports_the_config_right(model: Any, hf_model: Any) -> None:
    """docs/families.md §5: the import leaves pattern, local rope base and query scalar to class defaults;
    check they are right for this file and agree with ember's reading of it."""
    hf, ours = hf_model.config, model.config
    assert hf.model_type == "gemma3_text"
    assert hf.sliding_window == ours.sliding_window == WINDOW
    expected_types = ["full_attention" if layer % 6 == 5 else "sliding_attention" for layer in range(18)]
    assert hf.layer_types == expected_types
    assert [t == "sliding_attention" for t in hf.layer_types] == list(ours.sliding_layers)
    assert hf.rope_parameters["sliding_attention"]["rope_theta"] == ours.rope_base_swa == 10000.0
    assert hf.rope_parameters["full_attention"]["rope_theta"] == ours.rope_base == 1e6
    assert hf.rope_parameters["full_attention"]["rope_type"] == "default" and ours.rope_linear_factor == 1.0
    assert hf.query_pre_attn_scalar ** -0.5 == ours.attention_scale == 1 / 16
    assert hf.final_logit_softcapping is None and ours.final_logit_softcap == 0.0
    assert hf.attn_logit_softcapping is None
    assert hf.head_dim == ours.head_dim == 256 and hf.num_key_value_heads == ours.head_count_kv == 1
    assert hf.vocab_size == ours.vocab_size == 262144 and hf.tie_word_embeddings
    # HF holds w and multiplies by (1 + w); the file (and ember) hold 1 + w.
    ours_norm = model.gguf.dequantize("blk.0.attn_norm.weight")
    hf_norm = hf_model.model.layers[0].input_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(1.0 + hf_norm, ours_norm, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_boundaries_and_logits_match_transformers(model: Any, hf_model: Any, name: str) -> None:
    text, steps = PROMPTS[name]
    result = compare(model, hf_model, text, steps)
    if name == "crosses_window_in_decode":
        assert result.prompt_tokens < WINDOW < result.prompt_tokens + steps
    if name == "longer_than_window":
        assert result.prompt_tokens > WINDOW + 64
    assert result.worst_layer[0] <= LAYER_RELATIVE_TOLERANCE, result.worst_layer
    assert result.worst_sublayer[0] <= SUBLAYER_RELATIVE_TOLERANCE, result.worst_sublayer
    assert result.worst_final_norm <= LAYER_RELATIVE_TOLERANCE
    assert result.worst_logits[0] <= LOGITS_ABSOLUTE_TOLERANCE, result.worst_logits


def test_all_position_logits_match_transformers(model: Any, hf_model: Any) -> None:
    """`Model.logits` (every row of a clean prefill) against HF's full logits, on the short prompt."""
    import torch

    ids = model.tokenize(PROMPTS["short"][0])
    ours = model.logits(ids)
    with torch.no_grad():
        theirs = hf_model(input_ids=torch.tensor([ids])).logits[0].numpy()
    assert float(np.max(np.abs(ours - theirs))) <= LOGITS_ABSOLUTE_TOLERANCE


def test_greedy_continuations_are_sensible(model: Any) -> None:
    counting = model.generate(counting_prompt(), max_new_tokens=20).text
    assert counting.strip().startswith("118, 119, 120, 121"), counting
    capitals = model.generate(capitals_prompt(), max_new_tokens=4).text
    assert capitals.strip().startswith("Reykjavik"), capitals


if __name__ == "__main__":
    from ember.sources import resolve_model

    gemma = ember.load_model("gemma3-270m", context_length=1024)
    reference_model = load_hf(resolve_model("gemma3-270m").path)
    for prompt_name, (prompt_text, decode_steps) in PROMPTS.items():
        r = compare(gemma, reference_model, prompt_text, decode_steps)
        print(f"{prompt_name}: {r.prompt_tokens} prompt tokens + {decode_steps} decode steps")
        print(f"  worst layer output: {r.worst_layer[0]:.2e} relative ({r.worst_layer[1]})")
        print(f"  worst attention/MLP output: {r.worst_sublayer[0]:.2e} relative ({r.worst_sublayer[1]})")
        print(f"  worst final norm: {r.worst_final_norm:.2e} relative")
        print(f"  worst logits: {r.worst_logits[0]:.2e} absolute ({r.worst_logits[1]})")
        print(f"  greedy: {r.text!r}")
