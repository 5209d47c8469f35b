"""The copy-heavy workload's prompts (`tandem bench --workload copy`): tasks whose answer
copies the prompt, and plain chat beside them."""
from __future__ import annotations

DOC = ("Tandem is a disaggregated speculative-decoding server. Draft workers stream token "
       "proposals with their probabilities to verifier workers, which hold the target model "
       "and a paged KV cache and accept or reject the proposals losslessly. A gateway speaks "
       "the OpenAI API, routes sessions and keeps state in Redis. The draft and verifier pools "
       "run on different machines and scale on their own. Every speculation round is traced.")
STEPS = ["Open the valve on the north tank.", "Wait until the pressure reads ten bar.",
         "Close the valve on the south tank.", "Record the reading in the log book.",
         "Check the seals on both pumps.", "Switch the heater to its low setting.",
         "Drain the water from the east pipe.", "Clean the filter with fresh water.",
         "Refit the filter and tighten its cap.", "Tell the shift supervisor the test is done."]
CODE = ("def moving_average(values, window):\n    if window <= 0:\n        raise ValueError("
        "'window must be positive')\n    out = []\n    total = 0.0\n    for i, v in "
        "enumerate(values):\n        total += v\n        if i >= window:\n            total -= "
        "values[i - window]\n        out.append(total / min(i + 1, window))\n    return out")
# Plain chat, where little is copied: auto must not lose here either.
CHAT = ["Write a short paragraph about why the sky is blue.",
        "Give three tips for staying focused while studying, with one sentence each."]
# Picked so that this 135M target really copies on most (the copy share column says how much):
# asked to quote, repeat or correct a text it copies; asked to edit code or convert a table it
# mostly rewrites, and two prompts that only made it loop ("A: A: A: ...") were left out.
PROMPTS = [
    f"Repeat this text exactly, word for word:\n\n{DOC}",
    "Correct the spelling and repeat the rest unchanged: 'Teh quick brown fox jumpd over teh "
    "lazy dog, and then teh fox ran into teh forest where teh trees were tall and teh river "
    "was cold and clear.'",
    "Repeat this list exactly, one item per line:\n" + "\n".join(
        f"{i + 1}. {step}" for i, step in enumerate(STEPS)),
    "Rewrite this list as a numbered list, keeping every item exactly:\n- apples from the "
    "north orchard\n- pears from the south orchard\n- plums from the east orchard\n- cherries "
    "from the west orchard\n- grapes from the hill vineyard\n- figs from the old garden",
    f"Add a docstring to this function and return the whole function unchanged otherwise:\n\n"
    f"{CODE}",
    "Fix the grammar of this sentence and repeat it: 'The servers is fast and the gateway "
    "route every requests to a verifier that have the target model, which check the drafts.'",
    f"Summarise this document in two sentences, and after each sentence quote the words of the "
    f"document it relies on.\n\n{DOC}",
    "Convert this JSON to a markdown table with columns name, city, age:\n"
    '[{"name": "Alice Smith", "city": "Boston", "age": 34}, {"name": "Bob Jones", "city": '
    '"Denver", "age": 41}, {"name": "Carol White", "city": "Austin", "age": 29}, {"name": '
    '"David Brown", "city": "Seattle", "age": 52}]',
    *CHAT,
]
