"""`logit_lens`: every layer's residual stream read out through the model's own final norm and
unembedding (the contract's `Readout`, v0.2). It only observes.

Per item (one prefill of the prompt): for every layer, the residual leaving it (`after_layer`) at every
position goes through `ctx.model.readout`. At the last position it scores the target token: the item's
answer (its first token), or without an answer the model's own prediction (the top token of the final
layer, which is the model's output). Per layer: the target's probability, rank (0 = top) and logit, the
KL divergence of the model's final distribution from this layer's, and the top-k tokens. At the last
layer the readout equals the model's logits bit for bit (tested), so the last layer's values are the
model's own: the lens takes them from the evaluation's logits.

Batched (contract v0.3): several items' prompts are evaluated as one batch, each sequence tagged with
its item's request. The hooks copy the rows each item needs at every layer; once the batch's layers are
done (`after_logits`) all of them go through the readout in one product, which costs far less per row
than one product per layer and item (SmolLM2, 1 thread, CPU time: one row 28 ms, 232 rows 2.6 ms a row).

Series (step = layer): `target_prob`, `target_rank`, `target_logit`, `kl_to_final`. Figures: for the first
`figure_items` items, a layers x positions map of the probability each layer gives the token that
position predicts (the next prompt token, the target at the last position); `logit_lens.html` shows the
same maps as tables with each layer's top token written in its cell (`ember.experiments.lens_view`).
"""

from __future__ import annotations

import itertools
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import (
    ExecutionContext,
    ExecutionPhase,
    LayerContext,
    ModelContext,
    TensorAccess,
)
from ember.experiments.failure import ExperimentError
from ember.experiments.labels import shorten, token_label
from ember.experiments.lens_view import lens_html
from ember.experiments.readout import log_normalizer
from ember.experiments.results import ExperimentResult
from ember.experiments.study import Evaluation, ItemResult, StudyItem
from ember.svg_figure import SvgFigure, heatmap_figure


@dataclass(frozen=True, slots=True)
class _Request:
    """The tag of one item's evaluation: which item, and whether every position is read out (its
    figure) or only the last."""

    item: int
    serial: int  # apart even when the same item is evaluated twice in one batch
    every_position: bool


class LogitLens(Experiment):
    """Read every layer's residual through the final norm and unembedding.

    Parameters: `top_k` (tokens listed per layer, default 5), `figure_items` (items that get a
    layers x positions figure, default 1), `name`.
    """

    may_write = False
    batched = True  # contract v0.3: its hooks read each sequence's rows by `ctx.spans`

    def __init__(self, top_k: int = 5, figure_items: int = 1, name: str = "logit_lens") -> None:
        if top_k < 1:
            raise ConfigError(f"logit_lens: top_k must be at least 1, got {top_k}")
        if figure_items < 0:
            raise ConfigError(f"logit_lens: figure_items must be 0 or more, got {figure_items}")
        self.name = name
        self.top_k = top_k
        self.figure_items = figure_items
        self._readout: Any = None
        self._layer_count = 0
        self._serial = itertools.count()
        self._figures_claimed = 0  # items that asked for every position (their figure)
        self._hidden: dict[_Request, dict[int, np.ndarray]] = {}   # rows copied at each layer
        self._logits: dict[_Request, dict[int, np.ndarray]] = {}   # their readout, per layer
        self._top_rows: list[dict[str, Any]] = []
        self._maps: list[dict[str, Any]] = []
        self._model = ""

    def on_model_loaded(self, ctx: ModelContext) -> None:
        if ctx.readout is None:
            raise ExperimentError("this engine offers no readout (contract v0.2), which the logit lens needs")
        self._readout = ctx.readout
        self._layer_count = ctx.layer_count
        self._model = ctx.model_id or ctx.architecture

    def before_prefill(self, ctx: ExecutionContext) -> None:
        self._hidden = {}  # nothing left of an evaluation that did not finish

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        if ctx.execution.phase is not ExecutionPhase.PREFILL:
            return
        values = hidden.values()
        final = ctx.layer_index == self._layer_count - 1
        for span in ctx.spans:
            request = span.tag
            if not isinstance(request, _Request):
                continue  # not one of this lens's items (a plain generation)
            first = span.rows.start if request.every_position else span.rows.stop - 1
            # the final layer's last row is the model's own logits: taken from the evaluation
            stop = span.rows.stop - 1 if final else span.rows.stop
            if first < stop:
                self._hidden.setdefault(request, {})[ctx.layer_index] = values[first:stop].copy()

    def after_logits(self, ctx: ExecutionContext, logits: TensorAccess) -> None:
        if ctx.phase is ExecutionPhase.PREFILL and self._hidden:
            self._read_out()

    def _read_out(self) -> None:
        """Every row the hooks copied, through the readout in one product; kept per request and layer."""
        parts = [(request, layer, rows) for request, by_layer in self._hidden.items()
                 for layer, rows in by_layer.items()]
        self._hidden = {}
        logits = self._readout.logits(np.concatenate([rows for _, _, rows in parts]))
        offset = 0
        for request, layer, rows in parts:
            self._logits.setdefault(request, {})[layer] = logits[offset:offset + len(rows)]
            offset += len(rows)

    # -- a study item ------------------------------------------------------------------------------

    def evaluate_item(self, item: StudyItem) -> Generator[Evaluation, np.ndarray, ItemResult]:
        every_position = self._figures_claimed < self.figure_items
        self._figures_claimed += int(every_position)
        request = _Request(item.index, next(self._serial), every_position)
        model_logits = yield Evaluation(item.token_ids, tag=request)
        read = self._logits.pop(request, {})
        layers = list(range(self._layer_count))
        final = np.asarray(model_logits, np.float32).reshape(1, -1)
        per_layer = [read[layer] for layer in layers[:-1]]
        per_layer.append(np.concatenate([read[layers[-1]], final]) if layers[-1] in read else final)
        stack = np.stack(per_layer)                                         # [L, T or 1, V]
        last = stack[:, -1, :]
        target = item.answer_id if item.answer_id is not None else int(np.argmax(model_logits))
        # log-probabilities are logits − normalizer: only the few read are formed (the whole [L, V] in
        # float64 took 24 of 25 ms an item on SmolLM2). KL(final ‖ layer) = Σ p_f (z_f − z_l) − n_f + n_l.
        normalizer = log_normalizer(last)                                   # [L]
        p_final = np.exp(last[-1].astype(np.float64) - normalizer[-1])
        kl = float(last[-1] @ p_final) - last @ p_final - normalizer[-1] + normalizer
        series = {
            "target_prob": np.exp(last[:, target] - normalizer),
            "target_rank": (last > last[:, target:target + 1]).sum(axis=-1).astype(np.float64),
            "target_logit": last[:, target].astype(np.float64),
            "kl_to_final": np.maximum(kl, 0.0),
        }
        top = _top_k(last, self.top_k)
        texts = self._readout.token_text(top.ravel())
        for i, layer in enumerate(layers):
            for rank in range(self.top_k):
                token = int(top[i, rank])
                self._top_rows.append({"item": item.index, "layer": layer, "rank": rank, "token_id": token,
                                       "token": texts[i * self.top_k + rank],
                                       "prob": float(np.exp(last[i, token] - normalizer[i]))})
        if every_position:
            self._maps.append(self._position_map(item, stack, target))
        target_text = self._readout.token_text([target])[0]
        by_layer = {name: {layer: float(v) for layer, v in zip(layers, values, strict=True)}
                    for name, values in series.items()}
        final_top = self._readout.token_text([int(np.argmax(last[-1]))])[0]
        return ItemResult(
            values={"final_target_prob": float(series["target_prob"][-1]),
                    "first_layer_top1": float(_first_layer_where(top[:, 0] == target, layers))},
            series=by_layer,
            row={"target": target_text, "model_top1": final_top},
            key=("target_prob", "kl_to_final"),
        )

    def _position_map(self, item: StudyItem, stack: np.ndarray, target: int) -> dict[str, Any]:
        predicted = [*item.token_ids[1:], target]
        positions = np.arange(stack.shape[1])
        probs = np.exp(stack[:, positions, predicted] - log_normalizer(stack))  # [L, T]
        tops = np.argmax(stack, axis=-1)                                   # [L, T]
        return {"item": item.index, "probs": probs, "text": item.text, "model": self._model,
                "tops": np.array(self._readout.token_text(tops.ravel()), dtype=object).reshape(tops.shape),
                "inputs": self._readout.token_text(item.token_ids),
                "predicted": self._readout.token_text(predicted)}

    def results(self) -> ExperimentResult:
        arrays = {f"item{m['item']}_target_probs": m["probs"] for m in self._maps}
        builders = {f"item{m['item']}_layers_by_positions": (lambda m=m: _map_figure(m)) for m in self._maps}
        files = {"logit_lens.html": self._html} if self._maps else {}
        return ExperimentResult(tables={"top_tokens": self._top_rows}, arrays=arrays,
                                figure_builders=builders, file_builders=files)

    def _html(self) -> bytes:
        return lens_html(self._maps, title=f"logit lens ({self._model})").encode("utf-8")


# Up to this k the top tokens are taken by k arg-max passes, above it by a partition. SmolLM2 (30 layers x
# 49,152 logits per item, 2-core Xeon, loaded): argpartition then a sort of 5 took 27 ms per item, five
# arg-max passes 3 ms (an arg-max is one vectorised scan; a partition moves every element).
_ARGMAX_UP_TO = 16


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Indices of each row's k largest values, largest first; of equal values, the lower index first."""
    k = min(k, logits.shape[-1])
    if k > _ARGMAX_UP_TO:
        kth = -np.partition(-logits, k - 1, axis=-1)[:, k - 1]               # each row's k-th largest
        top = np.empty((len(logits), k), dtype=np.intp)
        for r, row in enumerate(logits):
            above = np.flatnonzero(row > kth[r])
            chosen = np.concatenate([above, np.flatnonzero(row == kth[r])[:k - len(above)]])
            top[r] = chosen[np.argsort(-row[chosen], kind="stable")]
        return top
    work = np.array(logits, dtype=np.float32 if logits.dtype != np.float64 else np.float64)
    rows = np.arange(len(work))
    top = np.empty((len(work), k), dtype=np.intp)
    for rank in range(k):
        top[:, rank] = np.argmax(work, axis=-1)
        work[rows, top[:, rank]] = -np.inf
    return top


def _first_layer_where(hits: np.ndarray, layers: Sequence[int]) -> int:
    """The first layer from which the target stays the top token to the end (-1: not even at the end)."""
    for i in range(len(layers)):
        if hits[i:].all():
            return layers[i]
    return -1


def _map_figure(entry: dict[str, Any]) -> SvgFigure:
    """The map as a heatmap, written as SVG (`ember.svg_figure`, about a millisecond; through matplotlib
    it took 77 ms without cell texts and 0.3-0.5 s with them, 2-core Xeon and EPYC). Each layer's top
    token per cell is in `logit_lens.html`."""
    probs = entry["probs"]
    positions = probs.shape[1]
    labels = [token_label(i, t) for i, t in enumerate(entry["inputs"])] if positions <= 48 else None
    text = shorten(repr(entry.get("text", "")), 60)
    title = f"logit lens, item {entry['item']}: {text}\n{entry.get('model', '')}"
    return heatmap_figure(probs, title=title,
                          xlabel="position (input token); each cell's top token: logit_lens.html",
                          ylabel="layer", colour_label="probability of the predicted token", x_labels=labels)
