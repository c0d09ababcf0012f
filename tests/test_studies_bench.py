"""The studies benchmark (benchmarks/studies.py) measures what it claims: its inputs are the pairs and
prompts it describes, and its transformers peer's batched residual patching gives ember's scores. No
timing here."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import studies


def test_token_pairs_differ_at_one_position():
    pairs = studies.token_pairs(40, vocabulary=128256)
    assert len(pairs) == 40
    for item in pairs:
        assert 5 <= len(item.token_ids) <= 8
        assert len(item.corrupted_ids) == len(item.token_ids)
        differ = np.flatnonzero(np.array(item.token_ids) != np.array(item.corrupted_ids))
        assert len(differ) == 1 and differ[0] >= 1
        assert item.answer_id != item.wrong_answer_id
        assert all(0 <= t < 128256 for t in (*item.token_ids, *item.corrupted_ids))


def test_short_prompts_are_distinct():
    prompts = studies.short_prompts(1000)
    assert len(set(prompts)) == 1000
    with pytest.raises(ValueError):
        studies.short_prompts(10_000)


@pytest.mark.slow
@pytest.mark.reference
def test_peer_scores_match_ember(smollm2, smollm2_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    [item] = studies.capital_items(smollm2, limit=1)
    [ours] = studies.ember_patching(smollm2, [item], ("residual",), threads=smollm2.threads)
    hf = studies.load_peer(smollm2_path, threads=smollm2.threads)
    [pair] = studies.plain_items([item])
    theirs = studies.peer_patching(hf, pair)
    assert ours.shape == (1, *theirs.shape)
    first = studies._first_changed(item)
    assert np.all(ours[0, :, :first] == 0) and np.all(theirs[:, :first] == 0)
    # Patching the residual at the changed token before layer 0 restores the clean run's embedding row:
    # the share is far from 0 (a patch that wrote nothing would score 0 everywhere).
    assert abs(theirs[0, first]) > 0.5
    assert float(np.abs(ours[0] - theirs).max()) <= studies.AGREEMENT
