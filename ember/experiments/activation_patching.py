"""`activation_patching` (causal tracing): which activations carry what distinguishes a clean prompt
from its corrupted twin.

Per item (a clean prompt, a corrupted prompt of the same token count, an answer and a wrong answer):

1. the clean run is recorded at every site: the residual entering each layer (`before_layer`, so layer
   0 is the embedding), the attention output and the MLP output (before their residual adds);
2. the corrupted run gives the baseline;
3. for each site, layer and position, the corrupted prompt is run again with that one activation
   replaced by the clean run's. The score is the share of the logit difference restored,

       (LD_patched - LD_corrupted) / (LD_clean - LD_corrupted),   LD = logit(answer) - logit(wrong answer)

   at the last position: 1 = the clean behaviour is back, 0 = no effect.

Positions before the first token where the prompts differ are not run: their activations are identical
in both runs (the model is causal), so the patch writes the same numbers and scores exactly 0.
`span="all"` patches every position of a layer at once (for the residual this restores 100%),
`span="none"` runs the patch passes writing nothing (a control: 0% up to float32 rounding).

The passes are batched (contract v0.3): an item's clean and corrupted runs, then all its patched runs
as one batch (and several items' side by side). Each patched run starts from the corrupted run's saved
state (prefix reuse): a patch at layer l and position p evaluates only positions p… from layer l on, as
nothing before either can change.

Per item, series over layers for each site and position class: `changed_first` and `changed_last` (the
first and last differing token), `after_changed` (the token after them) and `last` (the final
position). Figures: layers x position-class maps averaged over the items, and layers x positions maps
of the first `figure_items` items.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.labels import shorten, token_label
from ember.experiments.patching import (
    answer_pair,
    changed_positions,
    check_pairs,
    logit_difference,
    restored,
    score_maps,
    token_pairs,
)
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.study import Evaluation, ItemResult, StudyItem

if TYPE_CHECKING:
    from ember.svg_figure import SvgFigure

SITES = ("residual", "attention", "mlp")
SPANS = ("each", "all", "none")
CLASSES = ("changed_first", "changed_last", "after_changed", "last")


class ActivationPatching(Experiment):
    """Patch clean activations into the corrupted run, one (site, layer, position) at a time.

    Parameters: `sites` (any of residual, attention, mlp; default all three), `layers` (a list; default
    every layer), `span` ("each" position, "all" positions at once, "none": the control), `figure_items`
    (items that get their own layers x positions map, default 1), `name`.
    """

    may_write = True
    batched = True  # contract v0.3: its hooks read each sequence's rows by `ctx.spans`

    def __init__(self, sites: Sequence[str] | str = SITES, layers: Sequence[int] | None = None,
                 span: str = "each", figure_items: int = 1, name: str = "activation_patching") -> None:
        sites = [sites] if isinstance(sites, str) else list(sites)
        unknown = [s for s in sites if s not in SITES]
        if unknown or not sites:
            raise ConfigError(f"activation_patching: sites must be some of {', '.join(SITES)}, got {sites}")
        if span not in SPANS:
            raise ConfigError(f"activation_patching: span must be one of {', '.join(SPANS)}, got {span!r}")
        self.name = name
        self.sites = tuple(s for s in SITES if s in sites)
        self.layers = None if layers is None else tuple(sorted(set(int(x) for x in layers)))
        self.span = span
        self.figure_items = figure_items
        self._layer_count = 0
        self._clean: dict[tuple[int, str, int], np.ndarray] = {}  # (item, site, layer) → the clean rows
        self._class_sums: np.ndarray | None = None        # [sites, layers, classes] sums over items
        self._class_counts: np.ndarray | None = None
        self._maps: list[dict[str, Any]] = []
        self._items = 0
        self._passes = 0
        self._readout: Any = None
        self._model = ""

    # -- hooks -------------------------------------------------------------------------------------

    def on_model_loaded(self, ctx: ModelContext) -> None:
        self._layer_count = ctx.layer_count
        self._readout = ctx.readout
        self._model = ctx.model_id or ctx.architecture
        outside = [layer for layer in self.layers or () if not 0 <= layer < ctx.layer_count]
        if outside:
            raise ConfigError(f"activation_patching: layers {outside} are outside 0..{ctx.layer_count - 1}")

    def _site(self, site: str, ctx: LayerContext, tensor: TensorAccess) -> None:
        """Record the clean run's activations; write them into the patched runs at their target."""
        if ctx.execution.phase is not ExecutionPhase.PREFILL:
            return
        layer = ctx.layer_index
        for span in ctx.spans:
            tag = span.tag
            if tag is None:
                continue
            if tag[0] == "clean":
                self._clean[(tag[1], site, layer)] = tensor.values()[span.rows].copy()
            elif tag[2] == site and tag[3] == layer:  # ("patch", item, site, layer, first, stop)
                clean = self._clean[(tag[1], site, layer)]
                first, stop = tag[4], tag[5]
                if first < stop:
                    row = span.rows.start + first - span.start_position
                    tensor.values_mut()[row:row + stop - first] = clean[first:stop]

    def before_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        self._site("residual", ctx, hidden)

    def after_attention(self, ctx: LayerContext, attention_output: TensorAccess) -> None:
        self._site("attention", ctx, attention_output)

    def after_mlp(self, ctx: LayerContext, mlp_output: TensorAccess) -> None:
        self._site("mlp", ctx, mlp_output)

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
        layers = self.layers if self.layers is not None else tuple(range(self._layer_count))
        T = len(item.token_ids)
        differ = changed_positions(item)
        first, last_changed = int(differ[0]), int(differ[-1])
        columns: list[Any] = list(range(T)) if self.span == "each" else [self.span]
        scores = np.full((len(self.sites), len(layers), len(columns)), np.nan)
        patches: list[tuple[int, int, int]] = []  # (site, layer, column) of each patched run
        passes: list[Evaluation] = []
        for s, site in enumerate(self.sites):
            for j, layer in enumerate(layers):
                for k, column in enumerate(columns):
                    if column == "all":
                        positions = (0, T)
                    elif column == "none":
                        positions = (T - 1, T - 1)  # evaluates the last position, writes nothing
                    elif column < first:
                        scores[s, j, k] = 0.0  # identical in both runs: the patch changes nothing
                        continue
                    else:
                        positions = (column, column + 1)
                    patches.append((s, j, k))
                    # the corrupted run's state up to the patch: positions before it, layers before it
                    start = min(positions[0], T - 1)
                    passes.append(Evaluation(item.corrupted_ids, tag=("patch", item.index, site, layer,
                                                                      *positions),
                                             reuse="corrupted", start=start, first_layer=layer,
                                             logit_ids=pair))
        patched = yield passes
        for (s, j, k), logits in zip(patches, patched, strict=True):
            self._passes += 1
            scores[s, j, k] = restored(logit_difference(logits), ld_clean, ld_corrupted)
        for key in [key for key in self._clean if key[0] == item.index]:
            del self._clean[key]
        self._items += 1
        result = ItemResult(values={"logit_diff_clean": ld_clean, "logit_diff_corrupted": ld_corrupted},
                            row={"changed_positions": [int(p) for p in differ]})
        if self.span == "each":
            picks = {"changed_first": first, "changed_last": last_changed,
                     "after_changed": last_changed + 1 if last_changed + 1 < T else None, "last": T - 1}
            self._accumulate(scores, picks)
            for s, site in enumerate(self.sites):
                for name, position in picks.items():
                    if position is not None:
                        result.series[f"{site}.{name}"] = dict(zip(layers, scores[s, :, position].tolist(),
                                                                   strict=True))
                result.values[f"{site}.max"] = float(np.nanmax(scores[s])) if np.isfinite(scores[s]).any() \
                    else math.nan
            result.key = tuple(f"{site}.{name}" for site in self.sites for name in ("changed_last", "last"))
            if len(self._maps) < self.figure_items:
                self._maps.append({"item": item.index, "scores": scores, "layers": layers, "first": first,
                                   "tokens": token_pairs(self._readout, item), "model": self._model})
        else:
            for s, site in enumerate(self.sites):
                per_layer = scores[s, :, 0].tolist()
                result.series[f"{site}.{self.span}"] = dict(zip(layers, per_layer, strict=True))
            result.key = tuple(f"{site}.{self.span}" for site in self.sites)
        return result

    def _accumulate(self, scores: np.ndarray, picks: dict[str, int | None]) -> None:
        if self._class_sums is None:
            self._class_sums = np.zeros((scores.shape[0], scores.shape[1], len(CLASSES)))
            self._class_counts = np.zeros_like(self._class_sums)
        assert self._class_counts is not None
        for c, name in enumerate(CLASSES):
            position = picks[name]
            if position is None:
                continue
            values = scores[:, :, position]
            finite = np.isfinite(values)
            self._class_sums[:, :, c] += np.where(finite, values, 0.0)
            self._class_counts[:, :, c] += finite

    def results(self) -> ExperimentResult:
        metrics = [Metric("items", float(self._items)), Metric("patch_passes", float(self._passes))]
        builders: dict[str, Any] = {}
        arrays: dict[str, np.ndarray] = {}
        if self._class_sums is not None and self._class_counts is not None:
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = self._class_sums / self._class_counts
            arrays["mean_restored_by_class"] = mean
            layers = self.layers if self.layers is not None else tuple(range(self._layer_count))
            model = self._model
            builders["mean_restored"] = lambda: _class_figure(mean, self.sites, layers, self._items, model)
        for entry in self._maps:
            arrays[f"item{entry['item']}_restored"] = entry["scores"]
            builders[f"item{entry['item']}_restored"] = lambda e=entry: _item_figure(e, self.sites)
        return ExperimentResult(metrics=metrics, arrays=arrays, figure_builders=builders)


def _class_figure(mean: np.ndarray, sites: Sequence[str], layers: Sequence[int], items: int,
                  model: str = "") -> SvgFigure:
    return score_maps(list(zip(sites, mean, strict=True)), layers, [c.replace("_", "\n") for c in CLASSES],
                      f"activation patching, mean over n = {items} items" + (f" ({model})" if model else ""))


def _item_figure(entry: dict[str, Any], sites: Sequence[str]) -> SvgFigure:
    labels = [token_label(p, a) + ("" if a == b else f"\n{shorten(repr(b), 12)}")
              for p, (a, b) in enumerate(entry["tokens"])]
    model = entry.get("model")
    return score_maps(list(zip(sites, entry["scores"], strict=True)), entry["layers"], labels,
                      f"activation patching, item {entry['item']}" + (f" ({model})" if model else ""),
                      xlabel="position (clean token; corrupted token below where it differs)")
