"""What each step does, in pure Python: the scheduler's batch and k per session, auto's
pick among proposals, what a round teaches the next (feedback), and the measured cost
curves (calibration)."""
