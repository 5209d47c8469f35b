"""The draft worker's speculation methods, one module each, all behind `tandem.spec.Proposer`.

draft_model: a small causal LM over the shared paged engine (tandem.engine).
ngram: prompt lookup, no model.
eagle: a feature head on the target's hidden states; eagle_tree: its EAGLE-2 dynamic token tree.
suffix: suffix decoding over this and earlier sequences, no model.
mtp: the target checkpoint's own MTP module, drafting as eagle does.
layer_skip: the target itself minus a searched set of layers, drafting as draft_model does.
"""
