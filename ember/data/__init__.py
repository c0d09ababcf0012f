"""Prompt sets: the data a study evaluates item by item (`data=` in the runner).

    spec = parse_data_spec({"name": "capitals", "path": "ember:capitals.jsonl", "limit": 10})
    prompts = load_prompt_set(spec)      # PromptSet: items, source, digest

Bundled sets live in `ember/data/sets/` and are named `ember:<file>`.
"""

from ember.data.prompts import (
    BUNDLED_DIR,
    FIELDS,
    DataSpec,
    PromptItem,
    PromptSet,
    load_prompt_set,
    parse_data_spec,
)

__all__ = ["BUNDLED_DIR", "FIELDS", "DataSpec", "PromptItem", "PromptSet", "load_prompt_set",
           "parse_data_spec"]
