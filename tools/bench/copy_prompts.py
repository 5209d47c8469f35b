"""The copy-heavy workload's prompts (`tandem bench --workload copy`): tasks whose answer
copies the prompt, by category, and plain chat beside them.

Picked so that this 135M target's greedy answers are long enough to measure (most run 140-320
tokens; a request's prefill and first token would otherwise weigh on its speed as much as its
decoding) and so that it really copies on most of them: asked to repeat, quote, reorder or
reformat a list it copies; asked to repeat a document or edit code it partly rewrites; the copy
share column of the report says how much. Prompts that only made it loop ("A: A: A: ...") or
answer in a line were left out.
"""
from __future__ import annotations

import json

DOC = ("Tandem is a disaggregated speculative-decoding server. Draft workers stream token "
       "proposals with their probabilities to verifier workers, which hold the target model "
       "and a paged KV cache and accept or reject the proposals losslessly. A gateway speaks "
       "the OpenAI API, routes sessions and keeps state in Redis.\n\n"
       "The draft and verifier pools run on different machines and scale on their own. Every "
       "speculation round is traced, so an operator can see where the time of each round goes: "
       "drafting, the network hop, verification and sampling. When a draft worker fails, the "
       "verifier keeps decoding on its own and the session never notices, because speculation "
       "is an optimisation and never a dependency.")
STEPS = ["Open the valve on the north tank.", "Wait until the pressure reads ten bar.",
         "Close the valve on the south tank.", "Record the reading in the log book.",
         "Check the seals on both pumps.", "Switch the heater to its low setting.",
         "Drain the water from the east pipe.", "Clean the filter with fresh water.",
         "Refit the filter and tighten its cap.", "Tell the shift supervisor the test is done.",
         "Lock the control panel with the red key.", "Write the date on the test sheet.",
         "Put the spare gaskets back in the store room.", "Turn off the lights in the pump hall.",
         "Check that the alarm is armed again.", "Hand the key to the night guard."]
FRUIT = ["apples from the north orchard", "pears from the south orchard",
         "plums from the east orchard", "cherries from the west orchard",
         "grapes from the hill vineyard", "figs from the old garden",
         "peaches from the river farm", "lemons from the glass house",
         "quinces from the abbey wall", "apricots from the stone terrace",
         "blackberries from the lane hedge", "walnuts from the big tree",
         "hazelnuts from the copse", "oranges from the south wall",
         "raspberries from the kitchen garden", "gooseberries from the cottage",
         "damsons from the orchard gate", "medlars from the manor",
         "rhubarb from the cold frame", "strawberries from the long bed"]
CODE = ("def moving_average(values, window):\n    if window <= 0:\n        raise ValueError("
        "'window must be positive')\n    out = []\n    total = 0.0\n    for i, v in "
        "enumerate(values):\n        total += v\n        if i >= window:\n            total -= "
        "values[i - window]\n        out.append(total / min(i + 1, window))\n    return out\n\n\n"
        "def clamp(value, low, high):\n    if low > high:\n        raise ValueError('low must not "
        "exceed high')\n    return max(low, min(value, high))\n")
PEOPLE = [("Alice Smith", "Boston", 34), ("Bob Jones", "Denver", 41),
          ("Carol White", "Austin", 29), ("David Brown", "Seattle", 52),
          ("Emma Green", "Chicago", 38), ("Frank Moore", "Miami", 45),
          ("Grace Hall", "Portland", 31), ("Henry Clark", "Phoenix", 60)]
_STEP_LINES = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(STEPS))
_FRUIT_LINES = "\n".join(f"- {f}" for f in FRUIT)
_TABLE = "| name | city | age |\n|---|---|---|\n" + "\n".join(f"| {n} | {c} | {a} |"
                                                         for n, c, a in PEOPLE)

# (category, prompt); the categories of the copy-heavy work, then chat, where little
# is copied: auto must not lose there either.
TASKS = [
    ("repeat / quote", f"Repeat this text exactly, word for word:\n\n{DOC}"),
    ("repeat / quote", f"Repeat this list exactly, one item per line:\n{_STEP_LINES}"),
    ("repeat / quote", "Here is a list of steps. Quote, word for word, every step that "
                       f"mentions a valve or a filter, one per line.\n{_STEP_LINES}"),
    ("reformat / extract", "Rewrite this list as a numbered list, keeping every item exactly:\n"
                           f"{_FRUIT_LINES}"),
    ("reformat / extract", "Repeat this list, one item per line, adding the word 'done' after "
                           "each item:\n" + "\n".join(f"- {s}" for s in STEPS)),
    ("reformat / extract", "Sort this list alphabetically and return every item unchanged, "
                           f"one per line:\n{_FRUIT_LINES}"),
    ("reformat / extract", "Convert this JSON to a markdown table with columns name, city, age:\n"
                           + json.dumps([{"name": n, "city": c, "age": a} for n, c, a in PEOPLE])),
    ("code edit", "Add a docstring to each function and return the whole code unchanged "
                  f"otherwise:\n\n{CODE}"),
    ("correct text", "Correct the spelling and repeat the rest unchanged: 'Teh quick brown fox "
                     "jumpd over teh lazy dog, and then teh fox ran into teh forest where teh "
                     "trees were tall and teh river was cold and clear. Teh next morning teh fox "
                     "came back to teh farm, looked at teh sleeping dog and laughed, because teh "
                     "dog had not moved at all during teh night.'"),
    ("summarise with citations", "Summarise this document in two sentences, and after each "
                                 "sentence quote the words of the document it relies on.\n\n"
                                 f"{DOC}"),
    ("code edit", "Add type hints to both functions and return the whole code, everything "
                  f"else unchanged:\n\n{CODE}"),
    ("correct text", "Fix the spelling mistakes in this note and repeat it otherwise unchanged: "
                     "'Dear Sam, thank you for your leter. The meeting on Monday will start at "
                     "nine in the morning in the big room on the secnd floor. Please bring the "
                     "report, the budjet for next year and the list of new staff. After the "
                     "meeting we will have lunch in the garden if the wether is good, and in the "
                     "hall if it rains. Best wishes, Ann.'"),
    ("chat", "Write three paragraphs about why the sky is blue."),
    ("chat", "Give five tips for staying focused while studying, with two sentences each."),
    # Added after the first runs (so the indices above stay), for more copy-rich answers at
    # T = 0.7, where this model paraphrases most of the tasks above: it still copies these.
    ("repeat / quote", "Repeat this list exactly, one item per line:\n"
                       + "\n".join(f"- {s}" for s in STEPS)),
    ("repeat / quote", f"Copy this table exactly:\n\n{_TABLE}"),
]
PROMPTS = [prompt for _, prompt in TASKS]
CATEGORIES = [category for category, _ in TASKS]
CHAT = [prompt for category, prompt in TASKS if category == "chat"]
