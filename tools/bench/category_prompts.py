"""The categories workload's prompts (`tandem bench --workload categories`): short answers
(about 50-190 tokens from the default 135M target, greedy) in each category of issue 49,
written for it and apart from tools/bench/copy_prompts.py's longer ones.

- copy-rich: the answer is (almost) all copied: repeat a short text or list;
- rename / convert / quote / correct: copy-heavy edits, where the answer copies much of the
  prompt but changes some of it (this small target does some of them badly: that is part of
  the workload, a method must not lose where the copy breaks off);
- chat: little is copied; asked at T = 0 and at T = 0.7 (seeded).
Kept when the target's greedy answer ran 45-192 tokens; the comments give its length and
copy share (tools/bench/copy_report.copy_share) as measured on 2026-11-28.
"""
from __future__ import annotations

import json

NOTE = ("The library opens at nine in the morning and closes at six in the evening. Members "
        "may borrow up to five books at a time for three weeks. Late books cost ten cents a day. "
        "The reading room on the first floor is quiet, and the cafe on the ground floor serves "
        "tea and soup until four.")
NOTE_MORE = (NOTE + " Children under twelve must be with an adult. The library is closed on "
             "public holidays and on the first Monday of each month.")
STORY = ("Mia lived in a small house by the sea. Every morning she walked to the harbour to watch "
         "the boats come in. One day an old sailor gave her a map of an island nobody had "
         "visited. Mia packed bread, water and a lamp, and rowed out before sunrise. By noon she "
         "saw the island, green and silent, and a white bird waiting on the rocks.")
STEPS = ["Open the valve on the north tank.", "Wait until the pressure reads ten bar.",
         "Close the valve on the south tank.", "Record the reading in the log book.",
         "Check the seals on both pumps.", "Switch the heater to its low setting.",
         "Drain the water from the east pipe.", "Clean the filter with fresh water."]
SHOP = ["two loaves of brown bread", "a dozen eggs", "one litre of milk", "a bag of rice",
        "three red peppers", "a jar of honey", "four green apples", "a block of cheese"]
PEOPLE = [("Alice Smith", "Boston", 34), ("Bob Jones", "Denver", 41),
          ("Carol White", "Austin", 29), ("David Brown", "Seattle", 52),
          ("Emma Green", "Chicago", 38)]

_STEPS = "\n".join(f"{i + 1}. {s}" for i, s in enumerate(STEPS))
_SHOP = "\n".join(f"- {s}" for s in SHOP)
_TYPO_STEPS = (_STEPS.replace("valve", "valv").replace("pressure", "presure")
               .replace("filter", "filtre"))
_CHAT = ["Write a short paragraph about why people keep cats.",  # 90 tokens
         "Give three tips for sleeping better, with two sentences each.",  # 132
         "Write a short paragraph about the history of bicycles."]  # 89

# (category, prompt, temperature)
TASKS: list[tuple[str, str, float]] = [
    ("copy-rich", f"Repeat this text exactly, word for word:\n\n{NOTE}", 0.0),  # 53, 0.98
    ("copy-rich", f"Repeat this list exactly, one item per line:\n{_STEPS}", 0.0),  # 86, 1.00
    ("copy-rich", f"Copy this story exactly as it is written:\n\n{STORY}", 0.0),  # 82, 0.85
    ("rename", "Replace the word 'valve' with 'tap' in this list and repeat every step:\n"
               f"{_STEPS}", 0.0),  # 87, 0.81
    ("rename", "Replace 'library' with 'museum' in this text and repeat the rest unchanged:"
               f"\n\n{NOTE_MORE}", 0.0),  # 89, 1.00
    ("rename", "In this text, replace the name Mia with the name Lena and repeat the rest "
               f"unchanged:\n\n{STORY}", 0.0),  # 79, 0.96
    ("convert", "Convert this JSON to a bulleted list, one person per line with name, city and "
                "age:\n" + json.dumps([{"name": n, "city": c, "age": a} for n, c, a in PEOPLE]),
     0.0),  # 117, 0.78
    ("convert", f"Convert this numbered list to a bulleted list:\n{_STEPS}", 0.0),  # 86, 1.00
    ("convert", f"Convert this list to JSON, as a list of strings:\n{_SHOP}", 0.0),  # 192, 0.06
    ("quote", "Quote, word for word, every step that mentions a valve, the pressure or a "
              f"filter:\n{_STEPS}", 0.0),  # 86, 0.91
    ("quote", "Quote the sentences of this story that mention the sea or the island, exactly as "
              f"written:\n\n{STORY}", 0.0),  # 79, 0.96
    ("quote", "Quote this text exactly and then say in one sentence what it is about:\n\n"
              f"{STORY}", 0.0),  # 64, 0.72
    ("correct", "Correct the spelling and repeat the rest unchanged: 'The libary opens at nine "
                "in the mornig and closes at six in the evning. Members may borow up to five "
                "books at a time for three weks. Late books cost ten cents a dai. The reeding "
                "room on the frist floor is quiet, and the cafe on the ground flor serves tea "
                "and soup until four.'", 0.0),  # 58, 0.74
    ("correct", f"Correct the spelling in this list and repeat it:\n{_TYPO_STEPS}",
     0.0),  # 83, 0.71
    ("correct", "Fix the grammar in this note and repeat it otherwise unchanged: 'Me and Tom "
                "was going to the market on Saturday. We buyed apples, bread and some cheese, "
                "and then we goes home. Tom have a cold, so he dont want to walk far.'",
     0.0),  # 139, 0.16
    *[("chat", p, 0.0) for p in _CHAT],
    *[("chat T=0.7", p, 0.7) for p in _CHAT],
]
CATEGORIES = list(dict.fromkeys(c for c, _, _ in TASKS))
COPY_HEAVY = ("rename", "convert", "quote", "correct")
