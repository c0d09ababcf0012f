"""`attention_patterns`: where chosen attention heads look, over a prompt set. It only observes.

Per item (one prefill of the prompt) the `attention_pattern` stage of each chosen head is copied: the
post-softmax probabilities `[query rows, key positions]` of the item's own tokens (batched items: each
sequence's rows and its own columns, as `Record.sequence_rows` cuts them). `positions` chooses the query
rows kept (default every one; negative counts from the end, -1 the last token).

Summary, per head and item, from the last token's row (the position that predicts the answer, IOI's
END): `to_answer`, the attention on the prompt positions holding the answer's first token (IOI: the
indirect object's name, IO), `to_wrong_answer`, on those holding the wrong answer's (IOI: the subject,
S, both of its places summed), and `to_first`, on position 0 (BOS where the tokenizer adds one: the
"attention sink"). `to_answer` and `to_wrong_answer` need both answers in the item; an item whose prompt
does not contain the name has no value there.

Results: the per-item values `L<layer>H<head>.to_answer` … (aggregated over the items by the study), a
table `heads` with every head's means; the artifact `patterns.npz` (per item `item<i>.tokens` (ids),
`item<i>.queries` (the query positions kept) and `item<i>.L<layer>H<head>` `[queries, tokens]`, and
`heads` `[n, 2]` (layer, head)); per figure item a grid of the heads' patterns with token labels
(`item<i>_patterns`, at most `FIGURE_HEADS` heads a figure); and `attention_patterns.html`, a
self-contained interactive view (ember.experiments.attention_view) of the first `html_items` items.
"""

from __future__ import annotations

import io
import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.errors import ConfigError
from ember.experiments.attention_view import attention_html
from ember.experiments.base import Experiment
from ember.experiments.context import ExecutionPhase, LayerContext, ModelContext, TensorAccess
from ember.experiments.failure import ExperimentError
from ember.experiments.labels import shorten, token_label
from ember.experiments.results import ExperimentResult, Metric
from ember.experiments.study import Evaluation, ItemResult, StudyItem

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_HEADS = 12  # heads per figure (a grid); more heads make more figures
SUMMARIES = ("to_answer", "to_wrong_answer", "to_first")


@dataclass(frozen=True, slots=True)
class _Request:
    """The tag of one item's prefill."""

    item: int


@dataclass(slots=True)
class _Item:
    """What is kept of one item: its tokens, the query rows kept and each head's rows `[queries, T]`."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    queries: tuple[int, ...]
    patterns: np.ndarray                         # [heads, queries, T]
    marks: dict[str, tuple[int, ...]]            # "answer" / "wrong_answer" -> positions
    values: dict[str, float]


class AttentionPatterns(Experiment):
    """Copy chosen heads' attention patterns over a prompt set; figures, an .npz and an HTML view.

    Parameters: `heads` (a list of [layer, head] pairs) or `layers` (every head of these layers; not
    both; neither: every head of the last layer), `positions` (the query rows kept, default all;
    negative from the end), `figure_items` (items with a figure, default 1), `html_items` (items in the
    HTML view, default 20), `name`.
    """

    may_write = False
    batched = True  # contract v0.3: its hook reads each sequence's rows by `ctx.spans`

    def __init__(self, heads: Sequence[Any] | None = None, layers: Sequence[int] | None = None,
                 positions: Sequence[int] | None = None, figure_items: int = 1, html_items: int = 20,
                 name: str = "attention_patterns") -> None:
        if heads is not None and layers is not None:
            raise ConfigError("attention_patterns: give heads (a list of [layer, head]) or layers (every "
                              "head of them), not both")
        for what, value in (("figure_items", figure_items), ("html_items", html_items)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"attention_patterns: {what} must be a count (0 or more), got {value!r}")
        self.name = name
        self._asked_heads = _pairs(heads)
        self._asked_layers = _indices(layers, "layers")
        self.positions = _indices(positions, "positions", signed=True)
        self.figure_items = figure_items
        self.html_items = html_items
        self.heads: tuple[tuple[int, int], ...] = self._asked_heads or ()
        self._head_count = 0
        self._by_layer: dict[int, tuple[int, ...]] = {}
        self._caught: dict[tuple[int, int, int], np.ndarray] = {}  # (item, layer, head) -> [T, T]
        self._items: list[_Item] = []
        self._token_text: Any = None
        self._model = ""

    # -- the model ---------------------------------------------------------------------------------

    def check_model(self, ctx: ModelContext) -> None:
        """Refuse heads the model does not have (the runner asks before loading it)."""
        if not ctx.head_count:
            raise ConfigError("attention_patterns: the model context does not say how many heads a layer has")
        for layer, head in self._asked_heads or ():
            if not 0 <= layer < ctx.layer_count:
                raise ConfigError(f"attention_patterns: head [{layer}, {head}]: layer {layer} is outside "
                                  f"0..{ctx.layer_count - 1}")
            if not 0 <= head < ctx.head_count:
                raise ConfigError(f"attention_patterns: head [{layer}, {head}]: head {head} is outside "
                                  f"0..{ctx.head_count - 1} (this model has {ctx.head_count} heads per "
                                  f"layer)")
        outside = [layer for layer in self._asked_layers or () if not 0 <= layer < ctx.layer_count]
        if outside:
            raise ConfigError(f"attention_patterns: layers {outside} are outside 0..{ctx.layer_count - 1}")

    def on_model_loaded(self, ctx: ModelContext) -> None:
        self.check_model(ctx)
        self._head_count = ctx.head_count
        if self._asked_heads is not None:
            self.heads = self._asked_heads
        else:
            layers = self._asked_layers if self._asked_layers is not None else (ctx.layer_count - 1,)
            self.heads = tuple((layer, head) for layer in layers for head in range(ctx.head_count))
        self._by_layer = {}
        for layer, head in self.heads:
            self._by_layer[layer] = (*self._by_layer.get(layer, ()), head)
        readout = ctx.readout
        self._token_text = readout.token_text if readout is not None else None
        self._model = ctx.model_id or ctx.architecture

    def attention_pattern(self, ctx: LayerContext, pattern: TensorAccess) -> None:
        """Copy the chosen heads' rows of each of this experiment's sequences (its own columns)."""
        heads = self._by_layer.get(ctx.layer_index)
        if not heads or ctx.execution.phase is not ExecutionPhase.PREFILL:
            return
        values = pattern.values()
        rows = values.shape[0] // self._head_count  # [heads × rows, positions]
        by_head = values.reshape(self._head_count, rows, values.shape[1])
        for span in ctx.spans:
            if not isinstance(span.tag, _Request):
                continue
            own = span.start_position + span.rows.stop - span.rows.start  # its positions: its columns
            for head in heads:
                self._caught[(span.tag.item, ctx.layer_index, head)] = by_head[head, span.rows, :own].copy()

    # -- a study item ------------------------------------------------------------------------------

    def check_items(self, items: Sequence[StudyItem]) -> None:
        """Every chosen query position must be inside every item's prompt."""
        for item in items:
            T = len(item.token_ids)
            outside = [p for p in self.positions or () if not -T <= p < T]
            if outside:
                raise ConfigError(f"positions {outside} are outside item {item.index}'s {T} tokens "
                                  f"(0..{T - 1}, or -{T}..-1 from the end)")

    def evaluate_item(self, item: StudyItem) -> Generator[Evaluation, Any, ItemResult]:
        yield Evaluation(item.token_ids, tag=_Request(item.index))
        T = len(item.token_ids)
        try:
            full = np.stack([self._caught.pop((item.index, layer, head)) for layer, head in self.heads])
        except KeyError:
            raise ExperimentError("the engine showed no attention_pattern for a chosen head; this "
                                  "experiment needs that stage") from None
        queries = tuple(range(T) if self.positions is None else sorted({p % T for p in self.positions}))
        marks = {"answer": _where(item.token_ids, item.answer_id),
                 "wrong_answer": _where(item.token_ids, item.wrong_answer_id)}
        last = full[:, T - 1, :].astype(np.float64)  # [heads, T]: the last token's row
        values: dict[str, float] = {}
        for k, (layer, head) in enumerate(self.heads):
            prefix = f"L{layer}H{head}"
            values[f"{prefix}.to_first"] = float(last[k, 0])
            if item.answer_id is not None and item.wrong_answer_id is not None:
                for mark, positions in marks.items():
                    if positions:
                        values[f"{prefix}.to_{mark}"] = float(last[k, list(positions)].sum())
        self._items.append(_Item(item.index, item.text, tuple(item.token_ids), queries,
                                 np.ascontiguousarray(full[:, queries, :]), marks, values))
        first = f"L{self.heads[0][0]}H{self.heads[0][1]}"
        key = tuple(name for name in (f"{first}.to_answer", f"{first}.to_wrong_answer") if name in values)
        return ItemResult(values=values, row={f"{mark}_positions": list(p) for mark, p in marks.items()},
                          key=key or (f"{first}.to_first",))

    # -- results -----------------------------------------------------------------------------------

    def results(self) -> ExperimentResult:
        metrics = [Metric("items", float(len(self._items)))]
        if not self._items:
            return ExperimentResult(metrics=metrics)
        rows = []
        for layer, head in self.heads:
            row: dict[str, Any] = {"layer": layer, "head": head}
            for summary in SUMMARIES:
                seen = [i.values[f"L{layer}H{head}.{summary}"] for i in self._items
                        if f"L{layer}H{head}.{summary}" in i.values]
                row[f"mean_{summary}"] = float(np.mean(seen)) if seen else None
                row[f"n_{summary}"] = len(seen)
            rows.append(row)
        builders: dict[str, Any] = {}
        for entry in self._items[:self.figure_items]:
            for part, start in enumerate(range(0, len(self.heads), FIGURE_HEADS)):
                suffix = "" if len(self.heads) <= FIGURE_HEADS else f"_{part + 1}"
                builders[f"item{entry.index}_patterns{suffix}"] = (
                    lambda e=entry, s=start: self._figure(e, slice(s, s + FIGURE_HEADS)))
        files = {"patterns.npz": self._npz, "attention_patterns.html": self._html}
        return ExperimentResult(metrics=metrics, tables={"heads": rows}, figure_builders=builders,
                                file_builders=files)

    def patterns(self) -> dict[str, np.ndarray]:
        """What `patterns.npz` holds (module docstring), by name."""
        arrays: dict[str, np.ndarray] = {"heads": np.array(self.heads, dtype=np.int64).reshape(-1, 2)}
        for entry in self._items:
            arrays[f"item{entry.index}.tokens"] = np.array(entry.token_ids, dtype=np.int64)
            arrays[f"item{entry.index}.queries"] = np.array(entry.queries, dtype=np.int64)
            for k, (layer, head) in enumerate(self.heads):
                arrays[f"item{entry.index}.L{layer}H{head}"] = entry.patterns[k]
        return arrays

    def _npz(self) -> bytes:
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **self.patterns())
        return buffer.getvalue()

    def _html(self) -> bytes:
        items = [{"index": e.index, "text": e.text, "tokens": self._texts(e.token_ids),
                  "queries": list(e.queries), "patterns": e.patterns,
                  "marks": {mark: list(p) for mark, p in e.marks.items()}}
                 for e in self._items[:self.html_items]]
        return attention_html(items, self.heads, title=f"attention patterns ({self._model})").encode("utf-8")

    def _texts(self, ids: Sequence[int]) -> list[str]:
        return self._token_text(ids) if self._token_text is not None else [str(i) for i in ids]

    def _figure(self, entry: _Item, chosen: slice) -> Figure:
        """A grid of the heads' patterns: query rows down, key positions across, token labels."""
        from matplotlib.figure import Figure

        heads = self.heads[chosen]
        patterns = entry.patterns[chosen]
        labels = [token_label(p, t, 10) for p, t in enumerate(self._texts(entry.token_ids))]
        T, Q = len(entry.token_ids), len(entry.queries)
        columns = min(len(heads), 3)
        grid_rows = math.ceil(len(heads) / columns)
        size = max(3.5, 0.32 * T + 1.5)
        figure = Figure(figsize=(size * columns + 1, max(2.5, 0.32 * Q + 1.8) * grid_rows),
                        layout="constrained")
        axes = figure.subplots(grid_rows, columns, squeeze=False)
        image = None
        for k, ax in enumerate(axes.flat):
            if k >= len(heads):
                ax.set_visible(False)
                continue
            image = ax.imshow(patterns[k], aspect="auto", cmap="Blues", vmin=0.0, vmax=1.0,
                              interpolation="nearest")
            ax.set_xticks(range(T), labels, fontsize=5)
            ax.set_yticks(range(Q), [labels[q].replace("\n", " ") for q in entry.queries], fontsize=5)
            ax.set_title(f"layer {heads[k][0]}, head {heads[k][1]}", fontsize=9)
        if image is not None:
            figure.colorbar(image, ax=axes, label="attention (query row → key position)", shrink=0.6)
        figure.suptitle(f"attention patterns, item {entry.index}: {shorten(repr(entry.text), 70)}\n"
                        f"{self._model}", fontsize=10)
        return figure


def _where(ids: Sequence[int], token: int | None) -> tuple[int, ...]:
    """The positions holding `token` (none for None)."""
    return () if token is None else tuple(p for p, t in enumerate(ids) if t == token)


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pairs(values: Sequence[Any] | None) -> tuple[tuple[int, int], ...] | None:
    """[[layer, head], ...] as distinct (layer, head) pairs in the order given; None stays None."""
    if values is None:
        return None
    shown = (f"attention_patterns: heads must be a list of [layer, head] pairs, e.g. [[9, 3], [22, 0]], "
             f"got {values!r}")
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise ConfigError(shown)
    pairs: list[tuple[int, int]] = []
    for value in values:
        if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2 \
                or not all(_is_index(v) for v in value):
            raise ConfigError(shown)
        pair = (int(value[0]), int(value[1]))
        if pair not in pairs:
            pairs.append(pair)
    return tuple(pairs)


def _indices(values: Sequence[int] | int | None, what: str, signed: bool = False) -> tuple[int, ...] | None:
    """A sorted tuple of distinct indices from a list (or one index); None stays None (every one)."""
    if values is None:
        return None
    values = [values] if _is_index(values) else values
    if isinstance(values, str) or not isinstance(values, Sequence) or not all(_is_index(v) for v in values) \
            or (not signed and any(v < 0 for v in values)):
        raise ConfigError(f"attention_patterns: {what} must be a list of indices, got {values!r}")
    if not values:
        raise ConfigError(f"attention_patterns: {what} is empty; leave it out (null) for every one")
    return tuple(sorted(set(values)))
