"""A study: every item of a prompt set evaluated with the model loaded once, then aggregated.

Per item, either the experiment that evaluates items itself (`evaluate_item`, contract v0.2) asks for
its passes, or the runner generates once with the experiments attached (a fresh instance of each v0.1
experiment per item) and measures: the answer's probability, rank and logit (and the logit difference to
`wrong_answer`) at the first generated position, whether the answer's first token is the top prediction
(`answer.correct`), and for interventions the effect against the clean model over the same tokens (KL,
top-1 agreement, first divergent step; the clean answer metrics and their deltas).
A single-token study (at most one token generated) with nothing attached per item, its shared
experiments all batched ones (contract v0.3) or none (plain answer scoring), evaluates its items'
prompts in batches instead, `ITEMS_TOGETHER` at a time, for the same measurements.

Recorded: the prompt set as the run's dataset input; one row per item in the `study/items.json` table
(written as the items are done, every `EMBER_CHECKPOINT_SECONDS`, so a killed study keeps them);
per metric (and per step of a series, e.g. the layer) the mean over items as a metric, and the mean,
standard error and 95% bootstrap interval in one table, `study/summary.json`; a figure per key series;
the experiments' own study results; timings (`study.engine_seconds`, `study.runner_seconds`, ...); and
one self-contained results page, `results.html` (ember.studies.report). Metrics go in batches of up to
1000 values per MLflow call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments import BUILTIN_EXPERIMENTS, ExperimentFailure
from ember.experiments.readout import log_softmax
from ember.experiments.runner import ExperimentRunner
from ember.experiments.study import Evaluation, ItemResult, StudyItem
from ember.records.tracker import experiment_folder
from ember.records.values import figure_suffix
from ember.rows import BatchEntry, check_logit_ids
from ember.runconfig import build_experiments
from ember.runs.checkpoint import Interval
from ember.runs.effect import LogitsRecorder, intervention_effect
from ember.runs.prepare import may_write
from ember.sampling import Sampler, SamplingSettings
from ember.studies.aggregate import Aggregate, aggregate_columns
from ember.studies.figures import INTERVAL_LABEL, human_label, page_figure, series_figure
from ember.studies.report import render, study_page, summary_columns

# The study's results page, at the top of the run's artifacts.
RESULTS_PAGE = "results.html"
# The prompt set's role as the run's dataset input (MLflow's `mlflow.data.context` tag); not "eval",
# which reads as an MLflow GenAI evaluation in the UI.
DATASET_CONTEXT = "study"

# Timings of one study: model evaluations, experiment code between them, and everything else.
PROGRESS_DELAY = 3.0  # seconds a study's items take before their progress is shown
# Items whose evaluations a batched experiment (contract v0.3) has evaluated side by side, their requests
# of each step in one batch. Measured on SmolLM2 (residual patching of capital pairs, 2 threads): a batch
# gains little past ~300 rows, which 8 pairs give; more items only delay the progress and checkpoints.
ITEMS_TOGETHER = 8
# (Plain answer scoring of the 54 capitals prompts on SmolLM2, 1 thread, busy machine: 8 items a batch
# 6.2 s, 4: 7.6 s, 16: 7.5 s, 54: 8.0 s, one generation per item 13.5 s.)
_TIMING_METRICS = ("engine_seconds", "experiment_seconds", "runner_seconds", "total_seconds")


@dataclass(slots=True)
class Clock:
    engine: float = 0.0
    experiment: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def timed(self, slot: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            setattr(self, slot, getattr(self, slot) + time.perf_counter() - start)


@dataclass(slots=True)
class StudyOutcome:
    items_done: int
    failure: ExperimentFailure | None
    summary: list[str]


class Study:
    """One study job: `run()` evaluates, aggregates and records; the caller closes the run."""

    def __init__(self, prepared: Any, model: Any, recorder: Any, say: Callable[[str], None],
                 progress: bool = True, show: Callable[[str], None] | None = None) -> None:
        self.prepared = prepared
        self.show = show  # each item's prompt and generated text, when the runner generates
        self.plan = prepared.study
        self.model = model
        self.recorder = recorder
        self.say = say
        self.progress = progress
        self.clock = Clock()
        self.rows: list[dict[str, Any]] = []
        self.values: list[dict[tuple[str, int], float]] = []
        self.series_names: set[str] = set()
        self.key: list[str] = []
        self.checkpoint = Interval()

    # -- evaluation ------------------------------------------------------------------------------

    def run(self) -> StudyOutcome:
        from ember.progress import Progress

        plan, run = self.plan, self.prepared.run
        self._record_dataset()
        failure: ExperimentFailure | None = None
        try:
            for experiment in [*([plan.driver] if plan.driver is not None else []), *plan.shared]:
                prepare = getattr(experiment, "prepare_study", None)
                if callable(prepare):
                    with Progress.status(f"preparing {experiment.name} over {len(plan.items)} items",
                                         enabled=self.progress, delay=PROGRESS_DELAY):
                        self._drive(experiment, prepare(plan.items))
            label = f"{plan.prompt_set.name}: {len(plan.items)} items"
            # Shown only once the items have taken PROGRESS_DELAY seconds: a quick study prints its summary.
            with Progress(label, total=len(plan.items), enabled=self.progress,
                          delay=PROGRESS_DELAY) as advance:
                items_batched = self._items_batched(run)
                together = ITEMS_TOGETHER if getattr(plan.driver, "batched", False) or items_batched else 1
                evaluator = Evaluator(self.model, plan.driver) if plan.driver is not None else None
                for first in range(0, len(plan.items), together):
                    items = plan.items[first:first + together]
                    if evaluator is not None:
                        steps = [plan.driver.evaluate_item(item) for item in items]
                        results = drive_together(evaluator, steps, self.clock.timed)
                        results = [_prefixed(result, plan.driver.name) for result in results]
                    elif items_batched:
                        results = self._generate_batch(items, run)
                    else:
                        results = [self._generate(item, run) for item in items]
                    for item, result in zip(items, results, strict=True):
                        self._collect(item, result)
                    if self.checkpoint.due():
                        self._write_items()
                    advance(len(items))
        except ExperimentFailure as error:
            failure = error
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what the items done so far showed
            if self.rows:
                try:
                    self._record(None)
                except Exception as error:
                    self.say(f"ember: the partial study could not be recorded: {error}")
            raise
        summary = self._record(failure)
        return StudyOutcome(len(self.rows), failure, summary)

    def _drive(self, experiment: Any, steps: Generator[Request, Any, Any] | None) -> Any:
        """Answer an experiment's evaluation requests until it returns (its ItemResult, or None)."""
        return drive_together(Evaluator(self.model, experiment), [steps], self.clock.timed)[0]

    def _generate(self, item: StudyItem, run: Any) -> ItemResult:
        """The runner's own per-item pass: one generation with the experiments attached."""
        fresh = build_experiments(self.plan.per_item_specs, BUILTIN_EXPERIMENTS,
                                  self.model.config.layer_count)
        attached = fresh + list(self.plan.shared)
        writes = run.intervention_effect and any(may_write(e) for e in attached)
        logits_seen = LogitsRecorder()
        generation = self.clock.timed("engine", lambda: self.model.generate(
            list(item.token_ids), max_new_tokens=run.max_new_tokens, temperature=run.sampling.temperature,
            top_k=run.sampling.top_k, top_p=run.sampling.top_p, min_p=run.sampling.min_p,
            seed=run.sampling.seed, experiments=[*attached, logits_seen], stop_at_eog=run.stop_at_eog))
        result = ItemResult(row={"generated": generation.text},
                            values={"tokens.generated": float(len(generation.token_ids))})
        if self.show is not None:
            self.show(f"{item.text}{generation.text}")
        for experiment in fresh:
            _add_metrics(result, experiment.name, generation.experiment_results[experiment.name].metrics)
        steps = min(len(logits_seen.rows), len(generation.token_ids) + 1)
        clean = None
        if writes:
            sequence = list(item.token_ids) + list(generation.token_ids[: steps - 1])
            clean = self.clock.timed("engine", lambda: self.model.logits(sequence))
            clean = clean[len(item.token_ids) - 1: len(item.token_ids) - 1 + steps]
        return measured(result, item, np.stack(logits_seen.rows[:steps]), clean)

    def _items_batched(self, run: Any) -> bool:
        """Whether the runner's per-item pass may run items as batches (`_generate_batch`): a
        single-token study (nothing is evaluated past the scored position) whose experiments are all
        shared ones that handle batches (contract v0.3)."""
        plan = self.plan
        return (plan.driver is None and run.max_new_tokens <= 1 and not plan.per_item_specs
                and all(getattr(e, "batched", False) for e in plan.shared))

    def _generate_batch(self, items: Sequence[StudyItem], run: Any) -> list[ItemResult]:
        """`_generate` for several items of a single-token study at once: their prompts with the
        experiments attached as one batch, and for interventions the clean model over the same prompts
        as another (the one position scored is each prompt's last); each item's token sampled from its
        own logits as a generation of one token samples it."""
        attached = list(self.plan.shared)
        entries = [BatchEntry(np.asarray(item.token_ids, np.int64)) for item in items]
        rows = sum(entry.rows for entry in entries)
        runner = ExperimentRunner(attached, self.model.model_context) if attached else None

        def intervened() -> tuple[list[np.ndarray], list[list[int]]]:
            if runner is None:  # plain answer scoring
                logits = self.model.evaluate_batch(entries).logits
                return logits, [self._sampled(row, run) for row in logits]
            runner.on_model_loaded()
            runner.before_prefill(0, rows)
            logits = self.model.evaluate_batch(entries, observer=runner.hooks).logits
            generated = [self._sampled(row, run) for row in logits]
            runner.on_generation_complete(rows, sum(map(len, generated)), 0)
            return logits, generated

        logits, generated = self.clock.timed("engine", intervened)
        clean: list[np.ndarray | None] = [None] * len(items)
        if run.intervention_effect and any(may_write(e) for e in attached):
            clean = self.clock.timed("engine", lambda: self.model.evaluate_batch(entries).logits)
        results = []
        for item, row, tokens, clean_row in zip(items, logits, generated, clean, strict=True):
            decoder = self.model.tokenizer.stream_decoder()
            text = "".join(piece for piece in [*map(decoder.push, tokens), decoder.flush()] if piece)
            if self.show is not None:
                self.show(f"{item.text}{text}")
            result = ItemResult(row={"generated": text}, values={"tokens.generated": float(len(tokens))})
            results.append(measured(result, item, row[None], None if clean_row is None else clean_row[None]))
        return results

    def _sampled(self, logits: np.ndarray, run: Any) -> list[int]:
        """The tokens a generation of at most one token (`run.max_new_tokens`) makes from its prefill's
        logits: none at 0 or when it stops at an end-of-generation token."""
        if run.max_new_tokens < 1:
            return []
        sampling = run.sampling
        token = Sampler(SamplingSettings(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p,
                                         sampling.seed))(logits)
        return [] if run.stop_at_eog and token in self.model.tokenizer.eog_ids else [token]

    def _collect(self, item: StudyItem, result: ItemResult | None) -> None:
        result = result if result is not None else ItemResult()
        row: dict[str, Any] = {"item": item.index, "prompt": item.text}
        for name in ("label", "answer", "wrong_answer", "corrupted"):
            if getattr(item, name) is not None:
                row[name] = getattr(item, name)
        row.update(result.row)
        values: dict[tuple[str, int], float] = {}
        for name, value in result.values.items():
            values[(name, 0)] = float(value)
            row[name] = _plain(value)
        for name, series in result.series.items():
            self.series_names.add(name)
            for step, value in series.items():
                values[(name, int(step))] = float(value)
        for name in result.key:
            if name not in self.key:
                self.key.append(name)
        self.rows.append(row)
        self.values.append(values)

    # -- records ---------------------------------------------------------------------------------

    def _write_items(self, tags: bool = True) -> None:
        """The rows of the items done so far, under the table's final name; with `tags`, the table's tag
        and the count of items in one call (else they go with the study's last batch)."""
        self.checkpoint.restart()
        self.recorder.log_table(_columns(self.rows), "study/items.json", tag=False)
        if tags:
            self.recorder.log_batch([], {"ember.study.items": str(len(self.rows))})

    def _record_dataset(self) -> None:
        prompts = self.plan.prompt_set
        inline = {"tags": {"ember.data": "inline"}}
        source = {"uri": prompts.source} if prompts.source_type == "local" else inline
        schema = {"mlflow_colspec": [{"type": "string", "name": name, "required": False}
                                     for name in prompts.fields()]}
        self.recorder.log_dataset(prompts.name, prompts.digest, prompts.source_type, source, schema,
                                  len(prompts.items), context=DATASET_CONTEXT)

    def aggregates(self) -> dict[tuple[str, int], Aggregate]:
        keys: list[tuple[str, int]] = []
        seen: set[tuple[str, int]] = set()
        for values in self.values:
            for key in values:
                if key not in seen:
                    seen.add(key)
                    keys.append(key)
        columns = {key: [values.get(key, math.nan) for values in self.values] for key in keys}
        return aggregate_columns(columns)

    def _record(self, failure: ExperimentFailure | None) -> list[str]:
        """Everything the study found, in this order: the tables, figures and the experiments' results,
        the results page, then its metrics (timings included) and tags in one batch. Each figure is
        rendered once, for its artifact and the page."""
        aggregates = self.aggregates() if self.values else {}
        recorder, plan = self.recorder, self.plan
        metrics: list[tuple[str, float, int]] = [("study.items", float(len(self.rows)), 0)]
        # The mean is the metric; its standard error and interval are in study/summary.json and the page.
        metrics += [(name, agg.mean, step) for (name, step), agg in aggregates.items()
                    if math.isfinite(agg.mean)]
        if self.rows:
            self._write_items(tags=False)
        key = [name for name in self.key if any(k[0] == name for k in aggregates)]
        series = sorted(self.series_names)
        if aggregates:
            recorder.log_table(summary_columns(aggregates, key, series), "study/summary.json", tag=False)
        figures: list[tuple[str, Any]] = []  # (caption, figure) for the results page
        for name in key:
            if name in self.series_names:
                steps = sorted(step for (n, step) in aggregates if n == name)
                figure = series_figure(name, steps, [aggregates[(name, s)] for s in steps],
                                       model=self.prepared.model_label, prompt_set=plan.prompt_set.name,
                                       n=len(self.rows))
                path = f"study/{name}{figure_suffix(figure)}"
                recorder.log_figure(figure, path)
                caption = (f"{path}: {human_label(name)} per layer, mean over {len(self.rows)} "
                           f"items with its {INTERVAL_LABEL}")
                figures.append((caption, figure))
        results = {}
        for experiment in [*([plan.driver] if plan.driver is not None else []), *plan.shared]:
            try:
                results[experiment.name] = experiment.results()
            except Exception as error:  # its partial results are lost, the study's are not
                if failure is None:
                    raise
                self.say(f"ember: {experiment.name}.results() failed after the failure: {error}")
        for name, result in results.items():
            recorder.result(name, result)
        if recorder.recording:  # the page (its figures are the PNGs logged above, not drawn again)
            for name, result in results.items():
                figures += [(f"{experiment_folder(name)}/{title}{figure_suffix(figure)}", figure)
                            for title, figure in _figures_of(result).items()]
            page = study_page(model=self.prepared.model_label, prompt_set=plan.prompt_set.name,
                              digest=plan.prompt_set.digest, items=len(self.rows), run_id=recorder.run_id,
                              aggregates=aggregates, key=key, series=series,
                              figures=[page_figure(caption, figure) for caption, figure in figures],
                              item_columns=_columns(self.rows), config=_yaml(self.prepared.plain),
                              status="stopped early: " + str(failure) if failure is not None else "")
            recorder.log_text(render(page), RESULTS_PAGE)
        total = time.perf_counter() - self.clock.started  # all but the one call below
        runner = max(0.0, total - self.clock.engine - self.clock.experiment)
        timings = dict(zip(_TIMING_METRICS, (self.clock.engine, self.clock.experiment, runner, total),
                           strict=True))
        metrics += [(f"study.{name}", value, 0) for name, value in timings.items()]
        recorder.log_batch(metrics, {"ember.study.data": plan.prompt_set.name,
                                     "ember.study.digest": plan.prompt_set.digest,
                                     "ember.study.items": str(len(self.rows)),
                                     "ember.study.key_metrics": ",".join(key)})
        self.timings = timings
        return self._summary(aggregates, key, timings)

    def _summary(self, aggregates: dict[tuple[str, int], Aggregate], key: Sequence[str],
                 timings: dict[str, float]) -> list[str]:
        prompts = self.plan.prompt_set
        engine = timings["engine_seconds"]
        share = f" ({timings['runner_seconds'] / engine:.1%} of engine time)" if engine > 0 else ""
        lines = [f"study of {len(self.rows)} items of {prompts.name} (digest {prompts.digest}) in "
                 f"{timings['total_seconds']:.1f} s: engine {engine:.1f} s, runner "
                 f"{timings['runner_seconds']:.2f} s{share}"]
        for name in key:
            if name in self.series_names:
                steps = [(step, agg) for (n, step), agg in aggregates.items() if n == name]
                step, agg = max(steps, key=lambda pair: abs(pair[1].mean))
                lines.append(f"  {name}: largest at step {step}: {_interval(agg)}")
            elif (name, 0) in aggregates:
                lines.append(f"  {name}: {_interval(aggregates[(name, 0)])}")
        return lines


def evaluate_request(model: Any, experiment: Any, request: Evaluation) -> np.ndarray:
    """One requested evaluation: a prefill over a fresh cache, the experiment's hooks attached (unless
    `attach=False`), through the same lifecycle as a generation; the last position's logits."""
    ids = list(request.token_ids)
    if not request.attach:
        return _read(model.evaluate(ids), request)
    runner = ExperimentRunner([experiment], model.model_context)
    runner.on_model_loaded()
    runner.before_prefill(0, len(ids))
    logits = model.evaluate(ids, observer=runner.hooks)
    runner.on_generation_complete(len(ids), 0, 0)
    return _read(logits, request)


def _read(logits: np.ndarray, request: Evaluation) -> np.ndarray:
    """The logits a request reads: all, or those of its `logit_ids` in that order."""
    if request.logit_ids is None:
        return logits
    ids = np.asarray(request.logit_ids, np.int64)
    try:
        check_logit_ids(ids, len(logits))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    return logits[ids]


Request = Evaluation | Sequence[Evaluation]


class Evaluator:
    """Answers one experiment's evaluation requests, each tagged with the generator (`scope`: an item)
    that asked. A batched experiment's (contract v0.3) are evaluated together as engine batches (the
    attached ones and the clean ones apart), keeping saved states per scope; anyone else's one by one."""

    def __init__(self, model: Any, experiment: Any) -> None:
        self.model = model
        self.experiment = experiment
        self.batched = bool(getattr(experiment, "batched", False))
        self.saved: dict[tuple[int, Any], Any] = {}

    def answer(self, requests: Sequence[tuple[int, Evaluation]]) -> list[np.ndarray]:
        if not self.batched:
            return [evaluate_request(self.model, self.experiment, request) for _, request in requests]
        logits: list[Any] = [None] * len(requests)
        for attach in (False, True):
            chosen = [i for i, (_, request) in enumerate(requests) if request.attach is attach]
            if not chosen:
                continue
            entries = [self._entry(*requests[i]) for i in chosen]
            runner = None
            if attach:
                runner = ExperimentRunner([self.experiment], self.model.model_context)
                runner.on_model_loaded()
                runner.before_prefill(0, sum(entry.rows for entry in entries))
            result = self.model.evaluate_batch(entries, observer=runner.hooks if runner is not None else None)
            if runner is not None:
                runner.on_generation_complete(sum(entry.rows for entry in entries), 0, 0)
            for k, i in enumerate(chosen):
                logits[i] = result.logits[k]
            for k, state in result.saved.items():
                scope, request = requests[chosen[k]]
                self.saved[(scope, request.save)] = state
        return logits

    def forget(self, scope: int) -> None:
        """Drop the states a finished generator saved."""
        for key in [key for key in self.saved if key[0] == scope]:
            del self.saved[key]

    def _entry(self, scope: int, request: Evaluation) -> BatchEntry:
        prefix = None
        if request.reuse is not None:
            prefix = self.saved.get((scope, request.reuse))
            if prefix is None:
                raise ConfigError(f"{self.experiment.name}: no saved evaluation {request.reuse!r} to reuse "
                                  f"(save it in an earlier step of the same item)")
        return BatchEntry(np.asarray(request.token_ids, np.int64), request.start, request.first_layer, prefix,
                          request.save is not None, request.tag,
                          None if request.logit_ids is None else np.asarray(request.logit_ids, np.int64))


def drive_together(evaluator: Evaluator, generators: Sequence[Generator[Request, Any, Any] | None],
                   timed: Callable[[str, Callable[[], Any]], Any] | None = None) -> list[Any]:
    """Run study generators side by side until each returns; the requests of one step, from all of
    them, are answered in one call (one batch for a batched experiment). Returns their return values.
    `timed(slot, call)` times the experiment's code ("experiment") and the evaluations ("engine")."""
    def clocked(slot: str, call: Callable[[], Any]) -> Any:
        return timed(slot, call) if timed is not None else call()

    results: list[Any] = [None] * len(generators)
    replies: dict[int, Any] = {g: None for g, steps in enumerate(generators) if steps is not None}
    while replies:
        asked: list[tuple[int, Request]] = []
        for g in list(replies):
            steps = generators[g]
            assert steps is not None
            try:
                request = clocked("experiment", lambda steps=steps, g=g: steps.send(replies[g]))
            except StopIteration as done:
                results[g] = done.value
                del replies[g]
                evaluator.forget(g)
                continue
            asked.append((g, request))
        flat = [(g, r) for g, request in asked for r in (request if isinstance(request, list | tuple)
                                                          else (request,))]
        if not flat:
            continue
        answers = iter(clocked("engine", lambda flat=flat: evaluator.answer(flat)))
        for g, request in asked:
            if isinstance(request, list | tuple):
                replies[g] = [next(answers) for _ in request]
            else:
                replies[g] = next(answers)
    return results


def drive(steps: Generator[Evaluation, np.ndarray, Any] | None,
          answer: Callable[[Evaluation], np.ndarray]) -> Any:
    """Answer a study generator's evaluation requests until it returns; its return value."""
    if steps is None:
        return None
    reply: np.ndarray | None = None
    while True:
        try:
            request = steps.send(reply)
        except StopIteration as done:
            return done.value
        reply = answer(request)


def run_item(model: Any, experiment: Any, item: StudyItem) -> ItemResult | None:
    """One item through an experiment's own passes, as a study runs it (outside a job: tests, notebooks)."""
    return run_items(model, experiment, [item])[0]


def run_items(model: Any, experiment: Any, items: Sequence[StudyItem]) -> list[ItemResult | None]:
    """Items through an experiment's own passes, side by side (batched) when the experiment is."""
    return drive_together(Evaluator(model, experiment), [experiment.evaluate_item(item) for item in items])


def run_prepare(model: Any, experiment: Any, items: Sequence[StudyItem]) -> None:
    """An experiment's `prepare_study` over items, as a study runs it (outside a job: tests, notebooks)."""
    drive_together(Evaluator(model, experiment), [experiment.prepare_study(items)])


def measured(result: ItemResult, item: StudyItem, intervened: np.ndarray,
             clean: np.ndarray | None) -> ItemResult:
    """An item's runner metrics from the logits it was generated with ([steps, V], the first at the
    first generated position): the answer's; with `clean` (the clean model's over the same tokens) the
    intervention's effect and the clean answer metrics with their deltas. Sets the key metrics."""
    result.values.update(answer_values(intervened[0], item))
    if clean is not None:
        effect = intervention_effect(clean, intervened)
        summary = effect.summary()
        result.values.update({"effect.kl_mean": summary["kl_mean"], "effect.kl_max": summary["kl_max"],
                              "effect.top1_agreement": summary["top1_agreement"],
                              "effect.first_divergent_step": float(summary["first_divergent_step"]),
                              # its mean over the set: the share of answers the intervention changed
                              "effect.answer_changed": float(summary["first_divergent_step"] == 0)})
        clean_values = answer_values(clean[0], item)
        for name, value in clean_values.items():
            result.values[f"clean.{name}"] = value
        for name in ("answer.prob", "answer.logit_diff"):
            if name in clean_values:
                result.values[f"{name}_delta"] = result.values[name] - clean_values[name]
        result.key = ("effect.kl_mean", "effect.top1_agreement") + (
            ("answer.logit_diff_delta",) if item.wrong_answer_ids else
            ("answer.prob_delta",) if item.answer_ids else ())
    elif item.answer_ids:
        result.key = ("answer.prob", "answer.correct") + (
            ("answer.logit_diff",) if item.wrong_answer_ids else ())
    if not result.key:  # plain generation over a prompt set: what each item generated
        result.key = ("tokens.generated",)
    return result


def answer_values(logits: np.ndarray, item: StudyItem) -> dict[str, float]:
    """The answer's probability, rank (0 = top) and logit, and the logit difference to the wrong answer."""
    if item.answer_id is None:
        return {}
    answer = item.answer_id
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    rank = float((logits > logits[answer]).sum())
    out = {"answer.prob": float(np.exp(log_softmax(logits)[answer])), "answer.rank": rank,
           "answer.correct": float(rank == 0), "answer.logit": float(logits[answer])}
    if item.wrong_answer_id is not None:
        out["answer.logit_diff"] = float(logits[answer] - logits[item.wrong_answer_id])
    return out


def _add_metrics(result: ItemResult, prefix: str, metrics: Sequence[Any]) -> None:
    """A v0.1 experiment's metrics: a name seen once at step 0 is a value, anything else a series."""
    by_name: dict[str, dict[int, float]] = {}
    for metric in metrics:
        if isinstance(metric.value, int | float) and math.isfinite(float(metric.value)):
            by_name.setdefault(f"{prefix}.{metric.name}", {})[int(metric.step)] = float(metric.value)
    for name, steps in by_name.items():
        if list(steps) == [0]:
            result.values[name] = steps[0]
        else:
            result.series[name] = steps


def _prefixed(result: ItemResult | None, prefix: str) -> ItemResult:
    """An experiment's item result with its names under the experiment's name (`logit_lens.target_prob`)."""
    if result is None:
        return ItemResult()
    return ItemResult({f"{prefix}.{k}": v for k, v in result.values.items()},
                      {f"{prefix}.{k}": v for k, v in result.series.items()}, dict(result.row),
                      tuple(f"{prefix}.{k}" for k in result.key))


def _interval(agg: Aggregate) -> str:
    return f"{agg.mean:.4g} [95% CI {agg.ci_low:.4g}, {agg.ci_high:.4g}] (n={agg.n})"


def _figures_of(result: Any) -> dict[str, Any]:
    """An experiment's figures (built already when they were logged); none if building them fails."""
    try:
        return dict(result.figures)
    except Exception:
        return {}


def _yaml(plain: Any) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(plain))


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _columns(rows: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    names: list[str] = []
    for row in rows:
        names.extend(k for k in row if k not in names)
    return {name: [_cell(row.get(name)) for row in rows] for name in names}


def _cell(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple | dict):
        import json

        return json.dumps(value, default=str)
    return value
