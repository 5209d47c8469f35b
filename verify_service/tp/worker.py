"""The ranks of a tensor-parallel verifier besides rank 0: how they start and what they run.

Rank 0 (the verifier the cluster sees) spawns one process per other rank on this node
(`spawn_workers`); each joins the process group, loads its shard and follows rank 0's steps
(tandem.engine.tp_runner.follow) until told to stop. A worker whose leader dies fails its
next wait within the collective timeout and exits non-zero: nothing hangs.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker rank needs; picklable for a spawned process."""

    rank: int
    world_size: int
    init_method: str  # tcp://host:port of rank 0's rendezvous
    model: str  # a checkpoint directory or default model name (tandem.models.resolve_model)
    dtype: str  # a resolved weight dtype: float32, bfloat16, float16, int8
    device: str  # "cpu", or "cuda" (this rank's GPU: cuda:<rank>)
    batch_invariant: bool = False
    threads: int = 0  # torch CPU threads, 0 = torch's default
    timeout_s: float = 60.0  # collective timeout: a dead peer is noticed within it
    local_rank: int = -1  # this rank's GPU on its node (cuda:<local_rank>); -1: the rank
    ready_file: str = ""  # written once this rank has joined and loaded its shard (a probe)

    def __post_init__(self):
        if not 0 < self.rank < self.world_size:
            raise ValueError(f"a worker's rank must be in [1, {self.world_size}), got {self.rank}")
        if not self.init_method.startswith(("tcp://", "env://", "file://")):
            raise ValueError(f"init_method must be a tcp://, env:// or file:// URL, got "
                             f"{self.init_method!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if not -1 <= self.local_rank < self.world_size:
            raise ValueError(f"local_rank must be in [-1, {self.world_size}), got "
                             f"{self.local_rank}")
        if self.threads < 0 or self.timeout_s <= 0:
            raise ValueError("threads must be >= 0 and timeout_s > 0")

    @property
    def backend(self) -> str:
        return backend_for(self.device)

    def torch_device(self) -> str:
        index = self.rank if self.local_rank < 0 else self.local_rank
        return f"cuda:{index}" if self.device == "cuda" else "cpu"


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def worker_main(spec: WorkerSpec) -> None:
    """A spawned worker rank's whole life; exits non-zero when the group fails."""
    import torch
    import torch.distributed as dist

    from tandem.engine.tp import Control, all_loaded, init_group
    from tandem.engine.tp_llama import TPLlamaModel
    from tandem.engine.tp_runner import follow
    from tandem.models import resolve_model

    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s tp-rank-{spec.rank}: %(message)s")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.device == "cuda":
        torch.cuda.set_device(spec.torch_device())
    group, pg, loading = init_group(spec.rank, spec.world_size, spec.init_method,
                                    spec.backend, spec.timeout_s)
    try:
        model = TPLlamaModel.load(resolve_model(spec.model), group, spec.dtype,
                                  batch_invariant=spec.batch_invariant,
                                  device=spec.torch_device())
        if spec.ready_file:
            Path(spec.ready_file).write_text(f"rank {spec.rank}\n")
        all_loaded(loading)
        follow(model, Control(group, pg))
    except Exception:
        log.exception("rank %d: the tensor-parallel group failed", spec.rank)
        sys.exit(1)
    dist.destroy_process_group()


def spawn_workers(specs: list[WorkerSpec]) -> list:
    """Start one process per spec (spawned: CUDA and threads do not survive a fork)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, args=(spec,), daemon=True,
                         name=f"tandem-tp-rank-{spec.rank}") for spec in specs]
    for p in procs:
        p.start()
    return procs
