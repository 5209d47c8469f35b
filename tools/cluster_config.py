"""What `tandem up` starts (tools/launcher.py): how many of each process, where they listen,
and the flags each gets. Frozen and checked when made, so a bad flag fails before anything
starts."""
from __future__ import annotations

import os
from dataclasses import dataclass

from tandem.device import check_device_spec, check_dtype_spec
from tandem.tls import TlsConfig


def _cores() -> int:
    """CPUs this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class ClusterConfig:
    num_drafts: int = 1
    num_verifiers: int = 1
    gateway_host: str = "127.0.0.1"  # "::" = every IPv6 and IPv4 address
    gateway_port: int = 8000
    model: str = ""  # "" = each role's default
    draft_model: str = ""
    eagle: str = ""  # EAGLE head directory; "" = the shipped one if present
    redis_url: str = ""
    threads: int = 1  # per draft worker: a batch-1 forward keeps one core busy
    # per verifier; 0 = every core for one, the cores / N for N (verifier_thread_count); its
    # forwards of a few rows on one either way (tandem/engine/forward_threads.py)
    verifier_threads: int = 0
    worker_host: str = "127.0.0.1"  # where verifiers and drafts bind and register ("::1" too)
    tls: TlsConfig | None = None  # gRPC over TLS between every process (and our checks)
    # Where the verifiers and draft workers run their models (tandem.device): "auto" passes
    # nothing, so each process decides (its TANDEM_VERIFIER_DEVICE / TANDEM_DRAFT_DEVICE,
    # else CUDA when present); anything else is passed as --device / --dtype.
    device: str = "auto"
    dtype: str = "auto"
    # More flags for every verifier and draft worker (vLLM's flags and --speculative-config,
    # tandem.vllm_compat), and the gateway's --method-preference ("" = its default).
    verifier_args: tuple[str, ...] = ()
    draft_args: tuple[str, ...] = ()
    method_preference: str = ""
    gateway_args: tuple[str, ...] = ()  # more flags for the gateway (--chat-template)

    def __post_init__(self):
        if min(self.num_drafts, self.threads, self.verifier_threads, self.num_verifiers - 1) < 0:
            raise ValueError("need num_verifiers >= 1, num_drafts >= 0 and threads >= 0")
        check_device_spec(self.device)
        check_dtype_spec(self.dtype)

    def verifier_thread_count(self) -> int:
        """--threads of each verifier: verifier_threads when set; else 0 for one verifier
        (torch's default, every core) and, for several on one host, each its share of the
        cores rather than every core each."""
        if self.verifier_threads or self.num_verifiers == 1:
            return self.verifier_threads
        return max(1, _cores() // self.num_verifiers)

    def placement_args(self) -> list[str]:  # --device / --dtype for a worker
        return ([] if self.device == "auto" else ["--device", self.device]) + \
            ([] if self.dtype == "auto" else ["--dtype", self.dtype])
