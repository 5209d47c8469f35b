"""Draining before a pod stops: `tandem drain` (the preStop hook) and the signal it sends.

Kubernetes runs the preStop hook, waits for it, and only then sends SIGTERM. `tandem drain`
sends SIGUSR1 to the container's main process and sleeps: a worker leaves the Redis registry at
once (the gateway stops routing new sessions to it), reports its service NOT_SERVING and refuses
new sessions with UNAVAILABLE, while the sessions it holds run on; the gateway's /health turns
503 so its readiness drops. SIGTERM then does the rest (each service's drain on SIGTERM).
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable

DRAIN_SIGNAL = signal.SIGUSR1


class DrainSignal:
    """SIGUSR1, caught from process start. One that lands while the service is still loading
    is remembered and acted on once it is up (the default action would end the process)."""

    def __init__(self):
        self.requested = False
        signal.signal(DRAIN_SIGNAL, self._remember)

    def _remember(self, *_) -> None:
        self.requested = True

    def on_loop(self, begin: Callable[[], Awaitable[None]]) -> None:
        """Run `begin()` on the running loop at the first SIGUSR1 (or now, if one came
        already); later ones change nothing."""
        loop = asyncio.get_running_loop()
        started: list[asyncio.Task] = []  # also keeps the task referenced until it ends

        def fire() -> None:
            if not started:
                started.append(loop.create_task(begin()))

        loop.add_signal_handler(DRAIN_SIGNAL, fire)
        if self.requested:
            fire()

    def on_signal(self, callback: Callable[[], None]) -> None:
        """Call `callback` from the signal handler (main thread; it must be quick)."""
        signal.signal(DRAIN_SIGNAL, lambda *_: callback())
        if self.requested:
            callback()


async def set_health(servicer, names: Iterable[str], status) -> None:
    """grpc.health.v1 status of `names` (the aio servicer's set is a coroutine, the sync one's
    is not)."""
    for name in names:
        result = servicer.set(name, status)
        if asyncio.iscoroutine(result):
            await result


def register(sub) -> None:
    """Add `drain` to the `tandem` command's subparsers."""
    p = sub.add_parser(
        "drain", help="preStop hook: tell a Tandem process to start draining, then wait",
        description="Send SIGUSR1 to --pid (a verifier or draft worker leaves the registry and "
                    "takes no new sessions; the gateway's /health turns 503), then sleep while "
                    "load balancers and DNS drop the pod. SIGTERM, sent after the hook, stops "
                    "the process gracefully.")
    p.add_argument("--pid", type=int, default=1,
                   help="process to signal (default 1: the container's main process)")
    p.add_argument("--sleep", type=float, default=5.0, metavar="S",
                   help="seconds to wait after signalling (default 5)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.pid < 1 or not args.sleep >= 0:  # `not >=` also refuses nan
        raise ValueError(f"need --pid >= 1 and --sleep >= 0, got {args.pid} and {args.sleep}")
    rc = 0
    try:
        os.kill(args.pid, DRAIN_SIGNAL)
    except OSError as exc:  # no such process, not ours: still sleep, the hook's other half
        print(f"tandem drain: cannot signal pid {args.pid}: {exc.strerror or exc}",
              file=sys.stderr)
        rc = 1
    time.sleep(args.sleep)
    return rc
