"""`direct_logit_attribution`: how much of the logit difference between an item's answer and its wrong
answer each component of the model writes straight into the residual stream.

The last position's residual after the last layer is a sum of what was written into it: the embedding,
each layer's attention output (itself a sum over the heads) and MLP output, and (Gemma 4) each layer's
per-layer-embedding term, each multiplied by the layer output scales that come after it. The logits
are the final norm and the LM head of that residual. The final norm divides by the residual's RMS, so
the logits are not linear in the parts; at the scale of the clean run's residual, held fixed, they are
(`Readout.logit_difference`, contract readout): then

    LD = Σ_components (U[answer] − U[wrong]) · (w ⊙ carried · component / scale)

exactly (up to float rounding), with `carried` the later layers' output scales (1 outside Gemma 4). This
is direct attribution: a component's effect through the layers after it (which read it) is not counted.
The softcap of Gemma 4 (and of Gemma 3 files that have one) is not linear either: attributions add up to
the logit difference before the softcap (`logit_diff_linear`); `logit_diff` is the model's own.

Per item (one clean evaluation): `embedding`, `rest` (Σ over layers of what the residual gained besides
attention and MLP: Gemma 4's per-layer-embedding terms; float rounding elsewhere),
`logit_diff` and `logit_diff_linear`, and series over layers `attention` and `mlp`. Over the study: the
mean per head (layers × heads array, heatmap figure, and a table of every head, largest first) and per
layer.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.failure import ExperimentError
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.study import Evaluation, ItemResult, StudyItem

if TYPE_CHECKING:
    from matplotlib.figure import Figure

class DirectLogitAttribution(Experiment):
    """The logit difference (answer − wrong answer) written by the embedding, each layer's attention and
    MLP, and each head, at the clean run's final-norm scale. Parameters: `name`."""

    may_write = False
    batched = True  # contract v0.3: its hooks read each sequence's last row by `ctx.spans`

    def __init__(self, name: str = "direct_logit_attribution") -> None:
        self.name = name
        self._readout: Any = None
        self._layers = 0
        self._heads = 0
        self._model = ""
        self._rows: dict[int, dict[tuple[str, int], np.ndarray]] = {}  # item → (part, layer) → last row
        self._head_sums: np.ndarray | None = None   # [layers, heads]
        self._layer_sums: np.ndarray | None = None  # [2, layers]: attention, MLP
        self._items = 0

    def on_model_loaded(self, ctx: ModelContext) -> None:
        readout = ctx.readout
        if readout is None or not readout.head_count:
            raise ExperimentError("this engine offers no attribution readout, which direct_logit_attribution "
                                  "needs")
        self._readout, self._layers, self._heads = readout, ctx.layer_count, readout.head_count
        self._model = ctx.model_id or ctx.architecture

    def check_items(self, items: Sequence[StudyItem]) -> None:
        for item in items:
            if item.answer_id is None or item.wrong_answer_id is None:
                raise ConfigError(f"item {item.index} has no answer or wrong answer; direct logit "
                                  f"attribution needs both (e.g. data=ioi)")

    # -- hooks: the last row of each tagged sequence -------------------------------------------------

    def _keep(self, part: str, ctx: LayerContext, tensor: TensorAccess) -> None:
        if ctx.execution.phase is not ExecutionPhase.PREFILL:
            return
        values = tensor.values()
        for span in ctx.spans:
            if span.tag is not None:
                last = values[span.rows.stop - 1]
                self._rows.setdefault(span.tag, {})[(part, ctx.layer_index)] = last.copy()

    def before_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        if ctx.layer_index == 0:
            self._keep("embedding", ctx, hidden)

    def attention_heads(self, ctx: LayerContext, heads: TensorAccess) -> None:
        self._keep("heads", ctx, heads)

    def after_attention(self, ctx: LayerContext, attention_output: TensorAccess) -> None:
        self._keep("attention", ctx, attention_output)

    def after_mlp(self, ctx: LayerContext, mlp_output: TensorAccess) -> None:
        self._keep("mlp", ctx, mlp_output)

    def after_layer(self, ctx: LayerContext, hidden: TensorAccess) -> None:
        self._keep("residual", ctx, hidden)

    # -- an item ---------------------------------------------------------------------------------------

    def evaluate_item(self, item: StudyItem) -> Generator[Any, Any, ItemResult]:
        answer, wrong = item.answer_id, item.wrong_answer_id
        assert answer is not None and wrong is not None
        (logits,) = yield [Evaluation(item.token_ids, tag=item.index)]
        parts = self.attribute(self._rows.pop(item.index), answer, wrong)
        self._items += 1
        if self._head_sums is None:
            self._head_sums = np.zeros_like(parts["heads"])
            self._layer_sums = np.zeros((2, self._layers))
        assert self._layer_sums is not None
        self._head_sums += parts["heads"]
        self._layer_sums += np.stack([parts["attention"], parts["mlp"]])
        layers = range(self._layers)
        return ItemResult(
            values={"logit_diff": float(logits[answer] - logits[wrong]),
                    "logit_diff_linear": parts["final"], "embedding": parts["embedding"],
                    "rest": float(parts["rest"].sum())},
            series={"attention": dict(zip(layers, parts["attention"].tolist(), strict=True)),
                    "mlp": dict(zip(layers, parts["mlp"].tolist(), strict=True))},
            key=("logit_diff_linear", "embedding"))

    def attribute(self, rows: dict[tuple[str, int], np.ndarray], answer: int, wrong: int) -> dict[str, Any]:
        """Every component's attribution from one sequence's last rows: `embedding` and `final` (floats),
        `attention`, `mlp`, `rest` ([layers]) and `heads` ([layers, heads]), float64."""
        readout, L = self._readout, self._layers
        carried = np.array([readout.carried(layer) for layer in range(L + 1)])
        stacked = {part: np.stack([rows[(part, layer)] for layer in range(L)])
                   for part in ("attention", "mlp", "residual")}  # its outputs, the residual after it
        final = stacked["residual"][L - 1]
        scale = float(readout.final_scale(final)[0])

        def attributed(vectors: np.ndarray) -> np.ndarray:
            return readout.logit_difference(vectors, answer, wrong, scale)

        before = np.concatenate([rows[("embedding", 0)][None], stacked["residual"][:-1]])
        attention, mlp = stacked["attention"], stacked["mlp"]
        # what each layer's residual gained besides attention and MLP, as it reaches the final norm
        rest = carried[1:, None] * stacked["residual"] - carried[:-1, None] * (before + attention + mlp)
        heads = np.stack([attributed(readout.head_contributions(i, rows[("heads", i)])[:, 0])
                          for i in range(L)])
        return {"embedding": float(carried[0] * attributed(before[0])[0]),
                "final": float(attributed(final)[0]),
                "attention": carried[:-1] * attributed(attention), "mlp": carried[:-1] * attributed(mlp),
                "rest": attributed(rest), "heads": carried[:-1, None] * heads}

    # -- the study -------------------------------------------------------------------------------------

    def results(self) -> ExperimentResult:
        metrics = [Metric("items", float(self._items))]
        if self._head_sums is None or self._layer_sums is None or not self._items:
            return ExperimentResult(metrics=metrics)
        heads = self._head_sums / self._items
        layers = self._layer_sums / self._items
        head_rows = sorted(({"layer": layer, "head": head, "mean_logit_diff": float(heads[layer, head])}
                            for layer in range(heads.shape[0]) for head in range(heads.shape[1])),
                           key=lambda row: -abs(row["mean_logit_diff"]))
        layer_rows = [{"layer": layer, "attention": float(layers[0, layer]), "mlp": float(layers[1, layer])}
                      for layer in range(layers.shape[1])]
        items, model = self._items, self._model
        return ExperimentResult(
            metrics=metrics, tables={"heads": head_rows, "layers": layer_rows},
            arrays={"head_logit_diff": heads, "layer_logit_diff": layers},
            figure_builders={"heads": lambda: _figure(heads, layers, items, model)})


def _figure(heads: np.ndarray, layers: np.ndarray, items: int, model: str) -> Figure:
    """Layers × heads heatmap of the mean attribution, and the per-layer attention and MLP beside it."""
    from matplotlib.figure import Figure

    count = heads.shape[0]
    figure = Figure(figsize=(4 + 0.45 * heads.shape[1] + 4, max(4, 0.22 * count + 1.5)), layout="constrained")
    grid, lines = figure.subplots(1, 2, gridspec_kw={"width_ratios": [max(heads.shape[1], 3), 6]})
    limit = max(float(np.abs(heads).max()), 1e-9)
    image = grid.imshow(heads, aspect="auto", origin="lower", cmap="RdBu_r", vmin=-limit, vmax=limit)
    grid.set_xlabel("head")
    grid.set_ylabel("layer")
    grid.set_xticks(range(heads.shape[1]))
    grid.set_title("heads")
    figure.colorbar(image, ax=grid, label="logit difference written (mean)")
    lines.plot(layers[0], range(count), label="attention")
    lines.plot(layers[1], range(count), label="MLP")
    lines.axvline(0.0, color="grey", linewidth=0.5)
    lines.set_ylim(-0.5, count - 0.5)
    lines.set_xlabel("logit difference written (mean)")
    lines.set_title("layers")
    lines.legend()
    figure.suptitle(f"direct logit attribution, answer − wrong answer, mean over n = {items} items"
                    + (f" ({model})" if model else ""))
    return figure
