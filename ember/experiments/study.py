"""Studies (contract v0.2): an experiment evaluated over a prompt set, item by item.

A v0.1 experiment sees one generation. In a study (`data=...` in the runner) each item of the prompt
set is one generation; the runner builds a fresh instance of a v0.1 experiment per item, so its
`results().metrics` are that item's, and aggregates them over the items.

An experiment may take part in a study more closely through two optional generator methods. Neither
gives it the model: it asks the runner for evaluations and sees activations only through its hooks.

    def prepare_study(self, items):           # once, before the items (e.g. a mean to ablate with)
        for item in items:
            yield Evaluation(item.token_ids)   # the runner evaluates, with this experiment's hooks

    def evaluate_item(self, item):             # per item, instead of the runner's one generation
        clean = yield Evaluation(item.token_ids)               # -> last-position logits [vocab]
        corrupt = yield Evaluation(item.corrupted_ids)
        return ItemResult(values={...}, series={...}, row={...})

Each `yield Evaluation(...)` is one prefill over a fresh cache (nothing sampled) with this experiment's
hooks attached (`attach=False`: the clean model), answered with a float32 copy of the last position's
logits. An experiment with `prepare_study` and no `evaluate_item` gets the runner's own per-item
generation (with the intervention-effect metrics), one instance for the whole study.

Contract v0.3: an experiment with `batched = True` may yield a list of evaluations (answered with a
list of logits) and its hooks see them as one batch, each sequence's rows named by `ctx.spans` (its
`tag`). The runner then evaluates several items' generators side by side, their requests of one step
merged into one batch. Such an evaluation may start from a saved one of the same item (prefix reuse):
`save=key` keeps an evaluation's state; `reuse=key, start=p, first_layer=l` evaluates only positions
p… from layer l on, the positions before p and the layers before l taken from the saved evaluation (its
tokens must agree up to p, and everywhere when l > 0). `logit_ids=(a, b, …)` asks for those vocabulary
entries' logits alone (answered with [len(ids)], in that order): an experiment that reads a logit
difference spares the engine the rest of the LM head (unless a hook listens at after_logits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class StudyItem:
    """One item of a prompt set, tokenized by the runner with the model's tokenizer."""

    index: int                                   # position in the prompt set as evaluated
    token_ids: tuple[int, ...]                   # the prompt (chat messages rendered through the template)
    text: str                                    # the prompt text (or the rendered chat)
    corrupted_ids: tuple[int, ...] | None = None  # the paired prompt (patching: corrupted; steering:
    #                                                negative side)
    answer_ids: tuple[int, ...] | None = None     # the expected continuation, without BOS
    wrong_answer_ids: tuple[int, ...] | None = None
    label: str | None = None
    answer: str | None = None
    wrong_answer: str | None = None
    corrupted: str | None = None

    @property
    def answer_id(self) -> int | None:
        """The answer's first token (what the next-token distribution is scored on)."""
        return self.answer_ids[0] if self.answer_ids else None

    @property
    def wrong_answer_id(self) -> int | None:
        return self.wrong_answer_ids[0] if self.wrong_answer_ids else None


@dataclass(frozen=True, slots=True)
class Evaluation:
    """What an experiment asks the runner to evaluate: one prefill of `token_ids`.

    The fields after `attach` are contract v0.3, for experiments with `batched = True` (module docstring).
    """

    token_ids: Sequence[int]
    attach: bool = True  # False: the clean model, none of this experiment's hooks
    tag: Any = None      # shown to the hooks with this sequence (`SequenceSpan.tag`)
    save: Any = None     # keep this evaluation's state under this key (for this item's later evaluations)
    reuse: Any = None    # the key of a saved evaluation of this item to start from
    start: int = 0       # with `reuse`: the first position evaluated
    first_layer: int = 0  # with `reuse`: the first layer evaluated
    logit_ids: Sequence[int] | None = None  # only these logits are read: the reply is [len(logit_ids)]


@dataclass(slots=True)
class ItemResult:
    """One item's measurements.

    `values`: scalars (name -> value); `series`: per-step values (name -> {step: value}, e.g. per layer);
    both are aggregated over the items (mean, standard error, 95% bootstrap interval). `row`: extra
    columns for the per-item table. `key`: the names that summarise the study (console, sweep summary).
    """

    values: dict[str, float] = field(default_factory=dict)
    series: dict[str, dict[int, float]] = field(default_factory=dict)
    row: dict[str, Any] = field(default_factory=dict)
    key: tuple[str, ...] = ()


def series_from(values: Sequence[float] | Mapping[int, float]) -> dict[int, float]:
    """{step: value} from a sequence (step = index) or a mapping."""
    if isinstance(values, Mapping):
        return {int(k): float(v) for k, v in values.items()}
    return {i: float(v) for i, v in enumerate(values)}


def is_study_experiment(experiment: Any) -> bool:
    return callable(getattr(experiment, "evaluate_item", None)) or callable(
        getattr(experiment, "prepare_study", None))
