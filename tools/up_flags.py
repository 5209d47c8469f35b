"""`tandem up`'s speculation flags (vLLM's names beside Tandem's) and its ClusterConfig."""
from __future__ import annotations

import argparse

from tandem.envflags import add_flag, env
from tandem.vllm_compat import (
    add_speculative_config_flag,
    add_vllm_aliases,
    as_flags,
    parse_speculative_config,
    up_overrides,
)


def add_up_spec_flags(up) -> None:
    """`tandem up`'s speculation flags, vLLM's names beside Tandem's, passed to its workers."""
    add_flag(up, "--eagle", "TANDEM_UP_EAGLE", "",
             help="EAGLE head directory (Tandem's, published, or speculators' format; an "
                  "EAGLE-3 head's verifiers ship the layers its config names), or 'none'")
    up.add_argument("--max-spec-tokens", type=int, default=None,
                    help="the verifiers' k cap (default: theirs)")
    add_vllm_aliases(up)
    up.add_argument("--max-model-len", type=int, default=None,
                    help="the verifiers' longest context (vLLM's flag; default: the model's)")
    up.add_argument("--max-num-seqs", type=int, default=None,
                    help="sessions a verifier verifies together (vLLM's flag)")
    up.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=None, help="the verifiers' prefix caching (vLLM's flag; default on)")
    add_speculative_config_flag(up)
    add_flag(up, "--chat-template", "TANDEM_GATEWAY_CHAT_TEMPLATE", "",
             help="the gateway's chat template: a Jinja file or the template inline (vLLM's "
                  "flag); unset = the checkpoint's; with neither, chat completions get 400")


def up_config(args, tls=None):
    """`tandem up`'s ClusterConfig: its flags, vLLM's among them, then --speculative-config
    (tandem.vllm_compat) over them."""
    from tools.cluster_config import ClusterConfig

    verifier = {"max_spec_tokens": args.max_spec_tokens, "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs}
    fields = dict(num_drafts=args.drafts, num_verifiers=args.verifiers, gateway_host=args.host,
                  gateway_port=args.port, model=args.model, draft_model=args.draft_model,
                  eagle=args.eagle, redis_url=env("REDIS_URL", ""), threads=args.threads,
                  verifier_threads=args.verifier_threads,
                  tls=tls, device=args.device, dtype=args.dtype,
                  gateway_args=("--chat-template", args.chat_template) if args.chat_template
                  else ())
    vargs = as_flags({k: v for k, v in verifier.items() if v is not None})
    if args.enable_prefix_caching is not None:
        vargs.append(("--" if args.enable_prefix_caching else "--no-") + "enable-prefix-caching")
    if args.speculative_config:
        over = up_overrides(parse_speculative_config(args.speculative_config))
        vargs += over.pop("verifier_args")  # later flags win in argparse
        fields.update(over)
    return ClusterConfig(**{**fields, "verifier_args": tuple(vargs)})
