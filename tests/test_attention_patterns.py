"""`attention_patterns` on SmolLM2 and Gemma 3 (IOI items):

* the patterns it keeps equal the `attention_pattern` stage of each item evaluated alone (the stage is
  checked against transformers in tests/test_attention_stages.py), also when items share a batch; each
  row sums to 1; its summaries (last token → IO, S, position 0) are sums of those rows; the default
  heads (every head of the last layer) and a prompt without answers;
* a run records `patterns.npz` (the same values), `attention_patterns.html`, the figure and the table;
* bad heads or positions end the run with one readable line;
* (slow) the HTML view in a real browser (Debian's chromium driven by Playwright): choose a head, hover
  a token, and the weights the page shows are the .npz's; and the same page inside the real MLflow UI
  (a run recorded to `mlflow server`, its Artifacts tab, the file chosen in the tree).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from ember import run as runner
from ember.data import load_prompt_set, parse_data_spec
from ember.experiments.attention_patterns import AttentionPatterns
from ember.experiments.attention_view import attention_html
from ember.inspection import BoundaryRecorder
from ember.runs.study import run_items
from ember.runs.study_plan import study_item

TOLERANCE = 1e-5
HEADS = [[0, 0], [9, 3], [29, 8]]


def ioi_items(model, limit: int) -> list:
    prompts = load_prompt_set(parse_data_spec({"path": "ember:ioi.jsonl", "limit": limit}))
    return [study_item(i, item, model.tokenizer) for i, item in enumerate(prompts.items)]


def stage_patterns(model, ids) -> dict[tuple[int, int], np.ndarray]:
    """(layer, head) -> [T, T]: the `attention_pattern` stage of `ids` evaluated alone."""
    recorder = BoundaryRecorder(stages=["attention_pattern"])
    model.evaluate(list(ids), add_bos=False, observer=recorder)
    heads, T = model.config.head_count, len(ids)
    return {(r.layer, h): r.array.reshape(heads, T, T)[h] for r in recorder.records if r.evaluation == 0
            for h in range(heads)}


def relative(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def npz(experiment: AttentionPatterns) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(experiment.results().file_builders["patterns.npz"]())) as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def studied(smollm2):
    """Three IOI items side by side (one batch), and the first alone with only some query rows."""
    items = ioi_items(smollm2, 3)
    experiment = AttentionPatterns(heads=HEADS)
    results = run_items(smollm2, experiment, items)
    rows = AttentionPatterns(heads=HEADS[1:], positions=[-1, 2])
    run_items(smollm2, rows, items[:1])
    return items, experiment, results, rows


def test_patterns_are_the_stage_s_and_rows_sum_to_one(smollm2, studied):
    items, experiment, results, _ = studied
    saved = npz(experiment)
    assert saved["heads"].tolist() == HEADS
    worst = 0.0
    for item, result in zip(items, results, strict=True):
        reference = stage_patterns(smollm2, item.token_ids)
        T = len(item.token_ids)
        assert saved[f"item{item.index}.tokens"].tolist() == list(item.token_ids)
        assert saved[f"item{item.index}.queries"].tolist() == list(range(T))
        for layer, head in HEADS:
            ours = saved[f"item{item.index}.L{layer}H{head}"]
            assert ours.shape == (T, T) and ours.dtype == np.float32
            worst = max(worst, relative(ours, reference[(layer, head)]))
            assert np.abs(ours.sum(axis=1, dtype=np.float64) - 1).max() <= 1e-5
            assert not np.triu(ours, 1).any()  # causal: no query sees a later key
        # IOI: the answer (IO) once in the prompt, the wrong answer (S) twice; the summaries are the last
        # row's sums there
        io_at, s_at = result.row["answer_positions"], result.row["wrong_answer_positions"]
        assert len(io_at) == 1 and len(s_at) == 2
        assert [item.token_ids[p] for p in io_at] == [item.answer_id]
        for layer, head in HEADS:
            last = reference[(layer, head)][T - 1].astype(np.float64)
            values = result.values
            assert values[f"L{layer}H{head}.to_answer"] == pytest.approx(last[io_at].sum(), abs=1e-6)
            assert values[f"L{layer}H{head}.to_wrong_answer"] == pytest.approx(last[s_at].sum(), abs=1e-6)
            assert values[f"L{layer}H{head}.to_first"] == pytest.approx(last[0], abs=1e-6)
    print(f"\n  attention_patterns vs the stage alone: relative {worst:.1e}")
    assert worst <= TOLERANCE
    table = experiment.results().tables["heads"]
    assert [(r["layer"], r["head"]) for r in table] == [tuple(h) for h in HEADS]
    assert all(r["n_to_answer"] == len(items) for r in table)
    means = [np.mean([res.values[f"L{r['layer']}H{r['head']}.to_answer"] for res in results]) for r in table]
    assert [r["mean_to_answer"] for r in table] == pytest.approx(means)


def test_by_default_every_head_of_the_last_layer_and_a_prompt_without_answers(smollm2):
    from ember.experiments.study import StudyItem

    ids = tuple(smollm2.tokenizer.encode("The capital of France is"))
    experiment = AttentionPatterns()
    result = run_items(smollm2, experiment, [StudyItem(0, ids, "The capital of France is")])[0]
    assert experiment.heads == tuple((29, head) for head in range(9))
    assert set(result.values) == {f"L29H{head}.to_first" for head in range(9)}  # no answers: no IO, S
    assert result.row == {"answer_positions": [], "wrong_answer_positions": []}
    saved = npz(experiment)
    assert saved["item0.L29H4"].shape == (len(ids), len(ids))
    layers = AttentionPatterns(layers=[3, 7])
    run_items(smollm2, layers, [StudyItem(0, ids, "")])
    assert layers.heads == tuple((layer, head) for layer in (3, 7) for head in range(9))


def test_gemma3_patterns_are_the_stage_s():
    """Another family (Gemma 3 270M: a BOS, 4 heads, sliding-window and global layers), two items in
    one batch: the same."""
    import ember

    model = ember.load_model("gemma3-270m", context_length=256)
    items = ioi_items(model, 2)
    heads = [[0, 0], [5, 3], [17, 1]]
    experiment = AttentionPatterns(heads=heads)
    run_items(model, experiment, items)
    saved = npz(experiment)
    for item in items:
        reference = stage_patterns(model, item.token_ids)
        for layer, head in heads:
            ours = saved[f"item{item.index}.L{layer}H{head}"]
            assert relative(ours, reference[(layer, head)]) <= TOLERANCE
            assert np.abs(ours.sum(axis=1, dtype=np.float64) - 1).max() <= 1e-5


def test_positions_keep_those_query_rows(studied):
    items, experiment, _, rows = studied
    full, kept = npz(experiment), npz(rows)
    T = len(items[0].token_ids)
    assert kept["item0.queries"].tolist() == [2, T - 1]
    for layer, head in HEADS[1:]:
        # `rows` evaluated item 0 alone, `experiment` in a batch of three: equal within the batch tolerance
        # (BLAS may block a 3-item product differently from a 1-item one)
        name = f"item0.L{layer}H{head}"
        assert relative(kept[name], full[name][[2, T - 1]]) <= TOLERANCE


def test_the_page_carries_token_text_as_data():
    """Token text that looks like markup stays text: the JSON cannot end its <script> element."""
    page = attention_html([{"index": 0, "text": "a</script><b>&", "tokens": ["</script>", "<b>&"],
                            "queries": [0, 1], "patterns": np.array([[[1.0, 0.0], [0.25, 0.75]]]),
                            "marks": {"answer": [1], "wrong_answer": []}}], [(2, 5)])
    assert page.count("</script>") == 2  # the data's and the code's own
    payload = re.search(r'<script id="data" type="application/json">(.*?)</script>', page, re.S)
    assert payload is not None
    data = json.loads(payload.group(1))
    assert data["items"][0]["tokens"] == ["</script>", "<b>&"] and data["heads"] == [[2, 5]]
    assert data["items"][0]["patterns"] == [[[1.0, 0.0], [0.25, 0.75]]]
    assert "http://" not in page and "https://" not in page  # nothing to fetch


# -- a run -------------------------------------------------------------------------------------------

@pytest.mark.usefixtures("no_outside_store")
def test_a_run_records_the_npz_the_page_the_figure_and_the_table(workdir):
    from run_support import artifact, only_run

    code = runner.main(["data=ioi", "data.limit=2", "experiment=attention_patterns",
                        "experiments.0.heads=[[9,3],[29,8]]", "mlflow.experiment_name=t_attention_patterns",
                        "threads=1"])
    assert code == 0
    run = only_run(workdir, "t_attention_patterns")
    folder = "experiments/attention_patterns"
    with np.load(artifact(workdir, run, f"{folder}/patterns.npz")) as saved:
        assert {"heads", "item0.L9H3", "item1.L29H8", "item1.tokens", "item1.queries"} <= set(saved.files)
        pattern = saved["item0.L29H8"]
    page = artifact(workdir, run, f"{folder}/attention_patterns.html").read_text()
    assert page.startswith("<!doctype html>") and "layer " in page
    assert artifact(workdir, run, f"{folder}/item0_patterns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads(artifact(workdir, run, f"{folder}/heads.json").read_text())
    assert [(r["layer"], r["head"]) for r in table] == [(9, 3), (29, 8)]
    assert np.abs(pattern.sum(axis=1) - 1).max() <= 1e-5
    assert run.data.metrics["study.items"] == 2


@pytest.mark.usefixtures("no_outside_store")
@pytest.mark.parametrize(("args", "message"), [
    (["experiments.0.heads=[[0,9]]"], "attention_patterns: head [0, 9]: head 9 is outside 0..8 (this model "
                                      "has 9 heads per layer)"),
    (["experiments.0.heads=[[30,0]]"], "attention_patterns: head [30, 0]: layer 30 is outside 0..29"),
    (["experiments.0.heads=[3,4]"], "attention_patterns: heads must be a list of [layer, head] pairs"),
    (["experiments.0.heads=[[1,2]]", "experiments.0.layers=[3]"], "give heads (a list of [layer, head]) or "
                                                                  "layers"),
    (["experiments.0.positions=[40]"], "positions [40] are outside item 0's"),
])
def test_bad_heads_or_positions_end_with_one_line(workdir, capsys, args, message):
    code = runner.main(["data=ioi", "experiment=attention_patterns", *args, "mlflow=off", "threads=1"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: ") and message in lines[0], err


# -- the page in a real browser ------------------------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def browser_or_skip():
    """Playwright's sync API, or a skip (a failure in CI, which installs both: .ci/run)."""
    missing = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the python package playwright is not installed"
    if missing is None and not Path(CHROMIUM).exists():
        missing = f"{CHROMIUM} is absent (apt-get install chromium)"
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return sync_playwright


def shown_weights(frame) -> list[float]:
    return [float(text) for text in frame.locator("#tokens .tok .w").all_inner_texts()]


@pytest.mark.slow
def test_the_html_view_in_chromium(smollm2, studied, tmp_path):
    sync_playwright = browser_or_skip()
    items, experiment, _, _ = studied
    saved = npz(experiment)
    page_file = tmp_path / "attention_patterns.html"
    page_file.write_bytes(experiment.results().file_builders["attention_patterns.html"]())
    asked: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.on("request", lambda request: asked.append(request.url))
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(page_file.as_uri())
            # head 2 of the list (layer 29, head 8), item 1: hover position 5
            page.select_option("#head", "2")
            page.select_option("#item", "1")
            tokens = saved["item1.tokens"]
            T = len(tokens)
            assert page.locator("#tokens .tok").count() == T
            page.hover('#tokens .tok[data-position="5"]')
            expected = saved["item1.L29H8"][5]
            assert page.locator("#status").get_attribute("data-query") == "5"
            assert np.abs(np.array(shown_weights(page)) - expected).max() <= 6e-5
            assert abs(sum(shown_weights(page)) - 1) <= T * 6e-5
            assert page.locator("#tokens .tok.future").count() == T - 6  # keys it cannot see
            page.check("#scaled")  # colours relative to the row's largest weight: the same weights shown
            page.hover('#tokens .tok[data-position="5"]')
            assert np.abs(np.array(shown_weights(page)) - expected).max() <= 6e-5
            # a click keeps position 3 when the mouse leaves; the last row shows by default
            page.click('#tokens .tok[data-position="3"]')
            page.mouse.move(5, 5)
            assert page.locator("#status").get_attribute("data-query") == "3"
            assert np.abs(np.array(shown_weights(page)) - saved["item1.L29H8"][3]).max() <= 6e-5
            page.select_option("#head", "0")  # layer 0, head 0: position 3 still kept
            assert np.abs(np.array(shown_weights(page)) - saved["item1.L0H0"][3]).max() <= 6e-5
            page.click('#tokens .tok[data-position="3"]')  # unpinned: the last token's row
            page.mouse.move(5, 5)
            assert page.locator("#status").get_attribute("data-query") == str(T - 1)
            assert np.abs(np.array(shown_weights(page)) - saved["item1.L0H0"][T - 1]).max() <= 6e-5
            assert page.locator("#heatmap tbody tr").count() == T
            page.select_option("#head", "2")
            page.hover('#tokens .tok[data-position="5"]')
            shot = tmp_path / "attention_patterns.png"
            page.screenshot(path=str(shot), full_page=True)
            assert errors == []
            # as MLflow's artifact viewer shows it: in a frame that may run scripts and nothing else
            wrapper = tmp_path / "framed.html"
            source = page_file.read_text().replace("&", "&amp;").replace('"', "&quot;")
            wrapper.write_text(f'<iframe sandbox="allow-scripts" style="width:1000px;height:800px" '
                               f'srcdoc="{source}"></iframe>')
            page.goto(wrapper.as_uri())
            frame = page.frame_locator("iframe")
            frame.locator('#tokens .tok[data-position="4"]').hover()
            assert np.abs(np.array(shown_weights(frame)) - saved["item0.L0H0"][4]).max() <= 6e-5
        finally:
            browser.close()
    assert all(url.startswith(("file:", "about:", "data:")) for url in asked), asked
    keep = os.environ.get("EMBER_SCREENSHOT")  # to look at it: EMBER_SCREENSHOT=/tmp/view.png
    if keep:
        shutil.copyfile(shot, keep)


@pytest.mark.slow
def test_the_html_view_in_the_mlflow_ui(tmp_path, monkeypatch):
    """The page as a user meets it: a run recorded to a real `mlflow server` on 127.0.0.1, its Artifacts
    tab opened in Chromium, the file chosen in MLflow's tree; MLflow shows it in a sandboxed frame, and a
    hover there shows the weights the run's .npz holds."""
    from test_tracking_server import get, mlflow_server

    sync_playwright = browser_or_skip()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with mlflow_server(tmp_path) as base:
        monkeypatch.chdir(tmp_path)
        code = runner.main(["data=ioi", "data.limit=2", "experiment=attention_patterns",
                            "experiments.0.heads=[[9,3],[29,8]]", f"mlflow.tracking_uri={base}",
                            "mlflow.experiment_name=t_ui", "threads=1"])
        assert code == 0
        api = f"{base}/api/2.0/mlflow"
        experiment_id = get(f"{api}/experiments/get-by-name", experiment_name="t_ui")["experiment"][
            "experiment_id"]
        saved_npz = next((tmp_path / "server" / "artifacts").rglob("patterns.npz"))
        run_id = saved_npz.parts[-5]  # artifacts/<experiment>/<run>/artifacts/experiments/attention_patterns
        with np.load(saved_npz) as saved:
            expected = saved["item0.L9H3"][4]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{base}/#/experiments/{experiment_id}/runs/{run_id}/artifacts")
                page.get_by_text("experiments", exact=True).click()
                page.get_by_text("attention_patterns", exact=True).click()
                page.get_by_text("attention_patterns.html", exact=True).click()
                frame = page.frame_locator("iframe").first
                frame.locator('#tokens .tok[data-position="4"]').hover()
                assert frame.locator("#status").get_attribute("data-query") == "4"
                assert np.abs(np.array(shown_weights(frame)) - expected).max() <= 6e-5
                assert page.locator("iframe").first.get_attribute("sandbox") == "allow-scripts"
                page.screenshot(path=str(tmp_path / "mlflow_ui.png"))
            finally:
                browser.close()
    keep = os.environ.get("EMBER_SCREENSHOT_UI")  # to look at it: EMBER_SCREENSHOT_UI=/tmp/ui.png
    if keep:
        shutil.copyfile(tmp_path / "mlflow_ui.png", keep)
