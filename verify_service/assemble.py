"""The verify path over a loaded target: KV cache, Medusa heads, executor, cost curves,
scheduler and the engine, as a verifier worker (main.py) starts it."""
from __future__ import annotations

import functools
import logging

import torch

from tandem.engine.block_manager import BlockManager
from tandem.engine.cuda_graphs import graph_decoder
from tandem.engine.forward_threads import ForwardThreads
from tandem.engine.llama import LlamaModel
from tandem.engine.medusa import load_for
from tandem.engine.model_runner import ModelRunner
from tandem.models import ModelPaths
from tandem.proposers.ngram import NgramProposer
from tandem.proposers.suffix import SuffixConfig
from tandem.spec import Method
from tandem.spec.cost import CostModel, StepCost
from tandem.telemetry import VerifierMetrics
from verify_service.config import SchedulerConfig, VerifierConfig
from verify_service.drafts.history import HistoryDrafts
from verify_service.engine import Engine, EngineConfig
from verify_service.forward.executor import Executor
from verify_service.forward.features import feature_layers
from verify_service.policy.calibration import timed_curve
from verify_service.policy.scheduler import Scheduler
from verify_service.tp.group import TPLeader

log = logging.getLogger(__name__)


async def build_engine(config: VerifierConfig, model: LlamaModel, paths: ModelPaths,
                        tp: TPLeader | None = None) -> tuple[Engine, VerifierMetrics]:
    """The verify path over the target: its KV cache, Medusa heads if configured, the
    executor, the cost curves (timed now unless calibrate_reps is 0), scheduler, engine."""
    medusa = load_for(model, paths, config.medusa)
    runner = (tp.make_runner if tp else functools.partial(ModelRunner.with_memory, model))(
        config.kv_cache_mb << 20, config.block_size, keep_features=True,
        feature_layers=feature_layers(config.eagle_feature_layers, model, medusa))
    if tp is None:
        _use_threads(runner, config.narrow_threads, config.wide_rows)
    sched_cfg = SchedulerConfig(max_num_seqs=config.max_num_seqs, features_cached=True,
                                prefill_chunk_tokens=config.prefill_chunk_tokens,
                                max_spec_tokens=config.max_spec_tokens,
                                max_model_len=config.context_len(model.cfg.max_position_embeddings),
                                kv_window=model.cfg.kv_window)
    if medusa is not None:
        log.info("medusa: %d heads, a tree of %d nodes", medusa.cfg.num_heads,
                 len(medusa.cfg.choices))
    # a graph replays rank 0's forward alone, without its workers' steps: never under TP
    graphs = None if tp else graph_decoder(config.cuda_graphs, runner, config.gpu_check_result)
    executor = Executor(runner, medusa, graphs)
    calibrated, solo = await timed_curve(runner, config.max_spec_tokens,
                                         config.calibrate_reps)
    # with graphs, the cache's last block is theirs (padding rows write there)
    blocks = BlockManager(runner.num_blocks - (graphs is not None), runner.block_size,
                          prefix_caching=config.enable_prefix_caching)
    scheduler = Scheduler(blocks, sched_cfg,
                          CostModel({q: ms for q, ms in calibrated.items() if q in solo}),
                          tree_reach=medusa.cfg.reach if medusa is not None else (),
                          chain_reach=medusa.cfg.chain_reach if medusa is not None else (),
                          step_cost=StepCost(dict(calibrated) if config.batch_plan else {}))
    eng_cfg = EngineConfig(max_sessions=config.max_sessions,
                           max_draft_wait_ms=config.max_draft_wait_ms, top_n=config.top_n,
                           forced_drafts=config.forced_drafts)
    # vLLM's spec-decode series carry the served model's name, as the gateway reports it
    metrics = VerifierMetrics(model_name=config.metrics_model_name(),
                              num_positions=config.max_spec_tokens)
    metrics.bind_load(running=lambda: len(scheduler.running),
                      waiting=lambda: len(scheduler.waiting),
                      kv_usage=lambda: scheduler.blocks.usage)
    return Engine(executor, scheduler, eng_cfg, model.cfg.vocab_size, metrics,
                  _history(config)), metrics


def _use_threads(runner: ModelRunner, narrow: int, wide_rows: int) -> None:
    """Forwards of fewer than wide_rows rows on `narrow` threads, the rest on all this
    process has."""
    wide = torch.get_num_threads()
    if narrow and narrow != wide and runner.use_threads(ForwardThreads(wide, narrow,
                                                                       wide_rows)):
        log.info("forwards of under %d rows on %d thread(s), of more on %d", wide_rows,
                 narrow, wide)


def _history(config: VerifierConfig) -> HistoryDrafts | None:
    """The verifier's own ngram and suffix proposers, unless draft workers make those."""
    if config.history_drafts != "verifier":
        return None
    history = HistoryDrafts(config.max_spec_tokens or 1, SuffixConfig(
        per_tenant=True, cache_tokens=config.suffix_cache_tokens))
    history.proposers[Method.NGRAM] = NgramProposer(  # vLLM's prompt_lookup_max / _min
        config.max_ngram_size, config.max_spec_tokens or 1, config.min_ngram_size)
    return history
