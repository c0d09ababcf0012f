"""`head_patching` on SmolLM2 (IOI items), a tiny random Qwen3 (head_dim 32 ≠ hidden / heads) and a tiny
Gemma 2 (soft-capped attention, sliding layers, post-attention norm):

* every head of a layer patched at once is the layer's attention output patched (`activation_patching`,
  site attention, span all): these families' output projections have no bias;
* the batched, prefix-reusing passes equal full one-at-a-time prefills with a hook written per patch;
* a bad head or layer in the config ends the run with one readable line.

"Relative" = max |Δ| / max |reference| over the patched runs' logit differences (the metric the scores
are formed from).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ember import run as runner
from ember.data import load_prompt_set, parse_data_spec
from ember.experiments import Experiment
from ember.experiments.activation_patching import ActivationPatching
from ember.experiments.context import ExecutionPhase
from ember.experiments.head_patching import POSITIONS, HeadPatching
from ember.experiments.study import StudyItem
from ember.runs.study import run_item, run_items
from ember.runs.study_plan import study_item

TOLERANCE = 1e-5


def ioi_items(model, limit: int) -> list[StudyItem]:
    prompts = load_prompt_set(parse_data_spec({"path": "ember:ioi.jsonl", "limit": limit}))
    return [study_item(i, item, model.tokenizer) for i, item in enumerate(prompts.items)]


def patched_logit_differences(scores: np.ndarray, ld_clean: float, ld_corrupted: float) -> np.ndarray:
    """The patched runs' logit differences back from their restored shares."""
    return ld_corrupted + scores * (ld_clean - ld_corrupted)


def relative(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


# -- every head at once is the attention output ------------------------------------------------------

def all_heads_against_attention(model: Any, item: StudyItem, layers: list[int]) -> float:
    heads = HeadPatching(positions=["all"], layers=layers, together=True)
    result = run_item(model, heads, item)
    assert result is not None
    ours = heads.results().arrays[f"item{item.index}_restored"][0, :, 0]
    attention = run_item(model, ActivationPatching(sites=["attention"], layers=layers, span="all"), item)
    assert attention is not None
    theirs = np.array([attention.series["attention.all"][layer] for layer in layers])
    ld = (result.values["logit_diff_clean"], result.values["logit_diff_corrupted"])
    assert ld == (attention.values["logit_diff_clean"], attention.values["logit_diff_corrupted"])
    assert np.abs(ours).max() > 0.05  # some layer's heads matter: the comparison can fail
    return relative(patched_logit_differences(ours, *ld), patched_logit_differences(theirs, *ld))


def test_all_heads_of_a_layer_are_its_attention_output_smollm2(smollm2):
    item = ioi_items(smollm2, 1)[0]
    error = all_heads_against_attention(smollm2, item, [0, 8, 16, 22, 29])
    print(f"\n  SmolLM2: every head vs the attention output, relative {error:.1e}")
    assert error <= TOLERANCE


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from reference.gguf_writer import write_gguf
    from reference.tiny_models import tiny_qwen3

    import ember

    return ember.load_model(write_gguf(tiny_qwen3(), tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"))


def token_item(model: Any, clean: tuple[int, ...], corrupted: tuple[int, ...]) -> StudyItem:
    """An item of token ids: answer the clean run's top token, wrong answer the token the corruption
    favours most against it."""
    clean_logits, corrupted_logits = model.logits(list(clean))[-1], model.logits(list(corrupted))[-1]
    answer = int(np.argmax(clean_logits))
    shift = (corrupted_logits - clean_logits) - (corrupted_logits[answer] - clean_logits[answer])
    shift[answer] = -np.inf
    wrong = int(np.argmax(shift))
    return StudyItem(0, clean, "", corrupted_ids=corrupted, answer_ids=(answer,), wrong_answer_ids=(wrong,),
                     answer="a", wrong_answer="b", corrupted="c")


@pytest.mark.reference
def test_all_heads_of_a_layer_are_its_attention_output_qwen3(qwen3):
    clean = (40, 71, 100, 33, 259, 120, 87, 66, 200, 5)
    item = token_item(qwen3, clean, clean[:4] + (150,) + clean[5:])
    error = all_heads_against_attention(qwen3, item, [0, 1, 2])
    print(f"\n  tiny Qwen3: every head vs the attention output, relative {error:.1e}")
    assert error <= TOLERANCE


@pytest.mark.reference
def test_all_heads_of_a_layer_are_its_attention_output_gemma2(tmp_path):
    """Tiny Gemma 2: soft-capped attention logits, a window of 4 on layers 0 and 2, the post-attention
    norm after the output projection (all heads at once: the same normed output)."""
    pytest.importorskip("torch")
    from test_gemma2_tiny import PROMPT, tiny_gemma2, write_gemma2_gguf

    import ember

    model = ember.load_model(write_gemma2_gguf(tiny_gemma2(), tmp_path / "tiny-gemma2.gguf"))
    clean = tuple(PROMPT)
    item = token_item(model, clean, clean[:4] + (280,) + clean[5:])
    error = all_heads_against_attention(model, item, [0, 1, 2, 3])
    print(f"\n  tiny Gemma 2: every head vs the attention output, relative {error:.1e}")
    assert error <= TOLERANCE


@pytest.mark.reference
def test_all_heads_of_a_layer_are_its_attention_output_phi3(tmp_path):
    """Tiny Phi-3: heads from the fused qkv, partial rotary with LongRoPE."""
    pytest.importorskip("torch")
    from test_phi3_tiny import PROMPT, tiny_phi3, write_phi3_gguf

    import ember

    model = ember.load_model(write_phi3_gguf(tiny_phi3(), tmp_path / "tiny-phi3.gguf"))
    clean = tuple(PROMPT)
    item = token_item(model, clean, clean[:4] + (280,) + clean[5:])
    error = all_heads_against_attention(model, item, [0, 1, 2])
    print(f"\n  tiny Phi-3: every head vs the attention output, relative {error:.1e}")
    assert error <= TOLERANCE


# -- batched with prefix reuse = one at a time --------------------------------------------------------

class CleanHeads(Experiment):
    """Keeps every layer's prefill `attention_heads`."""

    name = "clean_heads"
    may_write = False

    def __init__(self) -> None:
        self.heads: dict[int, np.ndarray] = {}

    def attention_heads(self, ctx, heads):
        if ctx.execution.phase is ExecutionPhase.PREFILL:
            self.heads[ctx.layer_index] = heads.values().copy()


class PatchOneHead(Experiment):
    """Writes one head's clean output at some positions of one layer; keeps the prefill's logits."""

    name = "patch_one_head"
    may_write = True

    def __init__(self, clean: np.ndarray, layer: int, head: int, head_dim: int, positions: list[int]) -> None:
        self.clean, self.layer, self.positions = clean, layer, positions
        self.columns = slice(head * head_dim, (head + 1) * head_dim)
        self.logits: np.ndarray | None = None

    def attention_heads(self, ctx, heads):
        if ctx.execution.phase is ExecutionPhase.PREFILL and ctx.layer_index == self.layer:
            heads.values_mut()[self.positions, self.columns] = self.clean[self.positions, self.columns]

    def after_logits(self, ctx, logits):
        if ctx.phase is ExecutionPhase.PREFILL:
            self.logits = logits.values()[0].copy()


def one_at_a_time(model: Any, item: StudyItem, layers: list[int], heads: list[int]) -> np.ndarray:
    """[positions, layers, heads] patched logit differences, each from a full prefill of its own."""
    recorder = CleanHeads()
    model.generate(list(item.token_ids), max_new_tokens=1, experiments=[recorder])
    T = len(item.token_ids)
    differ = [p for p in range(T) if item.token_ids[p] != item.corrupted_ids[p]]
    chosen = {"all": list(range(differ[0], T)), "changed": differ, "last": [T - 1]}
    head_dim = recorder.heads[0].shape[1] // model.config.head_count
    out = np.zeros((len(POSITIONS), len(layers), len(heads)))
    for c, name in enumerate(POSITIONS):
        for j, layer in enumerate(layers):
            for g, head in enumerate(heads):
                patch = PatchOneHead(recorder.heads[layer], layer, head, head_dim, chosen[name])
                model.generate(list(item.corrupted_ids), max_new_tokens=1, experiments=[patch])
                assert patch.logits is not None
                out[c, j, g] = patch.logits[item.answer_id] - patch.logits[item.wrong_answer_id]
    return out


def test_batched_prefix_reuse_equals_one_at_a_time(smollm2):
    items = ioi_items(smollm2, 2)
    layers, heads = [0, 14, 22, 29], [0, 4, 8]
    patching = HeadPatching(layers=layers, heads=heads, figure_items=2)
    results = run_items(smollm2, patching, items)  # both items side by side: one batch per step
    arrays = patching.results().arrays
    worst = 0.0
    for item, result in zip(items, results, strict=True):
        assert result is not None
        ld = (result.values["logit_diff_clean"], result.values["logit_diff_corrupted"])
        ours = patched_logit_differences(arrays[f"item{item.index}_restored"], *ld)
        reference = one_at_a_time(smollm2, item, layers, heads)
        worst = max(worst, relative(ours, reference))
        assert np.abs(ours - ld[1]).max() > 0.05  # some patch moves the logit difference
    print(f"\n  batched + prefix reuse vs one at a time: relative {worst:.1e}")
    assert worst <= TOLERANCE
    assert arrays["mean_restored"].shape == (3, len(layers), len(heads))
    assert {"mean_restored", "item0_restored", "item1_restored"} <= set(patching.results().figures)
    table = patching.results().tables["heads"]
    assert len(table) == 3 * len(layers) * len(heads) and all(row["n"] == 2 for row in table)


# -- mistakes ----------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_outside_store")
@pytest.mark.parametrize(("args", "message"), [
    (["experiments.0.heads=[3,9]"], "head_patching: heads [9] are outside 0..8 (this model has 9 heads per "
                                    "layer)"),
    (["experiments.0.layers=[30]"], "layers[0]=30 is out of range: this model has 30 layers (0..29)"),
    (["experiments.0.positions=[first]"], "positions must be some of all, changed, last, got ['first']"),
])
def test_a_bad_head_or_layer_ends_with_one_line(workdir, capsys, args, message):
    code = runner.main(["data=ioi", "experiment=head_patching", *args, "mlflow=off", "threads=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: ") and message in lines[0], err
