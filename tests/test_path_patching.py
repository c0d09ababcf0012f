"""`path_patching` against an independent reference on transformers float32 (eager attention), tiny
random Qwen3 (4 query heads over 2 KV heads, head_dim 32, QK-norm):

* the reference runs the three passes over whole sequences in torch: each head's output hooked at the
  output projection's input; queries and keys/values hooked inside HF's eager attention function, the
  keys and values repeated per query head first (TransformerLens' ungrouped GQA), so a receiver's k or
  v is its own;
* every sender head swept to the logits, to q receivers in two layers, to a v receiver (whose KV head
  another head reads), to k receivers and to v receivers in two layers (a chain of runs): the patched
  logit differences agree within 1e-4 relative (max |Δ| / max |reference|, as
  tests/test_head_patching.py) and the scores (over the clean–corrupted gap) within 1e-4;
* identities: the last layer's heads as senders to the logits are a plain patched run (their direct
  effect); every head as a sender to the logits gives the corrupted run's logits (score −1; also on
  SmolLM2 IOI items, slow); receivers before every sender score exactly 0;
* bad parameters end the run with one line naming the parameter.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from ember import run as runner
from ember.data import load_prompt_set, parse_data_spec
from ember.experiments import Experiment
from ember.experiments.context import ExecutionPhase
from ember.experiments.path_patching import PathPatching
from ember.experiments.study import StudyItem
from ember.runs.study import run_item, run_items
from ember.runs.study_plan import study_item

TOLERANCE = 1e-4
CLEAN = (40, 71, 100, 33, 259, 120, 87, 66, 200, 5)
CORRUPTED = CLEAN[:4] + (150,) + CLEAN[5:]


def patched_logit_differences(scores: np.ndarray, ld_clean: float, ld_corrupted: float) -> np.ndarray:
    """The patched runs' logit differences back from their scores."""
    return ld_clean + scores * (ld_clean - ld_corrupted)


def relative(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, StudyItem]:
    """(transformers model, ember model, an item): answer the clean run's top token, wrong answer the
    token the corruption favours most against it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from reference.gguf_writer import write_gguf
    from reference.tiny_models import tiny_qwen3

    import ember

    hf = tiny_qwen3()
    model = ember.load_model(write_gguf(hf, tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"))
    clean_logits, corrupted_logits = model.logits(list(CLEAN))[-1], model.logits(list(CORRUPTED))[-1]
    answer = int(np.argmax(clean_logits))
    shift = (corrupted_logits - clean_logits) - (corrupted_logits[answer] - clean_logits[answer])
    shift[answer] = -np.inf
    wrong = int(np.argmax(shift))
    item = StudyItem(0, CLEAN, "", corrupted_ids=CORRUPTED, answer_ids=(answer,), wrong_answer_ids=(wrong,),
                     answer="a", wrong_answer="b", corrupted="c")
    return hf, model, item


# -- the reference ----------------------------------------------------------------------------------

class Reference:
    """Path patching in torch on a transformers model, whole sequences, no reuse of anything."""

    def __init__(self, hf: Any, item: StudyItem) -> None:
        self.hf, self.item = hf, item
        config = hf.config
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.mode = ""
        self.senders: list[tuple[int, int]] = []
        self.receivers: list[tuple[int, int]] = []
        self.channel = "q"
        self.z: dict[tuple[str, int], Any] = {}       # (run, layer) → o_proj input [T, heads × head_dim]
        self.inputs: dict[int, dict[str, Any]] = {}   # layer → channel → [heads, T, head_dim]
        with self.hooked():
            self.ld_clean = self.run("clean", item.token_ids)
            self.ld_corrupted = self.run("corrupted", item.corrupted_ids)

    @contextmanager
    def hooked(self):
        import torch

        module = sys.modules[type(self.hf.model.layers[0].self_attn).__module__]
        original = module.eager_attention_forward

        def eager(attention, query, key, value, *args, **kwargs):
            i, groups = attention.layer_idx, attention.num_key_value_groups
            tensors = {"q": query.clone(), "k": key.repeat_interleave(groups, dim=1),
                       "v": value.repeat_interleave(groups, dim=1)}
            if self.mode == "send":
                self.inputs[i] = {c: t[0].clone() for c, t in tensors.items()}
            elif self.mode == "receive":
                for layer, head in self.receivers:
                    if layer == i:
                        tensors[self.channel][0, head] = self.inputs[i][self.channel][head]
            attention.num_key_value_groups = 1  # keys and values are per query head already
            try:
                return original(attention, tensors["q"], tensors["k"], tensors["v"], *args, **kwargs)
            finally:
                attention.num_key_value_groups = groups

        def o_proj(i):
            def hook(_, args):
                (x,) = args
                if self.mode in ("clean", "corrupted"):
                    self.z[(self.mode, i)] = x[0].clone()
                elif self.mode == "send":  # every head frozen to clean, the senders corrupted
                    z = self.z[("clean", i)].clone()
                    for layer, head in self.senders:
                        if layer == i:
                            columns = slice(head * self.head_dim, (head + 1) * self.head_dim)
                            z[:, columns] = self.z[("corrupted", i)][:, columns]
                    return (z[None],)
                return None
            return hook

        handles = [layer.self_attn.o_proj.register_forward_pre_hook(o_proj(i))
                   for i, layer in enumerate(self.hf.model.layers)]
        module.eager_attention_forward = eager
        try:
            with torch.no_grad():
                yield
        finally:
            module.eager_attention_forward = original
            for handle in handles:
                handle.remove()

    def run(self, mode: str, ids) -> float:
        import torch

        self.mode = mode
        logits = self.hf(torch.tensor([list(ids)]), use_cache=False).logits[0, -1]
        return float(logits[self.item.answer_id] - logits[self.item.wrong_answer_id])

    def score(self, senders, receivers=(), channel: str = "q") -> float:
        self.senders, self.receivers, self.channel = list(senders), list(receivers), channel
        with self.hooked():
            ld = self.run("send", self.item.token_ids)
            if receivers:
                ld = self.run("receive", self.item.token_ids)
        return (ld - self.ld_clean) / (self.ld_clean - self.ld_corrupted)

    def sweep(self, layers: int, receivers=(), channel: str = "q") -> np.ndarray:
        return np.array([[self.score([(layer, head)], receivers, channel) for head in range(self.heads)]
                         for layer in range(layers)])


# -- against the reference ----------------------------------------------------------------------------

@pytest.mark.reference
@pytest.mark.parametrize(("receivers", "channel"), [
    ("logits", None),
    ([[1, 2], [2, 1]], "q"),
    ([[2, 0]], "v"),  # KV head 0 is head 1's too: head 1 keeps its clean output
    ([[2, 3], [2, 2]], "k"),  # both heads of KV head 1
    ([[1, 0], [2, 1]], "v"),  # bystanders in two layers: run 3 a chain of two runs
])
def test_every_sender_against_the_reference(tiny, receivers, channel):
    hf, model, item = tiny
    patching = PathPatching(senders="all", receivers=receivers, channel=channel)
    result = run_item(model, patching, item)
    assert result is not None
    ours = patching.results().arrays["mean_score"]
    heads = [] if receivers == "logits" else [tuple(r) for r in receivers]
    reference = Reference(hf, item).sweep(model.config.layer_count, heads, channel or "q")
    ld = (result.values["logit_diff_clean"], result.values["logit_diff_corrupted"])
    error = relative(patched_logit_differences(ours, *ld), patched_logit_differences(reference, *ld))
    gap = float(np.abs(ours - reference).max())
    print(f"\n  path patching → {receivers} {channel or ''}: patched LD relative {error:.1e}, score "
          f"|Δ| {gap:.1e} (largest |score| {np.abs(reference).max():.3f})")
    assert np.abs(reference).max() > 0.01  # some sender matters: the comparison can fail
    assert error <= TOLERANCE
    assert gap <= TOLERANCE  # the score is over the clean–corrupted gap: |Δ| relative to it
    top = max(layer for layer, _ in heads) if heads else model.config.layer_count
    assert np.all(ours[top:] == 0.0)  # senders at or after the last receiver's layer: not run, 0


@pytest.mark.reference
def test_senders_together_against_the_reference(tiny):
    hf, model, item = tiny
    senders, receivers = [[0, 1], [1, 3], [0, 2]], [[2, 1]]
    patching = PathPatching(senders=senders, receivers=receivers, channel="k")
    result = run_item(model, patching, item)
    assert result is not None
    reference = Reference(hf, item).score([tuple(s) for s in senders], [(2, 1)], "k")
    print(f"\n  senders together → 2.1 k: {result.values['score']:.6f} vs {reference:.6f}")
    assert abs(reference) > 0.01
    assert abs(result.values["score"] - reference) <= TOLERANCE * abs(reference)


# -- identities ----------------------------------------------------------------------------------------

class Heads(Experiment):
    """Keeps every layer's prefill `attention_heads`; or writes `write` {layer: heads} in."""

    name = "heads"
    may_write = True

    def __init__(self, write: dict[int, np.ndarray] | None = None) -> None:
        self.heads: dict[int, np.ndarray] = {}
        self.write = write or {}
        self.logits: np.ndarray | None = None

    def attention_heads(self, ctx, heads):
        if ctx.execution.phase is ExecutionPhase.PREFILL:
            self.heads[ctx.layer_index] = heads.values().copy()
            if ctx.layer_index in self.write:
                heads.values_mut()[:] = self.write[ctx.layer_index]

    def after_logits(self, ctx, logits):
        if ctx.phase is ExecutionPhase.PREFILL:
            self.logits = logits.values()[0].copy()


def test_the_last_layers_heads_to_the_logits_are_their_direct_effect(tiny):
    _, model, item = tiny
    last = model.config.layer_count - 1
    corrupted = Heads()
    model.generate(list(item.corrupted_ids), max_new_tokens=1, experiments=[corrupted])
    runs = []
    for ids, write in ((item.token_ids, None), (item.token_ids, {last: corrupted.heads[last]})):
        runs.append(Heads(write))
        model.generate(list(ids), max_new_tokens=1, experiments=[runs[-1]])
    ld_clean, ld_patched = (float(r.logits[item.answer_id] - r.logits[item.wrong_answer_id]) for r in runs)
    patching = PathPatching(senders=[[last, h] for h in range(model.config.head_count)])
    result = run_item(model, patching, item)
    assert result is not None
    print(f"\n  last layer's heads → logits: LD {result.values['logit_diff_patched']:.6f}, "
          f"plainly patched {ld_patched:.6f}")
    assert abs(ld_patched - ld_clean) > 1e-3
    assert abs(result.values["logit_diff_patched"] - ld_patched) <= 1e-5 * abs(ld_patched)
    assert abs(result.values["logit_diff_clean"] - ld_clean) <= 1e-5 * abs(ld_clean)


def every_head_to_the_logits(model: Any, items: list[StudyItem]) -> np.ndarray:
    config = model.config
    patching = PathPatching(senders=[[layer, head] for layer in range(config.layer_count)
                                     for head in range(config.head_count)])
    results = run_items(model, patching, items)
    return np.array([result.values["score"] for result in results])


def test_every_head_to_the_logits_is_the_corrupted_run(tiny):
    """Every head's output corrupted, the MLPs recomputed: the last position's residual is the corrupted
    run's (the embedding there is the same token), so the score is −1."""
    _, model, item = tiny
    scores = every_head_to_the_logits(model, [item])
    print(f"\n  every head → logits: {scores[0]:.7f}")
    assert abs(scores[0] + 1.0) <= 1e-5


@pytest.mark.slow
def test_every_head_to_the_logits_is_the_corrupted_run_smollm2(smollm2):
    prompts = load_prompt_set(parse_data_spec({"path": "ember:ioi.jsonl", "limit": 4}))
    items = [study_item(i, item, smollm2.tokenizer) for i, item in enumerate(prompts.items)]
    scores = every_head_to_the_logits(smollm2, items)
    print(f"\n  SmolLM2, every head → logits: {scores}")
    assert np.abs(scores + 1.0).max() <= 1e-4


def test_receivers_before_the_senders_score_zero(tiny):
    hf, model, item = tiny
    patching = PathPatching(senders=[[2, 0], [1, 3]], receivers=[[1, 1], [0, 2]], channel="q")
    result = run_item(model, patching, item)
    assert result is not None
    assert result.values["score"] == 0.0
    assert patching.results().metrics[1].value == 0.0  # nothing run
    reference = Reference(hf, item).score([(2, 0), (1, 3)], [(1, 1), (0, 2)], "q")
    assert abs(reference) <= 1e-6  # the reference computes it: the same, up to float rounding


# -- mistakes ----------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_outside_store")
@pytest.mark.parametrize(("args", "message"), [
    (["senders=[[9,12]]"], "path_patching: senders [9, 12] is not a head of this model (layers 0..29, "
                           "heads 0..8)"),
    (["receivers=[[31,0]]", "channel=q"], "path_patching: receivers [31, 0] is not a head of this model"),
    (["receivers=[[10,0]]"], "path_patching: channel is missing; receiver heads need channel q, k or v"),
    (["receivers=[[10,0]]", "channel=x"], "path_patching: channel must be q, k or v, got 'x'"),
    (["channel=q"], "path_patching: channel 'q' is for receiver heads"),
    (["senders=[[9,6,1]]"], "path_patching: senders must be all or a list of [layer, head] pairs"),
    (["senders=[9,6]"], "senders"),
])
def test_bad_parameters_end_with_one_line(workdir, capsys, args, message):
    code = runner.main(["data=ioi", "experiment=path_patching", *args, "mlflow=off", "threads=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: ") and message in lines[0], err
