"""Which rows an evaluation computes, and the attention that ties each row to its own sequence.

A family's forward pass is written once, over `rows`:

    for i, layer in enumerate(layers):
        h, ws = rows.enter(i)                    # the residual rows evaluated from layer i on
        ...  q, k, v (rope at rows.take(cos_table, T)) ...
        heads = rows.attend(i, q, k, v, ...)     # each row against the keys of its own sequence
        ...
    logits = final_norm_and_logits(h, ..., rows)

Two kinds of rows:

* `SequenceRows`: one sequence at positions start… over a KV cache (generation: prefill and decode).
  `enter` returns the whole workspace; `attend` stores k, v in the cache and attends over it.
* `BatchRows`: several sequences of any lengths stacked into one workspace ([sum of lengths, hidden]),
  so that every matrix product runs once over all of them (`ember.batch`). A sequence may start from
  the saved state of an earlier evaluation (prefix reuse): its rows start at position `start` (the
  positions before read the saved keys and values) and at layer `first_layer` (the layers before are
  the saved run's: its rows join the batch there, with the saved residual). Sequences are stacked in
  order of their first layer, so the rows evaluated at layer i are always the first `live[i]` rows.

Everything here is bookkeeping and attention; the math of a layer stays in the family's file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember import ops, parallel
from ember.ops import attention, sliding_window_attention

Show = Callable[[np.ndarray], None]  # a stage's hook at one layer, shown a formed array
ShowKeys = Callable[[np.ndarray, np.ndarray], None]  # shown a shared layer's keys and values


@dataclass(slots=True)
class SavedState:
    """What later evaluations of tokens that agree with these may start from: the residual entering
    every layer ([T, H] each) and every layer's keys and values as attention reads them
    ([kv heads, T, head dim]; None for a layer that reads another layer's, Gemma 4's shared KV)."""

    token_ids: np.ndarray
    residual: list[np.ndarray]
    keys: list[np.ndarray | None]
    values: list[np.ndarray | None]

    @property
    def nbytes(self) -> int:
        arrays = [*self.residual, *(k for k in self.keys if k is not None),
                  *(v for v in self.values if v is not None)]
        return sum(int(a.nbytes) for a in arrays)


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One sequence of a batch: `token_ids` is the whole sequence (positions 0…T−1); its rows
    `start`…T−1 are evaluated from layer `first_layer` on. `start` > 0 or `first_layer` > 0 needs
    `prefix`, the saved evaluation those positions and layers are taken from; `save` keeps this
    evaluation's state; `tag` is shown to the hooks with the sequence (the experiment's own label).
    `logit_ids`: the vocabulary entries whose logits are read (the caller gets those alone, in that
    order); None: all of them."""

    token_ids: np.ndarray
    start: int = 0
    first_layer: int = 0
    prefix: SavedState | None = None
    save: bool = False
    tag: Any = None
    logit_ids: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return len(self.token_ids) - self.start


def check_logit_ids(ids: np.ndarray, vocab_size: int) -> None:
    """Refuse logit ids outside the vocabulary (ValueError naming them)."""
    if not np.all((ids >= 0) & (ids < vocab_size)):
        raise ValueError(f"logit_ids {ids.tolist()} go outside the vocabulary's {vocab_size} entries")


def check_entry(entry: BatchEntry, layer_count: int, vocab_size: int) -> None:
    """Refuse an entry whose reuse would not mean what it says, or whose logit ids are outside the
    vocabulary (ValueError naming the field)."""
    T = len(entry.token_ids)
    if T == 0:
        raise ValueError("a batch entry has no tokens")
    if entry.logit_ids is not None:
        check_logit_ids(entry.logit_ids, vocab_size)
    if not 0 <= entry.start < T:
        raise ValueError(f"start {entry.start} is outside the sequence's {T} positions")
    if not 0 <= entry.first_layer < layer_count:
        raise ValueError(f"first_layer {entry.first_layer} is outside 0…{layer_count - 1}")
    if entry.prefix is None:
        if entry.start or entry.first_layer:
            raise ValueError("start and first_layer need a prefix (a saved evaluation)")
        return
    saved = entry.prefix.token_ids
    # Positions before `start` read the saved keys: their tokens must be the saved run's. Layers before
    # `first_layer` are not computed at all: then every token must be the saved run's.
    agree = T if entry.first_layer else entry.start
    if len(saved) < agree or not np.array_equal(saved[:agree], entry.token_ids[:agree]):
        what = "all its tokens" if entry.first_layer else f"its first {agree} tokens"
        raise ValueError(f"a sequence reusing a saved evaluation must share {what} with it")


class SequenceRows:
    """One sequence at positions start_position…start_position+T−1 over a KV cache."""

    columns = None  # the LM head forms every logit (`BatchRows.columns`)

    def __init__(self, token_ids: np.ndarray, start_position: int, cache: Any, ws: Any) -> None:
        self.token_ids = token_ids
        self.start_position = start_position
        self.count = len(token_ids)
        self.cache = cache
        self.ws = ws
        self.kept: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = {}

    @property
    def hidden(self) -> np.ndarray:
        return self.ws.hidden

    def begin(self, hooks: Any, phase: Any) -> None:
        hooks.begin_evaluation(phase, self.start_position, self.count)

    def enter(self, layer: int) -> tuple[np.ndarray, Any]:
        return self.ws.hidden, self.ws

    def take(self, table: np.ndarray, rows: int) -> np.ndarray:
        """The rows of a per-position table (rope's cos or sin) for the evaluated positions."""
        return table[self.start_position:self.start_position + rows]

    def positions(self, rows: int) -> np.ndarray:
        return np.arange(self.start_position, self.start_position + rows, dtype=np.float64)

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float, window: int,
               out: np.ndarray, ws: Any, keep: bool = False, pattern: Show | None = None,
               softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
        """Store k, v at the evaluated positions of layer `layer`'s cache, then attention of q over every
        visible key (a sliding layer's window masked). `keep`: remember them for `attend_shared`.
        `pattern`: form the attention pattern explicitly and show it (`patterned_attention`). `softcap`
        c > 0: each scaled score s becomes c·tanh(s/c) before the mask and softmax (Gemma 2). `sinks`
        [heads]: one more logit in each head's softmax, with no value (gpt-oss; `ops.attention`)."""
        stored = self.cache.store(layer, self.start_position, k, v)
        keys, values = stored[0], stored[1]
        key_positions = stored[2] if len(stored) == 3 else None
        if keep:
            self.kept[layer] = (keys, values, key_positions)
        return self._attention(q, keys, values, key_positions, scale, window, out, ws, pattern, softcap,
                               sinks)

    def attend_shared(self, layer: int, source: int, q: np.ndarray, *, scale: float, window: int,
                      out: np.ndarray, ws: Any, pattern: Show | None = None,
                      inputs: ShowKeys | None = None) -> np.ndarray:
        """Attention of q over the keys and values layer `source` stored (Gemma 4's shared KV).
        `inputs`: show the evaluated rows' keys and values ([T, kv heads, hd] copies); what it leaves in
        them is what this layer reads (a copy of the source's: the source and the other layers sharing
        them are not changed)."""
        keys, values, key_positions = self.kept[source]
        if inputs is not None:
            positions = key_positions if key_positions is not None else np.arange(keys.shape[1])
            own = np.flatnonzero(positions >= self.start_position)
            own = own[np.argsort(positions[own])]
            k, v = keys[:, own].transpose(1, 0, 2).copy(), values[:, own].transpose(1, 0, 2).copy()
            inputs(k, v)
            keys, values = keys.copy(), values.copy()
            keys[:, own], values[:, own] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
        return self._attention(q, keys, values, key_positions, scale, window, out, ws, pattern)

    def _attention(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                   key_positions: np.ndarray | None, scale: float, window: int, out: np.ndarray,
                   ws: Any, pattern: Show | None = None, softcap: float = 0.0,
                   sinks: np.ndarray | None = None) -> np.ndarray:
        T = q.shape[0]
        if pattern is not None:
            positions = key_positions if key_positions is not None else np.arange(keys.shape[1])
            filled = positions >= 0  # a ring's empty slots hold −1
            if not filled.all():
                keys, values, positions = keys[:, filled], values[:, filled], positions[filled]
            rows = np.arange(self.start_position, self.start_position + T)
            probabilities = np.zeros((q.shape[1], T, self.start_position + T), np.float32)
            form_pattern(q, keys, positions, rows, scale, window, probabilities, softcap, sinks)
            if written(pattern, probabilities):
                return apply_pattern(probabilities, values, positions, rows, window, out)
        if window and T > 1:
            return sliding_window_attention(q, keys, values, key_positions, self.start_position, window,
                                            scale, out, softcap, sinks)
        score_scratch = getattr(ws, "score_scratch", None)
        if T == 1 and score_scratch is not None:
            kv_heads = keys.shape[0]
            score_scratch = score_scratch.reshape(kv_heads, q.shape[1] // kv_heads, 1)
        # a full layer's cache holds positions 0…end−1 in order (the chunks skip their future keys); a
        # sliding layer's single row reads its ring with the positions, so nothing outside is seen
        return attention(q, keys, values, start_position=self.start_position, scale=scale, out=out,
                         score_buffer=getattr(ws, "score_buffer", None), row_scratch=score_scratch,
                         spread_buffer=getattr(ws, "score_spread", None),
                         key_positions=key_positions if window else None, sliding_window=window,
                         softcap=softcap, sinks=sinks)

    def last_rows(self) -> np.ndarray | None:
        return None  # the last row of the workspace

    def finish(self) -> None:
        self.cache.length = self.start_position + self.count


@dataclass(slots=True)
class _Saving:
    """The state of one entry being saved as it is evaluated."""

    entry: int
    residual: list[np.ndarray | None] = field(default_factory=list)
    keys: list[np.ndarray | None] = field(default_factory=list)
    values: list[np.ndarray | None] = field(default_factory=list)


class BatchRows:
    """Several sequences stacked into one workspace; see the module docstring.

    `order[k]` is the entry (in the caller's order) whose rows are the k-th span of the stack; entries
    are stacked by first layer, so `live[i]` (the rows evaluated at layer i) covers a prefix of the stack.
    `columns`: the vocabulary entries the LM head forms logits for, in that order (None: all of them);
    a caller that reads a few logits of each sequence (a logit difference) spares the rest of the head.
    """

    def __init__(self, entries: Sequence[BatchEntry], ws: Any, layer_count: int,
                 indices: Sequence[int] | None = None, columns: np.ndarray | None = None) -> None:
        self.entries = list(entries)
        self.ws = ws
        self.columns = columns
        order = sorted(range(len(entries)), key=lambda e: entries[e].first_layer)
        self.order = order if indices is None else [int(indices[e]) for e in order]  # the caller's indices
        stacked = [entries[e] for e in order]  # `entries` is this part's: its own indices
        counts = np.array([e.rows for e in stacked], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.counts = counts
        self.starts = np.array([e.start for e in stacked], np.int64)
        self.first_layers = np.array([e.first_layer for e in stacked], np.int64)
        self.count = int(self.offsets[-1])
        self.token_ids = np.concatenate([e.token_ids[e.start:] for e in stacked]).astype(np.int64)
        self.row_positions = np.concatenate([np.arange(e.start, len(e.token_ids)) for e in stacked])
        self.row_entry = np.repeat(np.arange(len(stacked)), counts)  # stacked entry of each row
        # entries live at layer i: those whose first layer is ≤ i (a prefix of the stack)
        live_entries = np.searchsorted(self.first_layers, np.arange(layer_count), side="right")
        self.live_entries = live_entries
        self.live = self.offsets[live_entries]
        self.stacked = stacked
        prefixes: list[SavedState] = []
        for entry in stacked:
            if entry.prefix is not None and all(entry.prefix is not p for p in prefixes):
                prefixes.append(entry.prefix)
        self.prefixes = prefixes
        self.prefix_index = np.array([next((j for j, p in enumerate(prefixes) if p is e.prefix), -1)
                                      for e in stacked], np.int64)
        self._workspaces: dict[int, Any] = {}
        self._taken: dict[int, np.ndarray] = {}
        self.kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.saving = [_Saving(k) for k, e in enumerate(stacked) if e.save]
        self.saved: dict[int, SavedState] = {}  # caller's index → its saved state

    @property
    def hidden(self) -> np.ndarray:
        return self.ws.hidden

    def begin(self, hooks: Any, phase: Any) -> None:
        hooks.begin_batch(self)

    # -- layers ----------------------------------------------------------------------------------

    def enter(self, layer: int) -> tuple[np.ndarray, Any]:
        """The residual rows evaluated from layer `layer` on, with the entries whose first layer this is
        joined (their rows take the saved residual), and the workspace cut to as many rows."""
        first = self.live_entries[layer - 1] if layer else 0
        for k in range(first, self.live_entries[layer]):
            entry = self.stacked[k]
            if entry.first_layer == layer and layer > 0:
                assert entry.prefix is not None
                span = slice(self.offsets[k], self.offsets[k + 1])
                self.ws.hidden[span] = entry.prefix.residual[layer][entry.start:len(entry.token_ids)]
        rows = int(self.live[layer])
        h = self.ws.hidden[:rows]
        for saving in self.saving:
            self._save_residual(saving, layer, h)
        return h, self.workspace(rows)

    def workspace(self, rows: int) -> Any:
        """The workspace's buffers cut to their first `rows` rows (views, made once per row count)."""
        if rows == self.count:
            return self.ws
        ws = self._workspaces.get(rows)
        if ws is None:
            ws = self._workspaces[rows] = self.ws.head(rows)
        return ws

    def take(self, table: np.ndarray, rows: int) -> np.ndarray:
        """The rows of a per-position table (rope's cos or sin) for the first `rows` rows' positions."""
        taken = self._taken.get(id(table))
        if taken is None:
            taken = self._taken[id(table)] = np.ascontiguousarray(table[self.row_positions])
        return taken[:rows]

    def positions(self, rows: int) -> np.ndarray:
        return self.row_positions[:rows].astype(np.float64)

    # -- attention -------------------------------------------------------------------------------

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float, window: int,
               out: np.ndarray, ws: Any, keep: bool = False, pattern: Show | None = None,
               softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
        """Each row's attention over its own sequence: the saved keys before its sequence's start, then
        its sequence's own rows up to itself (a sliding layer's window masked). `pattern`, `softcap`: as
        `SequenceRows.attend`, a row's columns its own sequence's positions."""
        k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        if keep:  # copies: k and v may be views of the workspace (one row, or Gemma 4's V from K), which
            # later layers overwrite before the layers sharing them read them
            k, v = k.copy(), v.copy()
            self.kept[layer] = (k, v)
        for saving in self.saving:
            self._save_keys(saving, layer, k, v)
        entries = int(self.live_entries[layer])
        prefix_keys, prefix_values, prefix_length = self._prefix(layer, entries)
        own = np.ones(entries, np.int64)
        return self._ragged(q, k, v, prefix_keys, prefix_values, prefix_length, own, scale, window, out,
                            pattern, softcap, sinks)

    def attend_shared(self, layer: int, source: int, q: np.ndarray, *, scale: float, window: int,
                      out: np.ndarray, ws: Any, pattern: Show | None = None,
                      inputs: ShowKeys | None = None) -> np.ndarray:
        """Attention over the keys and values layer `source` formed (Gemma 4's shared KV). A sequence that
        joined after `source` did not form its own there: all its keys are the saved run's. `inputs`: as
        `SequenceRows.attend_shared`."""
        k, v = self.kept.get(source, (None, None))
        entries = int(self.live_entries[layer])
        prefix_keys, prefix_values, prefix_length = self._prefix(source, entries)
        own = (self.first_layers[:entries] <= source).astype(np.int64)
        late = own == 0
        prefix_length[late] = self.starts[:entries][late] + self.counts[:entries][late]
        if k is None:  # no sequence was live at the source layer: no own keys (and the kernel reads none)
            k = np.zeros((1, prefix_keys.shape[1], prefix_keys.shape[3]), np.float32)
            v = np.zeros((1, prefix_values.shape[1], prefix_values.shape[3]), np.float32)
        if inputs is not None:
            k, v = self._show_shared(inputs, q.shape[0], k, v, prefix_keys, prefix_values, own)
        return self._ragged(q, k, v, prefix_keys, prefix_values, prefix_length, own, scale, window, out,
                            pattern)

    def _show_shared(self, inputs: ShowKeys, rows: int, k: np.ndarray, v: np.ndarray, prefix_keys: np.ndarray,
                     prefix_values: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Show each live row's key and value as a shared layer reads them (its own row of the source
        layer's, or the saved run's for a sequence that joined later), and take back what was written:
        into copies of k and v, and into `prefix_keys`/`prefix_values` (built for this call)."""
        shown_k = np.empty((rows, *k.shape[1:]), np.float32)
        shown_v = np.empty((rows, *v.shape[1:]), np.float32)
        spans = []
        for e in range(len(own)):
            span = slice(int(self.offsets[e]), int(self.offsets[e + 1]))
            saved = slice(int(self.starts[e]), int(self.starts[e] + self.counts[e]))
            spans.append((e, span, saved))
            if own[e]:
                shown_k[span], shown_v[span] = k[span], v[span]
            else:
                source = int(self.prefix_index[e])
                shown_k[span] = prefix_keys[source, :, saved].transpose(1, 0, 2)
                shown_v[span] = prefix_values[source, :, saved].transpose(1, 0, 2)
        inputs(shown_k, shown_v)
        k, v = k.copy(), v.copy()
        for e, span, saved in spans:
            if own[e]:
                k[span], v[span] = shown_k[span], shown_v[span]
            else:
                source = int(self.prefix_index[e])
                prefix_keys[source, :, saved] = shown_k[span].transpose(1, 0, 2)
                prefix_values[source, :, saved] = shown_v[span].transpose(1, 0, 2)
        return k, v

    def _prefix(self, layer: int, entries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The saved keys and values of layer `layer` of every prefix, stacked ([prefixes, kv, T, hd]),
        and how many of them each live entry reads (its start)."""
        length = np.where(self.prefix_index[:entries] >= 0, self.starts[:entries], 0).astype(np.int64)
        if not self.prefixes:
            empty = np.zeros((1, 1, 1, 1), np.float32)
            return empty, empty, length
        longest = max(len(p.token_ids) for p in self.prefixes)
        first = next(p.keys[layer] for p in self.prefixes)
        assert first is not None
        kv, _, hd = first.shape
        keys = np.zeros((len(self.prefixes), kv, longest, hd), np.float32)
        values = np.zeros_like(keys)
        for j, saved in enumerate(self.prefixes):
            saved_keys, saved_values = saved.keys[layer], saved.values[layer]
            assert saved_keys is not None and saved_values is not None
            keys[j, :, :saved_keys.shape[1]] = saved_keys
            values[j, :, :saved_values.shape[1]] = saved_values
        return keys, values, length

    def _ragged(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, prefix_keys: np.ndarray,
                prefix_values: np.ndarray, prefix_length: np.ndarray, own: np.ndarray, scale: float,
                window: int, out: np.ndarray, pattern: Show | None = None,
                softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
        rows = q.shape[0]
        if rows == 0:  # no sequence is evaluated at this layer yet (all join later)
            return out
        q = np.ascontiguousarray(q)
        heads = out.reshape(rows, q.shape[1], -1)
        entries = len(prefix_length)
        layout = (self.offsets[:entries + 1], self.starts[:entries], self.prefix_index[:entries],
                  prefix_length, own, self.row_entry[:rows], self.row_positions[:rows])
        shown = pattern is not None and patterned_ragged(q, k, v, prefix_keys, prefix_values, *layout, scale,
                                                         window, pattern, out, softcap, sinks)
        if shown:  # the hook wrote the pattern: `out` holds the heads formed from it
            return out
        if ops.token_ops() is not None:
            kernel = ops.token_ops().ragged_attention
            sink_logits = ops.token_ops().NO_SINKS if sinks is None else sinks
            parallel.share_ranges(rows, rows * q.shape[1] * 64, lambda start, stop: kernel(
                q, k, v, prefix_keys, prefix_values, *layout, np.float32(scale), window, float(softcap),
                sink_logits, start, stop, heads))
        else:
            ragged_attention_numpy(q, k, v, prefix_keys, prefix_values, *layout, scale, window, heads,
                                   softcap, sinks)
        return out

    # -- the end ---------------------------------------------------------------------------------

    def last_rows(self) -> np.ndarray:
        """The stacked row of each sequence's last position, in stack order."""
        return self.offsets[1:] - 1

    def finish(self) -> None:
        for saving in self.saving:
            entry = self.stacked[saving.entry]
            self.saved[self.order[saving.entry]] = SavedState(
                entry.token_ids.copy(), saving.residual, saving.keys, saving.values)  # type: ignore[arg-type]

    def _save_residual(self, saving: _Saving, layer: int, h: np.ndarray) -> None:
        k, entry = saving.entry, self.stacked[saving.entry]
        if layer < entry.first_layer:
            assert entry.prefix is not None
            saving.residual.append(entry.prefix.residual[layer][:len(entry.token_ids)].copy())
            return
        rows = h[self.offsets[k]:self.offsets[k + 1]]
        saved = entry.prefix.residual[layer] if entry.prefix else None
        saving.residual.append(self._joined(entry, saved, rows))

    def _save_keys(self, saving: _Saving, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        index, entry = saving.entry, self.stacked[saving.entry]
        while len(saving.keys) < layer:  # layers reading another's keys save none
            saving.keys.append(None)
            saving.values.append(None)
        if layer < entry.first_layer:
            assert entry.prefix is not None
            T = len(entry.token_ids)
            saving.keys.append(_first_positions(entry.prefix.keys[layer], T))
            saving.values.append(_first_positions(entry.prefix.values[layer], T))
            return
        span = slice(self.offsets[index], self.offsets[index + 1])
        prefix = entry.prefix
        saving.keys.append(self._joined(entry, prefix.keys[layer] if prefix else None,
                                        k[span].transpose(1, 0, 2), axis=1))
        saving.values.append(self._joined(entry, prefix.values[layer] if prefix else None,
                                          v[span].transpose(1, 0, 2), axis=1))

    @staticmethod
    def _joined(entry: BatchEntry, saved: np.ndarray | None, own: np.ndarray, axis: int = 0) -> np.ndarray:
        """The saved run's positions before the entry's start followed by the entry's own rows."""
        if entry.start == 0 or saved is None:
            return np.array(own, np.float32, copy=True)
        before = saved[:entry.start] if axis == 0 else saved[:, :entry.start]
        return np.concatenate([before, own], axis=axis)


def _first_positions(saved: np.ndarray | None, count: int) -> np.ndarray | None:
    """The first `count` positions of saved keys or values [kv heads, T, head dim] (a saved run may be
    longer than the sequence reusing it)."""
    return None if saved is None else saved[:, :count]


def _sequence_keys(k: np.ndarray, v: np.ndarray, prefix_keys: np.ndarray, prefix_values: np.ndarray,
                   offsets: np.ndarray, prefix_index: np.ndarray, prefix_length: np.ndarray,
                   own: np.ndarray) -> Iterator[tuple[int, slice, np.ndarray, np.ndarray]]:
    """Per non-empty sequence e of a batch: its rows and the keys and values its rows read ([kv, L, hd]:
    the saved ones before its start, then its own rows), as `token_ops.ragged_attention` reads them."""
    for e in range(len(prefix_length)):
        span = slice(int(offsets[e]), int(offsets[e + 1]))
        if span.start == span.stop:
            continue
        parts_k, parts_v = [], []
        if prefix_length[e]:
            source = int(prefix_index[e])
            parts_k.append(prefix_keys[source, :, :prefix_length[e]])
            parts_v.append(prefix_values[source, :, :prefix_length[e]])
        if own[e]:
            parts_k.append(k[span].transpose(1, 0, 2))
            parts_v.append(v[span].transpose(1, 0, 2))
        yield e, span, np.concatenate(parts_k, axis=1), np.concatenate(parts_v, axis=1)


def ragged_attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, prefix_keys: np.ndarray,
                           prefix_values: np.ndarray, offsets: np.ndarray, starts: np.ndarray,
                           prefix_index: np.ndarray, prefix_length: np.ndarray, own: np.ndarray,
                           row_entry: np.ndarray, row_positions: np.ndarray, scale: float, window: int,
                           out: np.ndarray, softcap: float = 0.0, sinks: np.ndarray | None = None) -> None:
    """What `token_ops.ragged_attention` computes, in NumPy (where numba cannot run): per sequence, its
    keys (the saved ones before its start, then its own rows) and `ember.ops.attention` over them."""
    for e, span, keys, values in _sequence_keys(k, v, prefix_keys, prefix_values, offsets, prefix_index,
                                                prefix_length, own):
        rows = span.stop - span.start
        key_positions = np.arange(keys.shape[1])
        heads = np.empty((rows, q.shape[1] * values.shape[2]), np.float32)
        attention(q[span], keys, values, start_position=int(starts[e]), scale=float(scale), out=heads,
                  key_positions=key_positions, sliding_window=window, softcap=softcap, sinks=sinks)
        out[span] = heads.reshape(rows, q.shape[1], -1)


def patterned_ragged(q: np.ndarray, k: np.ndarray, v: np.ndarray, prefix_keys: np.ndarray,
                     prefix_values: np.ndarray, offsets: np.ndarray, starts: np.ndarray,
                     prefix_index: np.ndarray, prefix_length: np.ndarray, own: np.ndarray,
                     row_entry: np.ndarray, row_positions: np.ndarray, scale: float, window: int,
                     show: Show, out: np.ndarray, softcap: float = 0.0,
                     sinks: np.ndarray | None = None) -> bool:
    """A batch's attention pattern formed and shown ([heads × rows, keys], a row's columns its own
    sequence's positions 0…, as many as the longest sequence's), each sequence's keys as in
    `ragged_attention_numpy`; when the hook wrote it, the heads' outputs formed from it into `out`
    [rows, heads·head dim] (True), else nothing (False: the kernel forms them)."""
    rows = q.shape[0]
    columns = int(row_positions.max()) + 1
    probabilities = np.zeros((q.shape[1], rows, columns), np.float32)
    sequences = []
    for _, span, keys, values in _sequence_keys(k, v, prefix_keys, prefix_values, offsets, prefix_index,
                                                prefix_length, own):
        positions = np.arange(keys.shape[1])
        form_pattern(q[span], keys, positions, row_positions[span], scale, window, probabilities[:, span],
                     softcap, sinks)
        sequences.append((span, values, positions))
    if not written(show, probabilities):
        return False
    for span, values, positions in sequences:
        apply_pattern(probabilities[:, span], values, positions, row_positions[span], window, out[span])
    return True


def written(show: Show, probabilities: np.ndarray) -> bool:
    """Show a formed pattern [heads, rows, columns] as [heads × rows, columns]; whether the hook changed
    it. Unchanged, the heads' outputs are the kernels' own: an observer changes no bit of the run."""
    shown = probabilities.reshape(-1, probabilities.shape[2])
    formed = shown.copy()
    show(shown)
    return not np.array_equal(shown, formed)


def _visible(key_positions: np.ndarray, row_positions: np.ndarray, window: int) -> np.ndarray:
    """[rows, keys]: which keys each row sees (causal; within the window on a sliding layer)."""
    distance = row_positions[:, None] - key_positions[None, :]
    visible = (distance >= 0) & (key_positions[None, :] >= 0)
    if window:
        visible &= distance < window
    return visible


def form_pattern(q: np.ndarray, keys: np.ndarray, key_positions: np.ndarray, row_positions: np.ndarray,
                 scale: float, window: int, into: np.ndarray, softcap: float = 0.0,
                 sinks: np.ndarray | None = None) -> None:
    """The attention probabilities of q [T, heads, hd] over keys [kv heads, S, hd] at `key_positions`,
    written into `into` [heads, T, columns] at each key's position (the columns of keys a row does not
    see stay as they are: zero): after the softcap when there is one, as the kernels form them. Query
    head h reads KV head h // (heads / kv heads), as the kernels. With `sinks` (gpt-oss) each head's
    softmax has its sink logit too: a row's probabilities over the real keys sum to 1 − the sink's share."""
    T, n_head, head_dim = q.shape
    kv = keys.shape[0]
    group = n_head // kv
    query = q.reshape(T, kv, group, head_dim).transpose(1, 2, 0, 3)  # [kv, group, T, hd]
    scores = np.matmul(query, keys.transpose(0, 2, 1)[:, None])  # [kv, group, T, S]
    scores *= np.float32(scale)
    if softcap:
        ops.softcap_inplace(scores, softcap)
    scores[:, :, ~_visible(key_positions, row_positions, window)] = -np.inf
    if sinks is not None:
        ops.softmax_with_sinks_inplace(scores, sinks.reshape(kv, group, 1, 1))
    else:
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
    into[:, :, key_positions] = scores.reshape(n_head, T, -1)


def apply_pattern(probabilities: np.ndarray, values: np.ndarray, key_positions: np.ndarray,
                  row_positions: np.ndarray, window: int, out: np.ndarray) -> np.ndarray:
    """Each head's output as its pattern's weights over the values: out [T, heads·hd] from probabilities
    [heads, T, columns] (as shown, and perhaps written: weights on keys a row does not see are ignored)
    and values [kv heads, S, hd] at `key_positions`."""
    n_head, T, _ = probabilities.shape
    kv, _, value_dim = values.shape
    weights = probabilities[:, :, key_positions] * _visible(key_positions, row_positions, window)
    heads = np.matmul(weights.reshape(kv, n_head // kv, T, -1), values[:, None])  # [kv, group, T, hd]
    out.reshape(T, n_head, value_dim)[...] = heads.reshape(n_head, T, value_dim).transpose(1, 0, 2)
    return out


Rows = SequenceRows | BatchRows
