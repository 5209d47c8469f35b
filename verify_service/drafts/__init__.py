"""Where drafts come from: the draft side (side) over draft-link streams to draft workers
(link), how long a round waits for them (waits), and the proposers hosted in the verifier's
own step (history)."""
