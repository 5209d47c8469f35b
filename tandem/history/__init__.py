"""Proposers that read only the token history (no model): n-gram prompt lookup and suffix
decoding. The verifier runs them inside its own step (no network hop on the critical path);
a draft worker can serve them too."""
