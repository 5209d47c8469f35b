"""`tandem` command line. Options that also read an environment variable name it in --help."""
from __future__ import annotations

import argparse
import sys
import time

from tandem.device import add_device_flags
from tandem.envflags import add_flag
from tandem.models import DEFAULT_TARGET, ModelError
from tandem.tls import add_tls_flags, tls_from_args
from tools.models_cli import register_models


def _add_model_args(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--model", "TANDEM_MODEL", DEFAULT_TARGET,
             help="target model: the default name or a local HF checkpoint directory")
    add_flag(p, "--threads", "TANDEM_THREADS", 0, int,
             help="torch CPU threads, 0 = torch's default")
    add_flag(p, "--kv-cache-mb", "TANDEM_KV_CACHE_MB", 512, int, help="KV cache budget in MiB")


def _cmd_generate(args) -> int:
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from tandem.device import place
    from tandem.engine.exact_dtype import load_target
    from tandem.engine.generate import LocalGenerator
    from tandem.engine.model_runner import ModelRunner
    from tandem.models import resolve_model
    from tandem.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    at = place(args.device, args.dtype)  # a device this host lacks fails before any loading
    paths = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(paths.root))
    model = load_target(paths, at)
    runner = ModelRunner.with_memory(model, args.kv_cache_mb << 20, at.block_size)
    if args.raw or not tokenizer.chat_template:
        prompt_ids = tokenizer(args.prompt).input_ids
    else:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
    stop = tuple(t for t in [tokenizer.eos_token_id] if t is not None)
    bar = tqdm(total=args.max_tokens, unit="tok", file=sys.stderr, disable=args.quiet)
    start = time.perf_counter()
    out = LocalGenerator(runner).generate([list(prompt_ids)], params, args.max_tokens, stop,
                                          on_step=lambda n: bar.update(n))[0]
    elapsed = time.perf_counter() - start
    bar.close()
    print(tokenizer.decode(out, skip_special_tokens=True))
    print(f"[{len(out)} tokens in {elapsed:.2f} s: {len(out) / elapsed:.1f} tokens/s, "
          f"prompt {len(prompt_ids)} tokens]", file=sys.stderr)
    return 0


def _cmd_up(args) -> int:
    import signal

    from tools.launcher import Cluster, demo_completion
    from tools.supervisor import ClusterFailed

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        from tools.up_flags import up_config

        config = up_config(args, tls_from_args(args))
    except ValueError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    cluster = Cluster(config, log=lambda m: print(m, file=sys.stderr, flush=True))
    print("starting the Tandem cluster ...", file=sys.stderr, flush=True)
    try:
        cluster.start()
        print(f"Tandem is up: OpenAI API at {cluster.gateway_url}/v1 (Ctrl-C stops it)",
              flush=True)
        if args.demo:
            text, reply = demo_completion(cluster.gateway_url, args.demo)
            print(f"\n> {args.demo}\n{text}\n"
                  f"usage: {reply.get('usage')}\nspeculation: {reply.get('speculation')}",
                  flush=True)
        if not args.exit_after_demo:
            cluster.wait()
    except KeyboardInterrupt:
        print("stopping ...", file=sys.stderr, flush=True)
    except ClusterFailed as exc:  # one line, no traceback: the child's own output says more
        print(f"tandem up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        cluster.stop()
    return 0


def _cmd_keys_hash(args) -> int:
    """Read one key from stdin (without echo on a terminal), print its keys-file line."""
    import getpass

    from gateway.auth import ApiKey, digest_of

    key = (getpass.getpass("API key: ") if sys.stdin.isatty()
           else sys.stdin.readline().rstrip("\r\n"))
    if not key or any(c.isspace() for c in key) or "," in key:
        raise ValueError("the key on stdin must be one non-empty line without spaces or commas")
    print(ApiKey(digest_of(key), args.name, args.rpm, args.tpm).line())
    return 0


def _add_keys(sub) -> None:
    keys = sub.add_parser("keys", help="API keys for the gateway's --api-keys-file")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    h = ksub.add_parser("hash", help="print the keys-file line for a key read from stdin "
                        "(e.g. `tandem keys hash --name team-a --rpm 60 < key.txt`)")
    h.add_argument("--name", default="", help="label for logs and errors")
    h.add_argument("--rpm", type=int, default=None,
                   help="requests per minute for this key (0 = unlimited); "
                        "default: the gateway's --rate-limit-rpm")
    h.add_argument("--tpm", type=int, default=0,
                   help="prompt + completion tokens per minute, 0 = unlimited (default)")
    h.set_defaults(func=_cmd_keys_hash)


async def _colocate(model, paths, config):
    """The verifier's in-process layer-skip worker (imports draft_service only when used)."""
    from tools.colocate import start_layer_skip

    return await start_layer_skip(model, paths, config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Disaggregated speculative decoding: draft workers propose, "
        "verifier workers accept or reject losslessly, a gateway speaks the OpenAI API.")
    sub = parser.add_subparsers(dest="command", required=True)

    register_models(sub, _add_model_args)

    gen = sub.add_parser("generate", help="generate locally with the target runner (no services)")
    gen.add_argument("prompt", help="the user message (or raw text with --raw)")
    _add_model_args(gen)
    add_device_flags(gen, "TANDEM")
    gen.add_argument("--max-tokens", type=int, default=128, help="default %(default)s")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    gen.set_defaults(func=_cmd_generate)

    up = sub.add_parser("up", help="start a local cluster: redis, verifier, draft workers, "
                        "gateway (separate processes)")
    add_flag(up, "--drafts", "TANDEM_UP_DRAFTS", 1, int, help="draft worker processes")
    add_flag(up, "--verifiers", "TANDEM_UP_VERIFIERS", 1, int, help="verifier processes")
    add_flag(up, "--host", "TANDEM_GATEWAY_HOST", "127.0.0.1", help="gateway address to bind")
    add_flag(up, "--port", "TANDEM_GATEWAY_PORT", 8000, int, help="gateway HTTP port")
    add_flag(up, "--model", "TANDEM_MODEL", "", help="target model (default: the shipped target)")
    add_flag(up, "--draft-model", "TANDEM_DRAFT_MODEL", "",
             help="draft model (default: the shipped draft); with --model, one of another "
                  "tokenizer drafts only the tokens both vocabularies share")
    add_flag(up, "--threads", "TANDEM_THREADS", 1, int,
             help="torch threads per draft worker process")
    add_flag(up, "--verifier-threads", "TANDEM_VERIFIER_THREADS", 0, int,
             help="torch threads per verifier, 0 = this host's cores shared by the verifiers "
                  "(its forwards of a few rows on one)")
    from tools.up_flags import add_up_spec_flags

    add_up_spec_flags(up)
    add_device_flags(up, "TANDEM_UP")  # passed to the verifier and draft processes
    up.add_argument("--demo", default="", metavar="PROMPT",
                    help="send this chat message once the cluster is up and print the reply")
    up.add_argument("--exit-after-demo", action="store_true", help="stop after the demo")
    add_tls_flags(up)  # passed on to every process; the certificate must name 127.0.0.1
    up.set_defaults(func=_cmd_up)
    _add_keys(sub)

    from draft_service.cli import register as register_draft
    from gateway.cli import register as register_gateway
    from tools.bench.cli import register as register_bench
    from verify_service.cli import register as register_verifier

    register_verifier(sub, _colocate)
    from verify_service.tp.cli import register as register_tp_worker

    register_tp_worker(sub)
    register_draft(sub)
    register_gateway(sub)
    register_bench(sub)
    from tools.plan.cli import register as register_plan

    register_plan(sub)
    from tools.distill.cli import register as register_distill

    register_distill(sub)
    from tools.skip_search_cli import register as register_search_skip

    register_search_skip(sub)
    from tandem.drain import register as register_drain

    register_drain(sub)
    from tools.gpu_check.cli import register as register_gpu_check

    register_gpu_check(sub)
    return parser


def _drain_parser() -> argparse.ArgumentParser:
    """`tandem drain` alone: it is a preStop hook, so it must not wait ~1.5 s for every
    other command's imports (torch among them) before it signals."""
    from tandem.drain import register as register_drain

    parser = argparse.ArgumentParser(prog="tandem")
    register_drain(parser.add_subparsers(dest="command", required=True))
    return parser


def _gpu_check_parser() -> argparse.ArgumentParser:
    """`tandem gpu-check` alone: it runs on a stock PyTorch image, which lacks what the
    other commands' parsers import (FastAPI, Redis, OpenTelemetry)."""
    from tools.gpu_check.cli import register as register_gpu_check

    parser = argparse.ArgumentParser(prog="tandem")
    register_gpu_check(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    lean = {"drain": _drain_parser, "gpu-check": _gpu_check_parser}.get(argv[0] if argv else "")
    parser = lean() if lean else build_parser()
    args = parser.parse_args(argv)
    args.argv = argv  # model cards record the command
    try:
        return args.func(args)
    except (ModelError, ValueError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
