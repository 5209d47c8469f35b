"""The draft worker's speculation methods, one module each, all behind `tandem.spec.Proposer`.

draft_model: a small causal LM over the shared paged engine (tandem.engine).
eagle: a feature head on the target's hidden states; eagle_tree: its EAGLE-2 dynamic token tree.
mtp: the target checkpoint's own MTP module, drafting as eagle does.
layer_skip: the target itself minus a searched set of layers, drafting as draft_model does.
The token-history proposers (ngram, suffix) live in the core, tandem/history/: the verifier
runs them in its own step, and the draft worker serves them from there too.
"""
