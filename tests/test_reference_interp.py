"""ember's logit lens and activation patching against nnsight on transformers' float32 import of the same
SmolLM2 GGUF (nnsight wraps the torch model; the readout there is the model's own `model.norm` and
`lm_head`, the patches are nnsight interventions on the decoder layers' inputs, attention and MLP outputs).

Checked within 1e-3 (absolute):
* logit lens: per layer, the answer's probability and the top-5 probabilities at the last position, on
  three capitals items;
* activation patching: the share of the logit difference restored, per (site, layer, position), on two
  capitals items, all three sites, every fifth layer and the last, every position from the first changed
  token (each nnsight pass is a traced torch forward: every layer would take half an hour on 2 cores);
* head patching: the same share per (position class, layer, head), the clean run's head outputs written
  at the input of each layer's `o_proj` (transformers' per-head outputs, heads side by side), on two IOI
  items, every head of every fifth layer and the last, all three position classes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
nnsight = pytest.importorskip("nnsight")

from reference.hf_capture import load_hf_from_gguf  # noqa: E402

from ember.data import load_prompt_set, parse_data_spec  # noqa: E402
from ember.experiments.activation_patching import ActivationPatching  # noqa: E402
from ember.experiments.head_patching import POSITIONS, HeadPatching  # noqa: E402
from ember.experiments.logit_lens import LogitLens  # noqa: E402
from ember.runs.study import run_item  # noqa: E402
from ember.runs.study_plan import study_item  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.slow]

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def hf_model(smollm2_path):
    return load_hf_from_gguf(smollm2_path)


@pytest.fixture(scope="module")
def items(smollm2):
    prompts = load_prompt_set(parse_data_spec({"path": "ember:capitals.jsonl", "limit": 3}))
    return [study_item(i, item, smollm2.tokenizer) for i, item in enumerate(prompts.items)]


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def nnsight_layer_outputs(hf_model, ids: list[int]) -> list[np.ndarray]:
    """Every decoder layer's output at the last position, through nnsight."""
    wrapped = nnsight.NNsight(hf_model)
    saved: list = []
    with torch.no_grad(), wrapped.trace(torch.tensor([ids])):
        for layer in wrapped.model.layers:
            saved.append(layer.output.save())
    return [_first(s)[0, -1].float() for s in saved]


def test_logit_lens_matches_nnsight(smollm2, hf_model, items):
    worst = 0.0
    for item in items:
        lens = LogitLens(top_k=5, figure_items=0)
        result = run_item(smollm2, lens, item)
        ours = np.array([result.series["target_prob"][layer] for layer in range(smollm2.config.layer_count)])
        rows = nnsight_layer_outputs(hf_model, list(item.token_ids))
        with torch.no_grad():
            stacked = torch.stack(rows)
            logits = hf_model.lm_head(hf_model.model.norm(stacked)).double()
            theirs_probs = torch.softmax(logits, dim=-1).numpy()
        theirs = theirs_probs[:, item.answer_id]
        worst = max(worst, float(np.abs(ours - theirs).max()))
        for row in lens.results().tables["top_tokens"]:
            worst = max(worst, abs(row["prob"] - float(theirs_probs[row["layer"], row["token_id"]])))
    print(f"\n  logit lens: max |Δ probability| vs nnsight {worst:.2e} over {len(items)} items")
    assert worst <= TOLERANCE


def nnsight_patching(hf_model, item, sites, layers) -> np.ndarray:
    """The same scores as ActivationPatching(span='each'), computed with nnsight interventions."""
    wrapped = nnsight.NNsight(hf_model)
    clean_ids = torch.tensor([list(item.token_ids)])
    corrupt_ids = torch.tensor([list(item.corrupted_ids)])
    answer, wrong = item.answer_id, item.wrong_answer_id
    first = int(np.flatnonzero(np.array(item.token_ids) != np.array(item.corrupted_ids))[0])
    recorded: dict = {}
    with torch.no_grad(), wrapped.trace(clean_ids):
        for i, layer in enumerate(wrapped.model.layers):
            recorded[("residual", i)] = layer.input.save()
            recorded[("attention", i)] = _first_output(layer.self_attn).save()
            recorded[("mlp", i)] = layer.mlp.output.save()
        recorded["logits"] = wrapped.lm_head.output.save()
    with torch.no_grad():
        clean = recorded["logits"][0, -1]
        corrupt = hf_model(corrupt_ids).logits[0, -1]
    ld_clean = float(clean[answer] - clean[wrong])
    ld_corrupt = float(corrupt[answer] - corrupt[wrong])
    T = len(item.token_ids)
    scores = np.zeros((len(sites), len(layers), T))
    for s, site in enumerate(sites):
        for j, layer_index in enumerate(layers):
            for position in range(first, T):
                clean_rows = recorded[(site, layer_index)]
                out: dict = {}
                with torch.no_grad(), wrapped.trace(corrupt_ids):
                    layer = wrapped.model.layers[layer_index]
                    if site == "residual":
                        layer.input[0, position] = clean_rows[0, position]
                    elif site == "attention":
                        _first_output(layer.self_attn)[0, position] = clean_rows[0, position]
                    else:
                        layer.mlp.output[0, position] = clean_rows[0, position]
                    out["logits"] = wrapped.lm_head.output.save()
                patched = out["logits"][0, -1]
                ld = float(patched[answer] - patched[wrong])
                scores[s, j, position] = (ld - ld_corrupt) / (ld_clean - ld_corrupt)
    return scores


def _first_output(envoy):
    output = envoy.output
    return output[0] if isinstance(output, tuple) else output


PATCH_LAYERS = [0, 5, 10, 15, 20, 25, 29]


def test_patching_scores_match_nnsight(smollm2, hf_model, items):
    sites = ["residual", "attention", "mlp"]
    worst = 0.0
    for item in items[:2]:
        item_scores = _item_scores(smollm2, item, sites)
        theirs = nnsight_patching(hf_model, item, sites, PATCH_LAYERS)
        worst = max(worst, float(np.abs(item_scores - theirs).max()))
    print(f"\n  activation patching: max |Δ restored share| vs nnsight {worst:.2e}")
    assert worst <= TOLERANCE


def _item_scores(model, item, sites) -> np.ndarray:
    """ember's per-(site, layer, position) scores of one item (the figure array of that item)."""
    patching = ActivationPatching(sites=sites, layers=PATCH_LAYERS, figure_items=1)
    run_item(model, patching, item)
    return patching.results().arrays[f"item{item.index}_restored"]


def nnsight_head_patching(hf_model, item, layers) -> np.ndarray:
    """The same scores as HeadPatching(layers=layers) ([positions, layers, heads]), with nnsight writing
    the clean run's head outputs into the input of `o_proj` in the corrupted run."""
    wrapped = nnsight.NNsight(hf_model)
    clean_ids = torch.tensor([list(item.token_ids)])
    corrupt_ids = torch.tensor([list(item.corrupted_ids)])
    answer, wrong = item.answer_id, item.wrong_answer_id
    heads, head_dim = hf_model.config.num_attention_heads, hf_model.config.head_dim
    T = len(item.token_ids)
    differ = [p for p in range(T) if item.token_ids[p] != item.corrupted_ids[p]]
    chosen = {"all": list(range(differ[0], T)), "changed": differ, "last": [T - 1]}
    recorded: dict = {}
    with torch.no_grad(), wrapped.trace(clean_ids):
        for layer in layers:
            recorded[layer] = wrapped.model.layers[layer].self_attn.o_proj.input.save()
    with torch.no_grad():
        clean = hf_model(clean_ids).logits[0, -1]
        corrupt = hf_model(corrupt_ids).logits[0, -1]
    ld_clean = float(clean[answer] - clean[wrong])
    ld_corrupt = float(corrupt[answer] - corrupt[wrong])
    scores = np.zeros((len(POSITIONS), len(layers), heads))
    for c, name in enumerate(POSITIONS):
        for j, layer in enumerate(layers):
            for head in range(heads):
                columns = slice(head * head_dim, (head + 1) * head_dim)
                out: dict = {}
                with torch.no_grad(), wrapped.trace(corrupt_ids):
                    heads_input = wrapped.model.layers[layer].self_attn.o_proj.input
                    for position in chosen[name]:
                        heads_input[0, position, columns] = recorded[layer][0, position, columns]
                    out["logits"] = wrapped.lm_head.output.save()
                patched = out["logits"][0, -1]
                ld = float(patched[answer] - patched[wrong])
                scores[c, j, head] = (ld - ld_corrupt) / (ld_clean - ld_corrupt)
    return scores


def test_head_patching_scores_match_nnsight(smollm2, hf_model):
    prompts = load_prompt_set(parse_data_spec({"path": "ember:ioi.jsonl", "limit": 2}))
    items = [study_item(i, item, smollm2.tokenizer) for i, item in enumerate(prompts.items)]
    worst = 0.0
    for item in items:
        patching = HeadPatching(layers=PATCH_LAYERS, figure_items=1)
        run_item(smollm2, patching, item)
        ours = patching.results().arrays[f"item{item.index}_restored"]
        theirs = nnsight_head_patching(hf_model, item, PATCH_LAYERS)
        assert ours.shape == theirs.shape
        worst = max(worst, float(np.abs(ours - theirs).max()))
    print(f"\n  head patching: max |Δ restored share| vs nnsight {worst:.2e}")
    assert worst <= TOLERANCE
