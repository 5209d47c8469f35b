"""One step on torch: the step's immutable inputs and outcomes (step), the forward
(executor), the round judged in one place (rejection), and what the kept positions
carry out (logprobs, features)."""
