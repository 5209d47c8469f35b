"""Every speculation method's proposer, one module each, all behind `tandem.spec.Proposer`
(vLLM's v1/spec_decode/, SGLang's speculative/). A proposer is hosted either in the verifier's
own step (the token-history methods; no network hop) or by a draft worker
(draft_service/: sessions, streams, the gRPC server) through the same interface.

  draft_model   a small causal LM over the shared paged engine (tandem.engine)
  bridged       a draft model with another tokenizer, proposing only tokens in both
                vocabularies (token_bridge: the text bridge and the vocabulary map)
  eagle         a feature head on the target's hidden states; eagle_tree: its EAGLE-2 tree
  mtp           the target checkpoint's own MTP module, drafting as eagle does
  layer_skip    the target itself minus a searched set of layers, drafting as draft_model
  ngram         prompt lookup (PaddleNLP's inference_with_reference): no model
  suffix        suffix decoding over the prompt and earlier outputs (ArcticInference)
  medusa        the target's Medusa heads, hosted in the verifier's forward step on the hidden
                state it just computed (verify_service/forward/features.py)
"""
