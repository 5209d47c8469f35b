"""The model runner of a tensor-parallel group: rank 0 leads, every other rank follows.

Rank 0's runner is the one the verifier's executor calls. Before each forward it broadcasts
the step's inputs (the SeqChunks and the hidden-state flag: a few hundred bytes, from which
each rank builds its own attention metadata) and after each KV move the move; worker ranks
replay both on their own shard and KV cache (`follow`), so every rank runs the same
collectives in the same order.
"""
from __future__ import annotations

import logging

from tandem.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_token
from tandem.engine.tp import Control
from tandem.engine.tp_llama import TPLlamaModel

log = logging.getLogger(__name__)


class TPLeaderRunner(ModelRunner):
    """Rank 0's runner; the workers' runners are built from the "setup" message it sends."""

    def __init__(self, model: TPLlamaModel, control: Control, num_blocks: int,
                 block_size: int = 16, keep_features: bool = False,
                 feature_layers: tuple[int, ...] = ()):
        # feature_layers: rank 0's own (every rank holds the same residual stream; the
        # workers keep no features)
        super().__init__(model, num_blocks, block_size, keep_features, feature_layers)
        self.control = control
        with control.lock:
            control.send(("setup", num_blocks, block_size))

    @classmethod
    def with_memory(cls, model: TPLlamaModel, kv_cache_bytes: int, block_size: int = 16,
                    keep_features: bool = False, control: Control | None = None,
                    feature_layers: tuple[int, ...] = ()):
        """Size the cache from each rank's KV budget in bytes (its own heads' KV)."""
        if control is None:
            raise ValueError("a tensor-parallel leader runner needs its Control")
        num_blocks = kv_cache_bytes // (kv_bytes_per_token(model) * block_size)
        if num_blocks < 1:
            raise ValueError(f"kv cache budget {kv_cache_bytes} B is smaller than one block")
        return cls(model, control, int(num_blocks), block_size, keep_features, feature_layers)

    def forward(self, chunks: list[SeqChunk], with_hidden: bool = False):
        with self.control.lock:  # the heartbeat never lands between a step's messages
            self._sent = False
            try:
                return super().forward(chunks, with_hidden)
            except BaseException as e:
                if self._sent:  # the workers are inside this step: the group is out of step
                    self.control.fail(e)
                raise

    def _before_model(self, chunks: list[SeqChunk], with_hidden: bool) -> None:
        self.control.send(("forward", chunks, with_hidden))
        self._sent = True

    def move_kv(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        with self.control.lock:
            super().move_kv(block_table, src, dst)  # checks first: a bad move is never sent
            self.control.send(("move_kv", block_table, src, dst))


def follow(model: TPLlamaModel, control: Control) -> int:
    """A worker rank: build the KV cache rank 0 describes, then replay its steps until told
    to stop. Returns the number of forwards run."""
    runner, forwards = None, 0
    while True:
        message = control.recv()
        kind = message[0]
        if kind == "setup":
            runner = ModelRunner(model, num_blocks=message[1], block_size=message[2])
        elif kind == "forward":
            runner.forward(message[1], with_hidden=message[2])
            forwards += 1
        elif kind == "move_kv":
            runner.move_kv(*message[1:])
        elif kind == "stop":
            log.info("rank %d: stop after %d forwards", control.group.rank, forwards)
            return forwards
        elif kind != "ping":
            raise RuntimeError(f"unknown tensor-parallel message {kind!r}")
