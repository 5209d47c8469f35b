"""Tensor parallelism on tiny random checkpoints: TP=2 over gloo (this process is rank 0, one
spawned worker rank 1) against TP=1, every forward the verifier runs. fp32 throughout; the
tolerance 2e-5 covers the all-reduce's different summation order (measured max ~1e-6)."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp
import transformers

from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.llama import LlamaModel
from tandem.engine.model_runner import ModelRunner, SeqChunk, kv_bytes_per_token
from tandem.engine.tp import (
    TPGroup,
    check_shardable,
    load_shard,
    local_config,
    shard_weights,
)
from tandem.models import ModelError, resolve_model
from verify_service.tp.group import start_leader

pytestmark = pytest.mark.unit

ATOL = 2e-5
# vocab 97: the second vocabulary shard is padded; 4 heads over 2 KV heads; every shard's
# input width a multiple of int8's 32-wide groups, so int8 shards quantize as the whole does
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
BLOCKS, BLOCK = 24, 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A Qwen2-style checkpoint: q/k/v biases and an untied head exercise every split."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(**TINY, tie_word_embeddings=False)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def test_shards_reassemble(tiny):
    from tandem.engine.checkpoint import load_tensors

    weights = load_tensors(resolve_model(tiny))
    shards = [shard_weights(weights, TPGroup(r, 2)) for r in range(2)]
    q = "layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.cat([s[q] for s in shards]), weights[q])
    o = "layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([s[o] for s in shards], 1), weights[o])
    embed = torch.cat([s["embed_tokens.weight"] for s in shards])
    assert embed.shape[0] == 98 and torch.equal(embed[:97], weights["embed_tokens.weight"])
    assert not embed[97].any()  # padding row
    for rank, shard in enumerate(shards):  # read from disk slice by slice: the same tensors
        read = load_shard(resolve_model(tiny), TPGroup(rank, 2))
        assert read.keys() == shard.keys()
        assert all(torch.equal(read[n], shard[n]) for n in shard)


def test_refuses_a_split_of_kv_head_groups(tiny):
    cfg = LlamaConfig.from_hf(transformers.Qwen2Config(**TINY).to_dict())
    with pytest.raises(ModelError, match="does not divide the model's 2 KV heads"):
        check_shardable(cfg, 3)
    with pytest.raises(ModelError, match="KV heads"):
        start_leader(str(tiny), 3, "float32")  # refused before any process starts
    local = local_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.vocab_size) == (2, 1, 97)


def test_flag_env_and_config(monkeypatch):
    from tools.cli import build_parser
    from verify_service.config import VerifierConfig

    monkeypatch.setenv("TANDEM_VERIFIER_TENSOR_PARALLEL_SIZE", "4")
    args = build_parser().parse_args(["verifier"])
    assert (args.tensor_parallel_size, args.tensor_parallel_timeout_s) == (4, 60.0)
    args = build_parser().parse_args(["verifier", "--tensor-parallel-size", "2"])
    assert args.tensor_parallel_size == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        VerifierConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--cuda-graphs on is not available"):
        VerifierConfig(tensor_parallel_size=2, cuda_graphs="on")


def test_tp_worker_flags_give_one_spec_per_local_rank(monkeypatch):
    from tools.cli import build_parser
    from verify_service.tp.cli import specs_from

    monkeypatch.setenv("TANDEM_TP_WORKER_MASTER", "leader.example:29500")
    args = build_parser().parse_args(["tp-worker", "--tensor-parallel-size", "8",
                                      "--first-rank", "4", "--local-ranks", "4",
                                      "--device", "cpu"])
    specs = specs_from(args)
    assert [(s.rank, s.local_rank, s.world_size) for s in specs] == [
        (4, 0, 8), (5, 1, 8), (6, 2, 8), (7, 3, 8)]
    assert {s.init_method for s in specs} == {"tcp://leader.example:29500"}
    assert specs[0].dtype == "float32"  # auto on the cpu, as rank 0 resolves it
    monkeypatch.delenv("TANDEM_TP_WORKER_MASTER")
    with pytest.raises(SystemExit, match="--master"):
        specs_from(build_parser().parse_args(["tp-worker"]))


def test_tp_worker_takes_its_ranks_from_the_node_index(monkeypatch):
    """Under a LeaderWorkerSet a worker pod knows its index (LWS_WORKER_INDEX), not its rank:
    `--node-index` makes the first rank index * local ranks."""
    from tools.cli import build_parser
    from verify_service.tp.cli import specs_from

    def ranks(*flags: str) -> list[int]:
        args = build_parser().parse_args(["tp-worker", "--master", "leader:29500",
                                          "--device", "cpu", *flags])
        return [s.rank for s in specs_from(args)]

    assert ranks("--tensor-parallel-size", "12", "--local-ranks", "4",
                 "--node-index", "2") == [8, 9, 10, 11]
    monkeypatch.setenv("TANDEM_TP_WORKER_NODE_INDEX", "1")
    assert ranks("--tensor-parallel-size", "8", "--local-ranks", "4") == [4, 5, 6, 7]
    monkeypatch.delenv("TANDEM_TP_WORKER_NODE_INDEX")
    for bad in (["--node-index", "0"], ["--node-index", "2"], ["--first-rank", "0"]):
        with pytest.raises(SystemExit):
            ranks("--tensor-parallel-size", "8", "--local-ranks", "4", *bad)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Chunked prefill of two sequences, a batched verify chain, a token tree, a tree path's
    KV move and decodes: every output (logits and hidden states) in order."""
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = list(range(7, -1, -1)), list(range(15, 7, -1))  # scattered blocks
    out = []
    out.append(runner.forward([SeqChunk(ids[:13], 0, a, num_logits=13)]))
    logits, hidden = runner.forward([SeqChunk(ids[13:20], 13, a, num_logits=3),
                                     SeqChunk(ids[20:31], 0, b, num_logits=11)], with_hidden=True)
    out += [logits, hidden]
    out.append(runner.forward([SeqChunk(ids[31:36], 20, a, num_logits=5),
                               SeqChunk([ids[36]], 11, b)]))
    tree = SeqChunk(ids[:5], 25, a, num_logits=5, parents=(-1, 0, 0, 1, 2))
    out.append(runner.forward([tree]))
    runner.move_kv(a, [25, 27], [25, 26])  # keep the path 0 -> 2
    out.append(runner.forward([SeqChunk([ids[7]], 27, a), SeqChunk([ids[8]], 12, b)]))
    out.append(runner.features_at(a, 0, 27).float())
    return out


@pytest.mark.parametrize("dtype", ["float32", "int8"])  # int8: each rank quantizes its shard
def test_tp2_matches_tp1_every_forward(tiny, dtype):
    torch.set_num_threads(1)
    ref_model = LlamaModel.load(resolve_model(tiny), dtype)
    expected = _steps(ModelRunner(ref_model, BLOCKS, BLOCK, keep_features=True))
    leader = start_leader(str(tiny), 2, dtype, threads=1, timeout_s=30)
    try:
        budget = BLOCKS * BLOCK * kv_bytes_per_token(leader.model)
        got = _steps(leader.make_runner(budget, BLOCK, keep_features=True))
    finally:
        leader.close()
    assert [p.exitcode for p in leader.procs] == [0]
    assert leader.model.cfg.num_kv_heads == 1  # rank 0 holds half the KV cache
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape
        # The kept features are stored in fp16: values within ATOL before rounding can land
        # one fp16 step (2^-10 relative) apart after it (seen with int8 on some hosts).
        rtol = 2 ** -10 if i == len(got) - 1 else 0
        torch.testing.assert_close(g, e, atol=ATOL, rtol=rtol)
    assert torch.equal(got[0].argmax(-1), expected[0].argmax(-1))


def test_a_group_of_one_is_the_plain_model(tiny):
    """World size 1 (the path a one-GPU NCCL check takes, here on gloo): no workers, the
    control channel broadcasting to itself, the same numbers as LlamaModel."""
    expected = _steps(ModelRunner(LlamaModel.load(resolve_model(tiny)), BLOCKS, BLOCK,
                                  keep_features=True))
    leader = start_leader(str(tiny), 1, "float32", threads=1, timeout_s=30)
    try:
        got = _steps(leader.make_runner(BLOCKS * BLOCK * kv_bytes_per_token(leader.model),
                                        BLOCK, keep_features=True))
    finally:
        leader.close()
    assert leader.procs == []
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)


def test_dead_worker_fails_the_next_step(tiny):
    leader = start_leader(str(tiny), 2, "float32", threads=1, timeout_s=10)
    try:
        runner = leader.make_runner(BLOCKS * BLOCK * kv_bytes_per_token(leader.model), BLOCK,
                                    keep_features=False)
        runner.forward([SeqChunk([1, 2, 3], 0, [0])])
        leader.procs[0].kill()
        leader.procs[0].join(10)
        with pytest.raises(Exception):  # noqa: B017 (gloo's error type varies)
            for _ in range(3):  # gloo may take one more step to see the closed socket
                runner.forward([SeqChunk([4], 3, [0])])
    finally:
        leader.close()


def _cuda_case(tiny, world_size: int) -> None:
    ref = LlamaModel.load(resolve_model(tiny), device="cuda:0")
    expected = _steps(ModelRunner(ref, BLOCKS, BLOCK, keep_features=True))
    leader = start_leader(str(tiny), world_size, "float32", device="cuda", timeout_s=60)
    try:
        budget = BLOCKS * BLOCK * kv_bytes_per_token(leader.model)
        got = _steps(leader.make_runner(budget, BLOCK, keep_features=True))
    finally:
        leader.close()
    assert all(p.exitcode == 0 for p in leader.procs)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)  # TF32 matmuls may differ


@pytest.mark.gpu
def test_nccl_group_of_one_on_cuda(tiny):
    """One GPU: the NCCL group, the gloo control group and the leader runner, no workers."""
    _cuda_case(tiny, 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_tp2_matches_tp1(tiny):
    _cuda_case(tiny, 2)


def _leader_then_hang(path: str, pids) -> None:  # a spawned process: rank 0, then stuck
    leader = start_leader(path, 2, "float32", threads=1, timeout_s=5)
    pids.put(leader.procs[0].pid)
    time.sleep(120)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] in "ZX"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_a_dead_leader_takes_its_workers_down(tiny):
    """rank 0 killed (no stop message): the worker's wait fails within the collective
    timeout (or at once on the closed socket) and it exits: no orphan hangs on."""
    ctx = mp.get_context("spawn")
    pids = ctx.Queue()
    leader = ctx.Process(target=_leader_then_hang, args=(str(tiny), pids))  # it spawns
    leader.start()
    worker = pids.get(timeout=60)
    os.kill(leader.pid, signal.SIGKILL)
    leader.join(5)
    deadline = time.monotonic() + 20  # the 5 s timeout plus start-up slack
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(worker)


def test_a_rank_from_another_node_joins_by_tp_worker(tiny, tmp_path):
    """`tandem tp-worker` (a separate process, as on another node) is rank 1 of a group whose
    rank 0 runs with local_ranks=1 and a master address: the same logits as TP=1. Its
    --ready-file (a LeaderWorkerSet worker's readiness probe) appears once it has joined."""
    from tandem.netaddr import free_port

    master = f"127.0.0.1:{free_port()}"
    ready = tmp_path / "ready"
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tools.cli import main; sys.exit(main())",
         "tp-worker", "--model", str(tiny), "--tensor-parallel-size", "2", "--node-index", "1",
         "--master", master, "--threads", "1", "--device", "cpu", "--dtype", "float32",
         "--tensor-parallel-timeout-s", "30", "--ready-file", str(ready)])
    try:
        assert not ready.exists()
        leader = start_leader(str(tiny), 2, "float32", threads=1, timeout_s=30,
                              local_ranks=1, master=master)
        assert leader.procs == []  # nothing spawned here
        try:
            deadline = time.monotonic() + 20
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ready.read_text() == "rank 1\n"
            budget = BLOCKS * BLOCK * kv_bytes_per_token(leader.model)
            got = _steps(leader.make_runner(budget, BLOCK, keep_features=True))
        finally:
            leader.close()
        assert worker.wait(30) == 0
    finally:
        worker.kill()
    expected = _steps(ModelRunner(LlamaModel.load(resolve_model(tiny)), BLOCKS, BLOCK,
                                  keep_features=True))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
