"""Rank 0 of a tensor-parallel verifier: start the group, load its shard, own its runner."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch.distributed as dist

from tandem.device import place
from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.tp import Control, all_loaded, check_shardable, init_group
from tandem.engine.tp_llama import TPLlamaModel
from tandem.engine.tp_runner import TPLeaderRunner
from tandem.models import ModelPaths, read_hf_config, resolve_model
from tandem.netaddr import free_port, join_host_port
from verify_service.tp.worker import WorkerSpec, backend_for, spawn_workers

log = logging.getLogger(__name__)


@dataclass
class TPLeader:
    """The group as rank 0 holds it: its shard, the control channel, the worker processes."""

    model: TPLlamaModel
    control: Control
    procs: list
    runner: TPLeaderRunner | None = None
    closed: bool = field(default=False)

    def make_runner(self, kv_cache_bytes: int, block_size: int,
                    keep_features: bool, feature_layers: tuple[int, ...] = ()
                    ) -> TPLeaderRunner:
        self.runner = TPLeaderRunner.with_memory(self.model, kv_cache_bytes, block_size,
                                                 keep_features, control=self.control,
                                                 feature_layers=feature_layers)
        return self.runner

    def report_failure_to(self, failed: asyncio.Event, loop: asyncio.AbstractEventLoop) -> None:
        """Set `failed` (the verifier then stops and exits non-zero) when the group fails."""
        def report(error: BaseException) -> None:
            log.error("the tensor-parallel group failed: %s", error)
            loop.call_soon_threadsafe(failed.set)
        self.control.on_failure = report

    def close(self, join_s: float = 10.0) -> None:
        """Stop the workers (a failed group's are terminated) and leave the group."""
        if self.closed:
            return
        self.closed = True
        self.control.stop()
        try:
            with self.control.lock:
                if self.control.failure is None:
                    self.control.send(("stop",))
        except Exception:  # noqa: BLE001 (a dead peer: terminate below)
            log.warning("tensor-parallel stop message failed", exc_info=True)
        failed = self.control.failure is not None  # its live ranks wait on the dead one
        for p in self.procs:
            p.join(0 if failed else join_s)
            if p.is_alive():
                p.terminate()
                p.join(join_s)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_leader(model: str, world_size: int, dtype: str, device: str = "cpu",
                 batch_invariant: bool = False, threads: int = 0, timeout_s: float = 60.0,
                 local_ranks: int = 0, master: str = "") -> TPLeader:
    """Spawn ranks 1..local_ranks-1 on this node (0: every rank), join the group as rank 0 and
    load rank 0's shard. Ranks from local_ranks on are other nodes' (`tandem tp-worker`), who
    meet rank 0 at `master` (host:port it listens on; "" = loopback and a free port, for a
    group on this node only). A world size that would split a KV-head group is refused
    before anything starts."""
    paths = resolve_model(model)
    check_shardable(LlamaConfig.from_hf(read_hf_config(paths)), world_size)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"a tensor-parallel verifier runs on cpu or cuda, got {device!r}")
    local_ranks = local_ranks or world_size
    if not 1 <= local_ranks <= world_size or (local_ranks < world_size and not master):
        raise ValueError(f"local_ranks must be in [1, {world_size}], and below it needs the "
                         f"master address remote ranks dial (got {local_ranks}, {master!r})")
    init = f"tcp://{master or join_host_port('127.0.0.1', free_port())}"
    specs = [WorkerSpec(rank, world_size, init, str(paths.root), dtype, device,
                        batch_invariant, threads, timeout_s) for rank in range(1, local_ranks)]
    procs = spawn_workers(specs)
    if device == "cuda":
        import torch

        torch.cuda.set_device(0)
    try:
        group, pg, loading = init_group(0, world_size, init, backend_for(device), timeout_s)
        control = Control(group, pg)
        shard = TPLlamaModel.load(paths, group, dtype, batch_invariant=batch_invariant,
                                  device="cuda:0" if device == "cuda" else "cpu")
        all_loaded(loading)  # no step or ping before every worker can receive it
        control.start_heartbeat(timeout_s / 4)
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    log.info("tensor parallel: rank 0 of %d (%s), %d of %d heads per rank", world_size,
             backend_for(device), shard.cfg.num_heads, shard.full_cfg.num_heads)
    return TPLeader(shard, control, procs)


def start_for(config, paths: ModelPaths, model=None) -> TPLeader:
    """The group a VerifierConfig asks for. --dtype auto is the device's float dtype here
    (float32 on the CPU, bfloat16 on a GPU): int8's exactness check would need every rank's
    agreement."""
    if model is not None:
        raise ValueError("a tensor-parallel verifier loads its own shards; no model may be given")
    at = place(config.device, config.dtype, config.block_size)
    log.info("tensor-parallel target over %d ranks on %s", config.tensor_parallel_size, at)
    return start_leader(str(paths.root), config.tensor_parallel_size, at.dtype,
                        at.device.type, config.batch_invariant, config.threads,
                        config.tensor_parallel_timeout_s, config.tensor_parallel_local_ranks,
                        config.tensor_parallel_master)
