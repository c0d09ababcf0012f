"""Write the bundled prompt sets (ember/data/sets/*.jsonl) from the lists below.

    python scripts/make_prompt_sets.py

Clean/corrupted pairs must tokenize to the same number of tokens (activation patching swaps activations
position by position). The pairing is made with SmolLM2-135M's tokenizer (ember's own, which gives
llama.cpp's ids); tests/test_prompt_sets.py checks it again on the written files.

* capitals.jsonl: "The capital of <country> is" -> " <capital>"; the corrupted prompt names another
  country whose prompt has the same token count, and `wrong_answer` is that country's capital.
* ioi.jsonl: indirect-object identification: "When A and B went ..., B gave a drink to" -> " A"; the
  corrupted prompt repeats A instead of B (so its answer is " B", the `wrong_answer`).
* sentiment.jsonl: positive/negative pairs that differ in the evaluative words (steering directions);
  `answer`/`wrong_answer` " good"/" bad" read the sentiment out of the next-token distribution.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "ember" / "data" / "sets"

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("England", "London"),
    ("Egypt", "Cairo"), ("Greece", "Athens"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
    ("India", "New Delhi"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"),
    ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Poland", "Warsaw"),
    ("Austria", "Vienna"), ("Hungary", "Budapest"), ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"), ("Turkey", "Ankara"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Indonesia", "Jakarta"),
    ("the Philippines", "Manila"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Chile", "Santiago"),
    ("Cuba", "Havana"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Pakistan", "Islamabad"), ("Afghanistan", "Kabul"),
    ("Morocco", "Rabat"), ("Venezuela", "Caracas"), ("Iceland", "Reykjavik"), ("Nepal", "Kathmandu"),
    ("Syria", "Damascus"), ("Lebanon", "Beirut"), ("Scotland", "Edinburgh"), ("Argentina", "Buenos Aires"),
    ("Mexico", "Mexico City"), ("Switzerland", "Bern"), ("Jamaica", "Kingston"),
]

IOI_TEMPLATES = [
    "When{A} and{B} went to the store,{B} gave a drink to",
    "When{A} and{B} went to the park,{B} threw a ball to",
    "After{A} and{B} went to the market,{B} handed a book to",
    "While{A} and{B} were working at the office,{B} sent an email to",
    "Then,{A} and{B} had dinner together, and{B} passed the salt to",
    "Yesterday{A} and{B} visited the museum, and{B} showed a painting to",
]
IOI_NAMES = [("Mary", "John"), ("Sarah", "Tom"), ("Anna", "David"), ("Emma", "Paul"), ("Alice", "Bob"),
             ("Laura", "Mark"), ("Susan", "Peter"), ("Rachel", "Daniel")]

SENTIMENT = [
    ("The movie was wonderful.", "The movie was terrible."),
    ("The food at this restaurant was delicious.", "The food at this restaurant was disgusting."),
    ("I love my new phone.", "I hate my new phone."),
    ("The concert last night was amazing.", "The concert last night was awful."),
    ("Our holiday was fantastic.", "Our holiday was horrible."),
    ("This book is brilliant.", "This book is dreadful."),
    ("The service was excellent.", "The service was poor."),
    ("I am so happy with this purchase.", "I am so unhappy with this purchase."),
    ("What a beautiful day.", "What a miserable day."),
    ("The team played superbly.", "The team played badly."),
    ("My friends are kind and generous.", "My friends are rude and selfish."),
    ("The new park is lovely.", "The new park is ugly."),
    ("I enjoyed every minute of the trip.", "I regretted every minute of the trip."),
    ("The coffee here is great.", "The coffee here is awful."),
    ("This game is fun and exciting.", "This game is boring and tedious."),
    ("The lecture was clear and inspiring.", "The lecture was confusing and dull."),
    ("She gave us a warm and friendly welcome.", "She gave us a cold and hostile welcome."),
    ("The garden looks gorgeous this spring.", "The garden looks dreadful this spring."),
    ("I feel wonderful today.", "I feel terrible today."),
    ("The hotel room was clean and comfortable.", "The hotel room was dirty and uncomfortable."),
]
SENTIMENT_SUFFIX = " Overall, it was"


def main() -> None:
    from ember.gguf_file import GGUFFile
    from ember.sources import resolve_model
    from ember.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(GGUFFile.open(resolve_model("smollm2-135m").path))

    def length(text: str) -> int:
        return len(tokenizer.encode(text))

    write("capitals.jsonl", capitals(length))
    write("ioi.jsonl", ioi(length))
    write("sentiment.jsonl", sentiment())


def capitals(length) -> list[dict[str, str]]:
    prompts = {country: f"The capital of {country} is" for country, _ in CAPITALS}
    capital = dict(CAPITALS)
    first_word = {c: capital[c].split()[0] for c in capital}
    groups: dict[int, list[str]] = {}
    for country, _ in CAPITALS:
        groups.setdefault(length(prompts[country]), []).append(country)
    items = []
    for country, answer in CAPITALS:
        group = groups[length(prompts[country])]
        # the next country of the same token count whose capital starts differently (cyclic)
        start = group.index(country)
        partners = [group[(start + k) % len(group)] for k in range(1, len(group))]
        partners = [p for p in partners if first_word[p] != first_word[country]]
        if not partners:
            raise SystemExit(f"no equal-length partner for {country}: add a country of that length")
        other = partners[0]
        items.append({"prompt": prompts[country], "answer": f" {answer}",
                      "wrong_answer": f" {capital[other]}", "corrupted": prompts[other], "label": country})
    return items


def ioi(length) -> list[dict[str, str]]:
    items = []
    for template in IOI_TEMPLATES:
        for a, b in IOI_NAMES:
            clean = template.format(A=f" {a}", B=f" {b}")
            corrupted = _replace_last(template, a, b)
            if length(clean) != length(corrupted):
                raise SystemExit(f"unequal token lengths: {clean!r} / {corrupted!r}")
            items.append({"prompt": clean, "answer": f" {a}", "wrong_answer": f" {b}", "corrupted": corrupted,
                          "label": f"template {IOI_TEMPLATES.index(template) + 1}"})
    return items


def _replace_last(template: str, a: str, b: str) -> str:
    """The template with A and B as introduced, but the repeated subject (the second {B}) named A."""
    head, _, tail = template.rpartition("{B}")
    return head.format(A=f" {a}", B=f" {b}") + f" {a}" + tail


def sentiment() -> list[dict[str, str]]:
    return [{"prompt": positive + SENTIMENT_SUFFIX, "corrupted": negative + SENTIMENT_SUFFIX,
             "answer": " good", "wrong_answer": " bad", "label": "positive"}
            for positive, negative in SENTIMENT]


def write(name: str, items: list[dict[str, str]]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / name, "w", encoding="utf-8") as out:
        for item in items:
            out.write(json.dumps(item, ensure_ascii=False) + "\n")
    print(f"wrote {len(items)} items to {OUT / name}")


if __name__ == "__main__":
    main()
