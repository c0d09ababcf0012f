"""The interactive view of `attention_patterns`: one self-contained HTML page (inline CSS, vanilla JS and
the data as JSON; nothing fetched), which MLflow's artifact viewer shows in its sandboxed frame.

Choose an item and a head; hover a token to see where its query attends (each token coloured by its
weight, the weight written under it), click it to keep it; the heatmap below shows every kept query row
(rows) over the key positions (columns), the current row outlined; tokens after the query (which it
cannot see) are dimmed. Colours show a weight's share of 1, or (a checkbox) of its row's largest weight,
so that a head putting most of its weight on one token (often the first) still shows where the rest goes.
Weights are written with 4 decimals (the JSON holds them to 5).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ember.html_page import html_page

DECIMALS = 5  # of the weights in the page's JSON

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 16px; color: #1f2328; }
h1 { font-size: 18px; margin: 0 0 8px; }
label { margin-right: 16px; }
select { font: inherit; max-width: 520px; }
#prompt { color: #57606a; margin: 8px 0; }
#tokens { display: flex; flex-wrap: wrap; gap: 3px; margin: 12px 0; }
.tok { display: inline-flex; flex-direction: column; align-items: center; border: 1px solid #d0d7de;
       border-radius: 4px; padding: 2px 4px; min-width: 24px; cursor: default; }
.tok.asks { cursor: pointer; }
.tok.query { outline: 2px solid #cf222e; }
.tok.pinned { outline: 3px solid #cf222e; }
.tok.future { opacity: 0.35; }
.tok .t { white-space: pre; font-family: ui-monospace, monospace; }
.tok .w { font-size: 10px; font-family: ui-monospace, monospace; }
.tok .p { font-size: 9px; color: #57606a; }
.tok.answer .p::after { content: " ans"; color: #1a7f37; font-weight: bold; }
.tok.wrong_answer .p::after { content: " wrong"; color: #9a6700; font-weight: bold; }
#status { margin: 8px 0; min-height: 1.4em; }
#heatmap { border-collapse: collapse; font: 10px ui-monospace, monospace; margin-top: 8px; }
#heatmap td { width: 18px; height: 18px; border: 1px solid #eaeef2; padding: 0; }
#heatmap th { font-weight: normal; white-space: pre; padding: 0 4px; cursor: pointer; }
#heatmap thead th { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left; cursor: default; }
#heatmap tr.query th { color: #cf222e; font-weight: bold; }
#heatmap tr.query td { border-top: 2px solid #cf222e; border-bottom: 2px solid #cf222e; }
.hint { color: #57606a; font-size: 12px; }
"""

_SCRIPT = r"""
"use strict";
const data = JSON.parse(document.getElementById("data").textContent);
const itemSelect = document.getElementById("item");
const headSelect = document.getElementById("head");
const tokensBox = document.getElementById("tokens");
const heatmap = document.getElementById("heatmap");
const statusLine = document.getElementById("status");
let pinned = null;  // the query position a click keeps

const scaled = document.getElementById("scaled");
// a weight's colour: its share of 1, or (scaled) of the row's largest weight
function colour(w, top) {
  const v = scaled.checked && top > 0 ? w / top : w;
  return "rgba(9, 105, 218, " + Math.max(0, Math.min(1, v)).toFixed(3) + ")";
}
function shown(text) { return text.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5"); }
function item() { return data.items[Number(itemSelect.value)]; }
function rows() { return item().patterns[Number(headSelect.value)]; }  // [queries][positions]

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = String(value);
  o.textContent = text;
  select.appendChild(o);
}

function showQuery(q) {
  const it = item();
  const row = it.queries.indexOf(q);
  if (row < 0) return;
  const weights = rows()[row];
  const top = Math.max(...weights);
  for (const box of tokensBox.children) {
    const p = Number(box.dataset.position);
    const w = weights[p];
    box.style.background = colour(w, top);
    box.style.color = (scaled.checked ? w / top : w) > 0.5 ? "white" : "";
    box.dataset.weight = String(w);
    box.querySelector(".w").textContent = w.toFixed(4);
    box.classList.toggle("query", p === q);
    box.classList.toggle("future", p > q);
    box.classList.toggle("pinned", p === pinned);
  }
  for (const tr of heatmap.tBodies[0].rows) tr.classList.toggle("query", Number(tr.dataset.position) === q);
  let best = 0;
  weights.forEach((w, p) => { if (w > weights[best]) best = p; });
  let text = "query " + q + " " + JSON.stringify(it.tokens[q]) + " attends most to " + best + " " +
             JSON.stringify(it.tokens[best]) + " (" + weights[best].toFixed(4) + ")";
  for (const [mark, name] of [["answer", "answer"], ["wrong_answer", "wrong answer"]]) {
    const at = it.marks[mark] || [];
    if (at.length) text += "; to the " + name + " " + at.reduce((s, p) => s + weights[p], 0).toFixed(4);
  }
  statusLine.textContent = text;
  statusLine.dataset.query = String(q);
}

function rest() {  // the kept query, else the last one
  const it = item();
  showQuery(pinned !== null ? pinned : it.queries[it.queries.length - 1]);
}

function pin(p) { pinned = pinned === p ? null : p; rest(); }

function render() {
  const it = item();
  document.getElementById("prompt").textContent = "item " + it.index + ": " + it.text;
  tokensBox.replaceChildren();
  const marked = {};
  for (const mark of ["answer", "wrong_answer"]) for (const p of it.marks[mark] || []) marked[p] = mark;
  it.tokens.forEach((token, p) => {
    const box = document.createElement("span");
    box.className = "tok";
    box.dataset.position = String(p);
    if (marked[p]) box.classList.add(marked[p]);
    for (const [cls, text] of [["t", shown(token)], ["p", String(p)], ["w", ""]]) {
      const part = document.createElement("span");
      part.className = cls;
      part.textContent = text;
      box.appendChild(part);
    }
    if (it.queries.includes(p)) {
      box.classList.add("asks");
      box.title = "position " + p + ": hover to see where it attends, click to keep it";
      box.addEventListener("mouseenter", () => showQuery(p));
      box.addEventListener("mouseleave", rest);
      box.addEventListener("click", () => pin(p));
    }
    tokensBox.appendChild(box);
  });
  heatmap.replaceChildren();
  const head = heatmap.createTHead().insertRow();
  head.appendChild(document.createElement("th"));
  it.tokens.forEach((token, p) => {
    const th = document.createElement("th");
    th.textContent = p + " " + shown(token);
    head.appendChild(th);
  });
  const body = heatmap.createTBody();
  rows().forEach((weights, r) => {
    const q = it.queries[r];
    const tr = body.insertRow();
    tr.dataset.position = String(q);
    const th = document.createElement("th");
    th.textContent = q + " " + shown(it.tokens[q]);
    tr.appendChild(th);
    const top = Math.max(...weights);
    weights.forEach((w, p) => {
      const td = tr.insertCell();
      td.style.background = colour(w, top);
      td.title = q + " \u2192 " + p + ": " + w.toFixed(4);
    });
    tr.addEventListener("mouseenter", () => showQuery(q));
    tr.addEventListener("mouseleave", rest);
    tr.addEventListener("click", () => pin(q));
  });
  rest();
}

data.items.forEach((it, i) => option(itemSelect, i, "item " + it.index + ": " + it.text.slice(0, 70)));
data.heads.forEach(([layer, head], k) => option(headSelect, k, "layer " + layer + ", head " + head));
itemSelect.addEventListener("change", () => { pinned = null; render(); });
headSelect.addEventListener("change", render);
scaled.addEventListener("change", render);
if (data.items.length) render(); else statusLine.textContent = "no items";
"""


def attention_html(items: Sequence[Mapping[str, Any]], heads: Sequence[tuple[int, int]],
                   title: str = "attention patterns") -> str:
    """The page. `items`: each with `index`, `text`, `tokens` (texts), `queries` (the query positions
    kept), `patterns` `[heads, queries, tokens]` and `marks` ({"answer": positions, "wrong_answer": ...});
    `heads`: (layer, head) in the patterns' order."""
    data = {"heads": [[int(layer), int(head)] for layer, head in heads],
            "items": [{"index": int(it["index"]), "text": str(it["text"]),
                       "tokens": [str(t) for t in it["tokens"]],
                       "queries": [int(q) for q in it["queries"]],
                       "patterns": np.round(np.asarray(it["patterns"], dtype=np.float64), DECIMALS).tolist(),
                       "marks": {str(k): [int(p) for p in v] for k, v in it["marks"].items()}}
                      for it in items]}
    # JSON inside <script>: no "<", ">" or "&" that could end the element or start markup
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    payload = payload.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return html_page(title, _STYLE, f"""\
<label>item <select id="item"></select></label>
<label>head <select id="head"></select></label>
<label><input type="checkbox" id="scaled"> colours per row's largest weight</label>
<div id="prompt"></div>
<div class="hint">Hover a token to see where its query attends (colour and weight on each token); click to
keep it, click again to let go. ans / wrong: the prompt positions holding the answer's and the wrong
answer's first token (IOI: the indirect object and the subject).</div>
<div id="tokens"></div>
<div id="status"></div>
<table id="heatmap"></table>
<script id="data" type="application/json">{payload}</script>
<script>{_SCRIPT}</script>""")
