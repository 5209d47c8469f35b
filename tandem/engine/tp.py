"""Tensor parallelism's pieces: the process group, its two collectives, and the weight shards.

Megatron's split, as nano-vllm's layers/linear.py and gpt-fast's tp.py do it: q/k/v and
gate/up are column-parallel (each rank owns whole attention heads, whole KV-head groups and a
slice of the MLP's columns), o and down are row-parallel (each rank's partial sum, one
all-reduce after each), and the embedding and LM head are split by vocabulary rows. The
checkpoint's tensors are sliced by name before the model is built, so LlamaModel's loader,
fused q/k/v and gate/up (each part sliced on its own, then concatenated) and int8
quantization run unchanged on every rank's shard.
"""
from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from safetensors import safe_open

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.tp_wire import broadcast_message, receive_message, rendezvous_store
from tandem.models import ModelError, ModelPaths

COLUMN = (".q_proj.", ".k_proj.", ".v_proj.", ".gate_proj.", ".up_proj.")  # output dim split
ROW = (".o_proj.weight", ".down_proj.weight")  # input dim split; their biases stay whole
VOCAB = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group; world_size 1 makes every collective a
    no-op. The data collectives run on the default process group (NCCL on GPUs, gloo on CPUs)."""

    rank: int
    world_size: int

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:  # [...] summed over ranks, in place
        if self.world_size > 1:
            x = x.contiguous()
            dist.all_reduce(x)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on each rank -> [rows, world_size * cols], rank-major."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)


def check_shardable(cfg: LlamaConfig, world_size: int) -> None:
    """Refuse a split that would cut a KV-head group (or a head, or the MLP) across ranks."""
    if world_size < 1:
        raise ModelError(f"tensor parallel size must be >= 1, got {world_size}")
    if cfg.num_kv_heads % world_size:
        raise ModelError(
            f"--tensor-parallel-size {world_size} does not divide the model's "
            f"{cfg.num_kv_heads} KV heads: each rank must own whole KV-head groups "
            f"(choose a divisor of {cfg.num_kv_heads})")
    if cfg.intermediate_size % world_size:
        raise ModelError(f"--tensor-parallel-size {world_size} does not divide the MLP's "
                         f"{cfg.intermediate_size} columns")


def local_config(cfg: LlamaConfig, world_size: int) -> LlamaConfig:
    """One rank's shape: its heads, KV heads and MLP columns; vocab_size stays the full
    vocabulary, since the LM head's shards are gathered before anyone sees logits."""
    check_shardable(cfg, world_size)
    return replace(cfg, num_heads=cfg.num_heads // world_size,
                   num_kv_heads=cfg.num_kv_heads // world_size,
                   intermediate_size=cfg.intermediate_size // world_size)


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of each rank's vocabulary shard (the last one zero-padded up to it)."""
    return -(-vocab_size // world_size)


def shard_range(name: str, shape: tuple[int, ...], group: TPGroup) -> tuple[int, slice] | None:
    """The dim and the range of it that this rank owns of checkpoint tensor `name` (None:
    every rank holds it whole). Vocabulary ranges may run past the end: the rows are padded."""
    if name.endswith(VOCAB):
        rows = vocab_rows(shape[0], group.world_size)
        return 0, slice(group.rank * rows, (group.rank + 1) * rows)
    if any(part in name for part in COLUMN):  # weight [out, in] and bias [out]
        dim = 0
    elif name.endswith(ROW):
        dim = 1
    else:
        return None
    if shape[dim] % group.world_size:
        raise ModelError(f"{name} of shape {tuple(shape)} does not split {group.world_size} "
                         f"ways on dim {dim}")
    size = shape[dim] // group.world_size
    return dim, slice(group.rank * size, (group.rank + 1) * size)


def _padded(name: str, t: torch.Tensor, shape: tuple[int, ...], group: TPGroup):
    """A vocabulary shard zero-padded to vocab_rows (the last rank's rows past the end)."""
    if not name.endswith(VOCAB):
        return t
    pad = vocab_rows(shape[0], group.world_size) - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def shard_weights(weights: dict[str, torch.Tensor], group: TPGroup) -> dict[str, torch.Tensor]:
    """This rank's slice of every checkpoint tensor, by name (the rest stays whole)."""
    out = {}
    for name, t in weights.items():
        owned = shard_range(name, tuple(t.shape), group)
        if owned is None:
            out[name] = t
            continue
        dim, rng = owned
        part = (t[rng] if dim == 0 else t[:, rng]).clone()
        out[name] = _padded(name, part, tuple(t.shape), group)
    return out


def load_shard(paths: ModelPaths, group: TPGroup) -> dict[str, torch.Tensor]:
    """shard_weights of the checkpoint, reading only this rank's slices from disk: a rank
    never holds the whole model, in host memory either."""
    out = {}
    for file in paths.safetensors():
        with safe_open(str(file), framework="pt") as f:
            for full in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name, view = full.removeprefix("model."), f.get_slice(full)
                shape = tuple(view.get_shape())
                owned = shard_range(name, shape, group)
                if owned is None:
                    out[name] = f.get_tensor(full)
                    continue
                dim, rng = owned
                part = view[rng] if dim == 0 else view[:, rng]
                out[name] = _padded(name, part, shape, group)
    return out


class Control:
    """Rank 0's step messages to the other ranks (tp_wire's JSON, broadcast over a gloo group
    on the CPU, so NCCL's streams never wait on Python objects). While idle the leader sends
    a ping every `heartbeat_s`, so a worker's wait never reaches the collective timeout; a
    dead peer fails the next broadcast or collective within that timeout instead of hanging."""

    def __init__(self, group: TPGroup, pg, heartbeat_s: float = 0.0,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.group, self.pg = group, pg
        self.lock = threading.RLock()  # one step's messages and collectives at a time
        self.failure: BaseException | None = None
        self.on_failure = on_failure
        self._last = time.monotonic()
        self._stop = threading.Event()
        if heartbeat_s > 0:
            self.start_heartbeat(heartbeat_s)

    def start_heartbeat(self, every_s: float) -> None:
        """Rank 0: ping the workers whenever it has sent nothing for `every_s` (only once
        every rank has loaded: a ping waits for each worker to receive it)."""
        if self.group.rank == 0:
            self._last = time.monotonic()
            threading.Thread(target=self._beat, args=(every_s,), daemon=True,
                             name="tp-heartbeat").start()

    def send(self, message: tuple) -> None:
        """Rank 0: every other rank receives `message` (call under self.lock)."""
        if self.failure is not None:
            raise RuntimeError("the tensor-parallel group has failed") from self.failure
        try:
            broadcast_message(message, self.pg)
        except BaseException as e:
            self.fail(e)
            raise
        self._last = time.monotonic()

    def fail(self, error: BaseException) -> None:
        """The ranks may be out of step from here on: refuse every later step, report once."""
        if self.failure is not None:
            return
        self.failure = error
        self._stop.set()
        if self.on_failure is not None:
            self.on_failure(error)

    def recv(self) -> tuple:
        """Another rank: rank 0's next message, decoded and checked (never unpickled)."""
        return receive_message(self.pg)

    def _beat(self, every_s: float) -> None:
        while not self._stop.wait(every_s / 2):
            if time.monotonic() - self._last < every_s:
                continue
            try:
                with self.lock:
                    if not self._stop.is_set():
                        self.send(("ping",))
            except BaseException:  # noqa: BLE001 (send reported it; the beat ends)
                return

    def stop(self) -> None:
        self._stop.set()


# Loading a shard can take minutes (a large checkpoint off network storage), far beyond a
# step's collective timeout: the ranks meet once loaded, on a gloo group of their own with
# this long a timeout, and rank 0's heartbeat starts only then.
LOAD_TIMEOUT_S = 1800.0


def init_group(rank: int, world_size: int, init_method: str, backend: str,
               timeout_s: float) -> tuple[TPGroup, object, object]:
    """Join the process group; returns this rank's TPGroup, the gloo control group and the
    group the ranks meet on once loaded (all_loaded)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method.startswith("tcp://"):  # our store: on the master's host only
        store = rendezvous_store(rank, world_size, init_method, timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    loading = dist.new_group(backend="gloo", timeout=datetime.timedelta(
        seconds=max(timeout_s, LOAD_TIMEOUT_S)))
    return TPGroup(rank, world_size), control or dist.group.WORLD, loading


def all_loaded(loading) -> None:
    """Wait until every rank has loaded its shard (the loading group init_group made)."""
    dist.barrier(group=loading)
