"""`head_patching`: which attention heads carry what distinguishes a clean prompt from its corrupted twin.

Per item (pairs as `activation_patching` takes them: a clean prompt, a corrupted prompt of the same token
count, an answer and a wrong answer):

1. the clean run's per-head outputs are recorded at every layer (`attention_heads`, `[T, heads ×
   head_dim]`, head h in columns h·head_dim…: the output projection's input);
2. the corrupted run gives the baseline;
3. for each layer l, head h and position class, the corrupted prompt is run again with head h's output
   at layer l replaced by the clean run's at the class's positions. The score is the share of the logit
   difference restored, as in `activation_patching` (ember.experiments.patching):

       (LD_patched - LD_corrupted) / (LD_clean - LD_corrupted),   LD = logit(answer) - logit(wrong answer)

Position classes: `all` (every position; the heads' outputs before the first changed token are the same
in both runs, so the patch writes from the first changed token on), `changed` (the tokens where the
prompts differ) and `last` (the final position).

`together=True` patches the chosen heads of a layer at once (one score per layer and class); with every
head that is the attention output before the output projection, so for a family whose projection has no
bias (llama, qwen3) it equals `activation_patching`'s attention site at `span=all`.

The passes are batched with prefix reuse as `activation_patching`'s: an item's clean and corrupted runs,
then all its patched runs as one batch (several items' side by side), each starting from the corrupted
run's saved state at its layer and first patched position.

Results: per item the clean and corrupted logit differences and per class the best head's score per
layer (`<class>.best`, a series) and overall (`<class>.max`); the mean over items as a layers × heads map
per class (figure `mean_restored`, array `mean_restored` [classes, layers, heads]) with a table of every
head's mean, standard error and n (`heads`) and of the highest (`top_heads`); the first `figure_items`
items' own maps.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.patching import (
    answer_pair,
    changed_positions,
    check_pairs,
    logit_difference,
    restored,
    score_maps,
)
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.study import Evaluation, ItemResult, StudyItem

if TYPE_CHECKING:
    from ember.svg_figure import SvgFigure

POSITIONS = ("all", "changed", "last")
TOP_HEADS = 10  # rows per position class in the `top_heads` table


class HeadPatching(Experiment):
    """Patch clean attention-head outputs into the corrupted run, one (layer, head, position class) at a
    time.

    Parameters: `positions` (any of all, changed, last; default all three), `layers` and `heads` (lists
    of indices; default every one), `together` (patch the chosen heads of a layer at once), `figure_items`
    (items that get their own layers x heads map, default 1), `name`.
    """

    may_write = True
    batched = True  # contract v0.3: its hooks read each sequence's rows by `ctx.spans`

    def __init__(self, positions: Sequence[str] | str = POSITIONS, layers: Sequence[int] | None = None,
                 heads: Sequence[int] | None = None, together: bool = False, figure_items: int = 1,
                 name: str = "head_patching") -> None:
        positions = [positions] if isinstance(positions, str) else list(positions)
        unknown = [p for p in positions if p not in POSITIONS]
        if unknown or not positions:
            raise ConfigError(f"head_patching: positions must be some of {', '.join(POSITIONS)}, "
                              f"got {positions}")
        if not isinstance(together, bool):
            raise ConfigError(f"head_patching: together must be true or false, got {together!r}")
        if isinstance(figure_items, bool) or not isinstance(figure_items, int) or figure_items < 0:
            raise ConfigError(f"head_patching: figure_items must be a count (0 or more), "
                              f"got {figure_items!r}")
        self.name = name
        self.positions = tuple(p for p in POSITIONS if p in positions)
        self.layers = _indices(layers, "layers")
        self.heads = _indices(heads, "heads")
        self.together = together
        self.figure_items = figure_items
        self._layer_count = 0
        self._head_count = 0
        self._clean: dict[tuple[int, int], np.ndarray] = {}  # (item, layer) → the clean run's heads
        self._scores: list[np.ndarray] = []                   # per item [positions, layers, groups]
        self._maps: list[tuple[int, np.ndarray]] = []
        self._passes = 0
        self._model = ""

    # -- hooks -------------------------------------------------------------------------------------

    def check_model(self, ctx: ModelContext) -> None:
        """Refuse layers and heads the model does not have (the runner asks before loading it)."""
        if not ctx.head_count:
            raise ConfigError("head_patching: the model context does not say how many heads a layer has")
        outside = [layer for layer in self.layers or () if not 0 <= layer < ctx.layer_count]
        if outside:
            raise ConfigError(f"head_patching: layers {outside} are outside 0..{ctx.layer_count - 1}")
        outside = [head for head in self.heads or () if not 0 <= head < ctx.head_count]
        if outside:
            raise ConfigError(f"head_patching: heads {outside} are outside 0..{ctx.head_count - 1} "
                              f"(this model has {ctx.head_count} heads per layer)")

    def on_model_loaded(self, ctx: ModelContext) -> None:
        self.check_model(ctx)
        self._layer_count, self._head_count = ctx.layer_count, ctx.head_count
        self._model = ctx.model_id or ctx.architecture

    def attention_heads(self, ctx: LayerContext, heads: TensorAccess) -> None:
        """Record the clean run's heads; write them into the patched runs at their layer."""
        if ctx.execution.phase is not ExecutionPhase.PREFILL:
            return
        layer = ctx.layer_index
        for span in ctx.spans:
            tag = span.tag
            if tag is None:
                continue
            if tag[0] == "clean":
                self._clean[(tag[1], layer)] = heads.values()[span.rows].copy()
            elif tag[2] == layer:  # ("patch", item, layer, heads, positions)
                clean = self._clean[(tag[1], layer)]
                head_dim = clean.shape[1] // self._head_count
                positions = np.asarray(tag[4])
                rows = span.rows.start + positions - span.start_position
                values = heads.values_mut()
                for head in tag[3]:
                    columns = slice(head * head_dim, (head + 1) * head_dim)
                    values[rows, columns] = clean[positions, columns]

    # -- a study item ------------------------------------------------------------------------------

    def check_items(self, items: Sequence[StudyItem]) -> None:
        check_pairs(items, self.name)

    def evaluate_item(self, item: StudyItem) -> Generator[Any, Any, ItemResult]:
        assert item.corrupted_ids is not None
        pair = answer_pair(item)  # the two logits each run is read at
        clean, corrupted = yield [
            Evaluation(item.token_ids, tag=("clean", item.index), logit_ids=pair),
            Evaluation(item.corrupted_ids, attach=False, save="corrupted", logit_ids=pair)]
        ld_clean, ld_corrupted = logit_difference(clean), logit_difference(corrupted)
        T = len(item.token_ids)
        differ = changed_positions(item)
        chosen = {"all": tuple(range(int(differ[0]), T)), "changed": tuple(int(p) for p in differ),
                  "last": (T - 1,)}
        layers, groups = self._layers(), self._groups()
        where: list[tuple[int, int, int]] = []  # (position class, layer, group) of each patched run
        passes: list[Evaluation] = []
        for c, name in enumerate(self.positions):
            positions = chosen[name]
            for j, layer in enumerate(layers):
                for g, group in enumerate(groups):
                    where.append((c, j, g))
                    # the corrupted run's state up to the patch: positions before it, layers before it
                    passes.append(Evaluation(item.corrupted_ids, tag=("patch", item.index, layer, group,
                                                                      positions),
                                             reuse="corrupted", start=positions[0], first_layer=layer,
                                             logit_ids=pair))
        patched = yield passes
        scores = np.full((len(self.positions), len(layers), len(groups)), np.nan)
        for (c, j, g), logits in zip(where, patched, strict=True):
            scores[c, j, g] = restored(logit_difference(logits), ld_clean, ld_corrupted)
        self._passes += len(passes)
        for key in [key for key in self._clean if key[0] == item.index]:
            del self._clean[key]
        self._scores.append(scores)
        if len(self._maps) < self.figure_items:
            self._maps.append((item.index, scores))
        result = ItemResult(values={"logit_diff_clean": ld_clean, "logit_diff_corrupted": ld_corrupted},
                            row={"changed_positions": [int(p) for p in differ]})
        for c, name in enumerate(self.positions):
            finite = np.isfinite(scores[c])
            result.values[f"{name}.max"] = float(np.nanmax(scores[c])) if finite.any() else math.nan
            result.series[f"{name}.best"] = {
                layer: float(np.nanmax(scores[c, j])) if finite[j].any() else math.nan
                for j, layer in enumerate(layers)}
        result.key = tuple(f"{name}.best" for name in self.positions)
        return result

    def _layers(self) -> tuple[int, ...]:
        return self.layers if self.layers is not None else tuple(range(self._layer_count))

    def _groups(self) -> list[tuple[int, ...]]:
        """The heads patched together in one run: each chosen head alone, or all of them at once."""
        heads = self.heads if self.heads is not None else tuple(range(self._head_count))
        return [heads] if self.together else [(head,) for head in heads]

    def _columns(self) -> list[str]:
        return ["together"] if self.together else [str(group[0]) for group in self._groups()]

    # -- results -----------------------------------------------------------------------------------

    def results(self) -> ExperimentResult:
        metrics = [Metric("items", float(len(self._scores))), Metric("patch_passes", float(self._passes))]
        if not self._scores:
            return ExperimentResult(metrics=metrics)
        stacked = np.stack(self._scores)  # [items, positions, layers, groups]
        finite = np.isfinite(stacked)
        n = finite.sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(finite, stacked, 0.0).sum(axis=0) / n
            deviation = np.where(finite, stacked - mean, 0.0)
            sem = np.sqrt((deviation ** 2).sum(axis=0) / (n - 1) / n)
        layers, columns = self._layers(), self._columns()
        rows = [{"positions": name, "layer": layer, "head": column, "mean_restored": _plain(mean[c, j, g]),
                 "sem": _plain(sem[c, j, g]), "n": int(n[c, j, g])}
                for c, name in enumerate(self.positions) for j, layer in enumerate(layers)
                for g, column in enumerate(columns)]
        top = []
        for name in self.positions:
            ranked = sorted((r for r in rows if r["positions"] == name and r["mean_restored"] is not None),
                            key=lambda r: -abs(r["mean_restored"]))
            top += [{"rank": rank, **r} for rank, r in enumerate(ranked[:TOP_HEADS], 1)]
        items, model = len(self._scores), self._model
        builders: dict[str, Any] = {"mean_restored": lambda: self._figure(
            mean, f"head patching, mean over n = {items} items" + (f" ({model})" if model else ""))}
        arrays = {"mean_restored": mean}
        for index, scores in self._maps:
            arrays[f"item{index}_restored"] = scores
            builders[f"item{index}_restored"] = lambda s=scores, i=index: self._figure(
                s, f"head patching, item {i}" + (f" ({model})" if model else ""))
        return ExperimentResult(metrics=metrics, tables={"heads": rows, "top_heads": top}, arrays=arrays,
                                figure_builders=builders)

    def _figure(self, scores: np.ndarray, title: str) -> SvgFigure:
        """Layers x heads, one panel per position class."""
        return score_maps(list(zip(self.positions, scores, strict=True)), self._layers(), self._columns(),
                          title, xlabel="head")


def _indices(values: Sequence[int] | int | None, what: str) -> tuple[int, ...] | None:
    """A sorted tuple of distinct indices from a list (or one index); None stays None (every one)."""
    if values is None:
        return None
    values = [values] if isinstance(values, int) else values
    if isinstance(values, str) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"head_patching: {what} must be a list of indices, got {values!r}")
    if not values:
        raise ConfigError(f"head_patching: {what} is empty; leave it out (null) for every one")
    return tuple(sorted(set(values)))


def _plain(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
