"""`tandem tp-worker`: ranks of a tensor-parallel verifier on another node.

Rank 0 is `tandem verifier --tensor-parallel-size N --tensor-parallel-local-ranks L
--tensor-parallel-master HOST:PORT`; each other node runs `tandem tp-worker` with the same
model, size and master, and its first rank: --first-rank, or --node-index (under a
LeaderWorkerSet `--node-index=$(LWS_WORKER_INDEX)`, so the first rank is LWS_WORKER_INDEX * L).
It runs its first rank in this process and spawns the others; it exits non-zero when the group
fails (a dead rank anywhere, within the collective timeout).
"""
from __future__ import annotations

import argparse
import logging

from tandem.device import add_device_flags
from tandem.envflags import add_flag, add_log_level_flag, boolean

ENV = "TANDEM_TP_WORKER"


def register(sub) -> None:
    p = sub.add_parser("tp-worker", help="ranks of a tensor-parallel verifier on another node",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    add_flag(p, "--model", "TANDEM_MODEL", "SmolLM2-135M-Instruct",
             help="the verifier's target (same as rank 0's)")
    add_flag(p, "--tensor-parallel-size", f"{ENV}_TENSOR_PARALLEL_SIZE", 2, int,
             help="ranks in the whole group")
    add_flag(p, "--first-rank", f"{ENV}_FIRST_RANK", 1, int,
             help="the first of this node's ranks")
    add_flag(p, "--node-index", f"{ENV}_NODE_INDEX", None, int,
             help="this node's index in the group (rank 0's node is 0; under a LeaderWorkerSet "
                  "$(LWS_WORKER_INDEX)): the first rank is node index * --local-ranks, "
                  "instead of --first-rank")
    add_flag(p, "--local-ranks", f"{ENV}_LOCAL_RANKS", 1, int,
             help="ranks on this node (one GPU each: cuda:0..)")
    add_flag(p, "--master", f"{ENV}_MASTER", "", help="rank 0's host:port (required)")
    add_flag(p, "--ready-file", f"{ENV}_READY_FILE", "",
             help="a file this process writes once its rank has joined the group and loaded "
                  "its shard (a readiness probe's `test -f`); none by default")
    add_flag(p, "--threads", f"{ENV}_THREADS", 0, int, help="torch CPU threads per rank")
    add_flag(p, "--tensor-parallel-timeout-s", f"{ENV}_TIMEOUT_S", 60.0, float,
             help="collective timeout (as rank 0's)")
    add_flag(p, "--batch-invariant", f"{ENV}_BATCH_INVARIANT", False, boolean, nargs="?",
             const=True, metavar="on|off", help="as rank 0's --batch-invariant")
    add_device_flags(p, ENV, "auto", "weight dtype, as rank 0's (auto: float32 on the cpu, "
                     "bfloat16 on cuda)")
    add_log_level_flag(p, f"{ENV}_LOG_LEVEL")
    p.set_defaults(func=_run)


def specs_from(args: argparse.Namespace) -> list:
    from tandem.device import place
    from tandem.netaddr import split_host_port
    from verify_service.tp.worker import WorkerSpec

    if not args.master:
        raise SystemExit("tandem tp-worker: --master HOST:PORT (rank 0's) is required")
    split_host_port(args.master)
    first = args.first_rank if args.node_index is None else args.node_index * args.local_ranks
    if args.node_index is not None and args.node_index < 1:
        raise SystemExit(f"tandem tp-worker: --node-index {args.node_index}: node 0 is rank 0's "
                         "(`tandem verifier`); workers are 1..")
    if first < 1 or first + args.local_ranks > args.tensor_parallel_size:
        raise SystemExit(f"tandem tp-worker: ranks {first}..{first + args.local_ranks - 1} are "
                         f"not within 1..{args.tensor_parallel_size - 1} (--tensor-parallel-size "
                         f"{args.tensor_parallel_size})")
    at = place(args.device, args.dtype)
    return [WorkerSpec(first + i, args.tensor_parallel_size, f"tcp://{args.master}",
                       args.model, at.dtype, at.device.type, args.batch_invariant, args.threads,
                       args.tensor_parallel_timeout_s, local_rank=i,
                       ready_file=args.ready_file if i == 0 else "")
            for i in range(args.local_ranks)]


def _run(args: argparse.Namespace) -> int:
    from verify_service.tp.worker import spawn_workers, worker_main

    logging.basicConfig(level=args.log_level.upper())
    first, *others = specs_from(args)
    procs = spawn_workers(others)
    worker_main(first)  # exits non-zero itself when the group fails
    for p in procs:
        p.join()
    return max([0, *(p.exitcode or 0 for p in procs)])
