"""`tandem distill` / `tandem acceptance`: train a draft model for a target by knowledge
distillation on text the target itself generates, and measure how often the target accepts it.
"""
