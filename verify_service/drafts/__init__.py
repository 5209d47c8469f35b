"""Where drafts come from: the draft side (side) over draft-link streams to draft workers
(link), and the proposers hosted in the verifier's own step (history)."""
