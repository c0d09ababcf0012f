"""A study before any weight is read: the prompt set, tokenized and checked against the experiments.

A job is a study when it has a prompt set (`data=...`) or an experiment that evaluates items itself
(activation patching, logit lens); without `data` the prompt becomes a one-item set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ember.data import PromptItem, PromptSet, load_prompt_set
from ember.data.prompts import digest
from ember.errors import ConfigError, EmberError
from ember.experiments.study import StudyItem, is_study_experiment


@dataclass(frozen=True, slots=True)
class StudyPlan:
    prompt_set: PromptSet
    items: tuple[StudyItem, ...]
    driver: Any | None            # the experiment with evaluate_item (it runs alone), or None
    shared: tuple[Any, ...]        # experiments with prepare_study only: one instance for the study
    per_item_specs: tuple[Any, ...]  # v0.1 experiments: a fresh instance per item, built from these specs


def plan_study(run: Any, experiments: Sequence[Any], tokenizer: Any, layer_count: int,
               context_length: int) -> StudyPlan | None:
    """The study this job runs, or None for a plain single-prompt generation."""
    studying = [e for e in experiments if is_study_experiment(e)]
    if run.data is None and not studying:
        return None
    if run.data is not None:
        prompt_set = load_prompt_set(run.data)
    else:
        item = PromptItem("prompt", run.prompt if run.messages is None else None,
                          tuple(run.messages) if run.messages is not None else None)
        prompt_set = PromptSet("prompt", (item,), "inline", "code", digest([item]), 1)
    drivers = [e for e in experiments if callable(getattr(e, "evaluate_item", None))]
    if drivers and len(experiments) > 1:
        raise ConfigError(f"experiment {drivers[0].name!r} evaluates each item with passes of its own and "
                          f"runs alone; remove the other experiments from this job "
                          f"({len(experiments) - 1} more)")
    items = tuple(study_item(i, item, tokenizer) for i, item in enumerate(prompt_set.items))
    for item, source in zip(items, prompt_set.items, strict=True):
        longest = max(len(item.token_ids), len(item.corrupted_ids or ()))
        if longest + run.max_new_tokens > context_length:
            raise ConfigError(f"data item {source.where}: {longest} prompt tokens plus max_new_tokens="
                              f"{run.max_new_tokens} do not fit the context of {context_length} tokens")
    for experiment in studying:
        check = getattr(experiment, "check_items", None)
        if callable(check):
            try:
                check(items)
            except EmberError as error:
                raise ConfigError(f"{experiment.name} with data {prompt_set.name}: {error}") from None
    indices = {id(e): i for i, e in enumerate(experiments)}
    shared = tuple(e for e in studying if e not in drivers)
    per_item = tuple(run.experiments[indices[id(e)]] for e in experiments if not is_study_experiment(e))
    return StudyPlan(prompt_set, items, drivers[0] if drivers else None, shared, per_item)


def study_item(index: int, item: PromptItem, tokenizer: Any) -> StudyItem:
    """An item tokenized as the runner tokenizes a prompt (chat messages through the template)."""
    if item.messages is not None:
        ids = tokenizer.encode_chat([dict(m) for m in item.messages])
        text = tokenizer.decode(ids, special=True)
    else:
        assert item.prompt is not None
        ids, text = tokenizer.encode(item.prompt), item.prompt

    def continuation(text: str | None) -> tuple[int, ...] | None:
        if text is None:
            return None
        ids = tuple(tokenizer.encode(text, add_bos=False))
        if not ids:
            raise ConfigError(f"data item {item.where}: {text!r} has no tokens")
        return ids

    answer_ids, wrong_ids = continuation(item.answer), continuation(item.wrong_answer)
    if answer_ids and wrong_ids and answer_ids[0] == wrong_ids[0]:
        raise ConfigError(f"data item {item.where}: answer {item.answer!r} and wrong_answer "
                          f"{item.wrong_answer!r} begin with the same token, so nothing tells them apart")
    corrupted = tuple(tokenizer.encode(item.corrupted)) if item.corrupted is not None else None
    return StudyItem(index, tuple(ids), text, corrupted, answer_ids, wrong_ids, item.label, item.answer,
                     item.wrong_answer, item.corrupted)
