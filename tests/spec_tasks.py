"""Held prompts for speculative decoding: input-grounded tasks (the output copies spans of the input) and
open-ended chat. Used by tests/test_speculative.py (greedy text identical, drafts accepted) and
tests/test_spec_policy.py (the lookup index on real token streams)."""

from __future__ import annotations

from typing import Any

CODE = '''def load(path):
    with open(path) as f:
        rows = [line.strip().split(",") for line in f]
    return rows


def total(rows):
    result = 0
    for row in rows:
        result += float(row[2])
    return result
'''

ARTICLE = ("The Riverside Library will close for renovation from March 3 to June 14. During the closure, "
           "books can be returned at the Market Street branch, which will extend its opening hours to 9 pm on "
           "weekdays. The renovation adds a children's reading room, a quiet study floor and forty new public "
           "computers. The city council approved a budget of 2.4 million dollars for the work, most of it from "
           "a state grant. Library cards stay valid, and holds placed before March 3 will be moved to Market "
           "Street automatically.")

INVOICE = ("From: Maria Gonzalez <maria.gonzalez@example.com>\nSubject: Invoice 2024-117\n\nHello, please find "
           "the invoice for the March consulting work: 12 hours of data migration at 85 EUR per hour, total "
           "1020 EUR, due on April 30. Payment to IBAN DE44 5001 0517 5407 3249 31. Regards, Maria Gonzalez, "
           "Gonzalez Data Services, Berlin.")

DOCS = ("Document 1: The Model T was produced by Ford Motor Company from October 1, 1908, to May 26, 1927. "
        "About 15 million were built.\nDocument 2: The Volkswagen Beetle was produced from 1938 until 2003, with "
        "more than 21 million built.\nDocument 3: The Toyota Corolla, introduced in 1966, is the best-selling "
        "car nameplate in history, with over 50 million sold.")

FIRST_ANSWER = ("Here is a packing list for a weekend hiking trip: a backpack, a water bottle, a rain jacket, "
                "a warm fleece, hiking boots, a map of the trail, sunscreen, a first aid kit, snacks, and a "
                "headlamp with spare batteries.")


def chat(*turns: str) -> list[dict[str, Any]]:
    roles = ["user", "assistant"]
    return [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


# (name, kind, prompt): kind "grounded" (the answer copies its input) or "open"
TASKS: list[tuple[str, str, Any]] = [
    ("code edit", "grounded", chat(f"Add type hints to this Python code. Reply with the whole code only.\n\n{CODE}")),
    ("code edit (text)", "grounded", f"{CODE}\n# The same code with the function total renamed to row_sum:\n"),
    ("summary", "grounded", chat(f"{ARTICLE}\n\nSummarise the text above in three sentences.")),
    ("extraction", "grounded", chat(f"{INVOICE}\n\nExtract the sender's name, email, invoice number, total and "
                                    f"IBAN as a JSON object.")),
    ("RAG answer", "grounded", chat(f"{DOCS}\n\nUsing only the documents above, answer: which car was produced "
                                    f"the longest, and from when to when? Quote the document.")),
    ("multi-turn chat", "grounded", chat("What should I pack for a weekend hiking trip?", FIRST_ANSWER,
                                         "Repeat that list, but add a tent and a sleeping bag at the end.")),
    ("open chat", "open", chat("Write a short poem about the sea.")),
    ("open chat 2", "open", chat("Why is the sky blue? Explain it to a child.")),
]
