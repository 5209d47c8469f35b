"""--device / --dtype on the tools: `tandem bench`, `tandem distill` (and `acceptance`),
`tandem search-skip` and the launcher's cluster. The flags parse, a bad one is a usage error, a
GPU the host lacks is a clean error (exit 2, no traceback), the launcher passes them on; and,
where CUDA exists, a tiny training step and the bench baselines run on the GPU and agree with
the CPU (the `cpu` variants of those run everywhere and keep the test code honest)."""
from __future__ import annotations

import argparse
import random

import pytest
import torch
import transformers

from tools.cli import main

pytestmark = pytest.mark.unit

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA GPU")
# The arguments each command needs besides --device to get as far as placing its models.
COMMANDS = {"bench": ["--docs", ""], "distill": ["--out", "unused-draft"],
            "acceptance": [], "search-skip": []}


def _parser() -> argparse.ArgumentParser:
    from tools.cli import build_parser

    return build_parser()


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:1"])
def test_device_flags_parse_on_every_tool(device):
    from tools.bench.cli import config_from_args

    p = _parser()
    cfg = config_from_args(p.parse_args(["bench", "--device", device, "--dtype", "bfloat16"]))
    assert (cfg.device, cfg.dtype) == (device, "bfloat16")
    for cmd, extra in COMMANDS.items():
        args = p.parse_args([cmd, *extra, "--device", device])
        assert args.device == device


def test_defaults_are_auto_and_the_environment_is_read(monkeypatch):
    from tools.bench.cli import config_from_args

    args = _parser().parse_args(["bench"])
    cfg = config_from_args(args)
    assert (cfg.device, cfg.dtype) == ("auto", "auto")
    assert _parser().parse_args(["search-skip"]).device == "auto"
    # distill's dtype is the data generation's, bfloat16 by default as before --device
    d = _parser().parse_args(["distill", "--out", "x"])
    assert (d.device, d.dtype) == ("auto", "bfloat16")
    for prefix, cmd in (("TANDEM_BENCH", "bench"), ("TANDEM_DISTILL", "distill"),
                        ("TANDEM_SEARCH_SKIP", "search-skip"),
                        ("TANDEM_ACCEPTANCE", "acceptance")):
        monkeypatch.setenv(f"{prefix}_DEVICE", "cuda:1")
        monkeypatch.setenv(f"{prefix}_DTYPE", "float16")
        args = _parser().parse_args([cmd, *COMMANDS[cmd]])
        assert (args.device, args.dtype) == ("cuda:1", "float16")


def test_gen_dtype_still_works_as_the_data_dtype():
    p = _parser()
    assert p.parse_args(["distill", "--out", "x", "--gen-dtype", "float32"]).dtype == "float32"
    assert p.parse_args(["distill", "--out", "x", "--gen-dtype", "auto"]).dtype == "auto"
    assert p.parse_args(["distill", "--out", "x", "--dtype", "float16"]).dtype == "float16"


def test_gen_dtype_int8_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["distill", "--out", "x", "--gen-dtype", "int8"])
    assert exc.value.code == 2 and "--gen-dtype" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", list(COMMANDS))
@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:0"])
def test_bad_device_is_a_usage_error(cmd, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main([cmd, *COMMANDS[cmd], "--device", bad])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "device must be auto, cpu, cuda or cuda:N" in err and "Traceback" not in err


@pytest.mark.parametrize("cmd", ["bench", "distill", "search-skip"])
def test_bad_dtype_is_a_usage_error(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        main([cmd, *COMMANDS[cmd], "--dtype", "fp8"])
    assert exc.value.code == 2 and "dtype must be one of" in capsys.readouterr().err


def _run_without_gpu(cmd: str, device: str, tmp_path, capsys) -> str:
    extra = {"bench": ["--docs", "", "--out", str(tmp_path / "bench")],
             "distill": ["--out", str(tmp_path / "draft"), "--target", str(tmp_path / "none")],
             "acceptance": ["--draft", str(tmp_path / "none")],
             "search-skip": ["--model", str(tmp_path / "none")]}[cmd]
    assert main([cmd, *extra, "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: error: device ") and "Traceback" not in err
    assert not (tmp_path / "bench").exists() and not (tmp_path / "draft").exists()
    return err


@NO_CUDA
@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_cuda_on_a_cpu_only_host_is_a_clean_error(cmd, tmp_path, capsys):
    err = _run_without_gpu(cmd, "cuda", tmp_path, capsys)
    assert "torch sees no CUDA GPU here" in err and "--device cpu" in err


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_a_gpu_index_the_host_lacks_is_a_clean_error(cmd, tmp_path, capsys):
    _run_without_gpu(cmd, "cuda:99", tmp_path, capsys)


def test_bench_main_reports_a_missing_gpu_without_a_traceback(tmp_path, capsys):
    from tools.bench.cli import main as bench_main

    assert bench_main(["--docs", "", "--out", str(tmp_path / "b"), "--device", "cuda:99"]) == 2
    assert capsys.readouterr().err.startswith("tandem: error: device 'cuda:99'")


def test_configs_check_their_device():
    from tools.bench.config import BenchConfig, quick_config
    from tools.cluster_config import ClusterConfig
    from tools.distill.config import DataConfig
    from tools.distill.data import placed

    assert quick_config(device="cuda:1").device == "cuda:1"
    for bad in (dict(device="tpu"), dict(dtype="fp8")):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
        with pytest.raises(ValueError):
            ClusterConfig(**bad)
    with pytest.raises(ValueError, match="dtype"):
        DataConfig(dtype="int8")  # the int8 kernel is for serving, not for recording data
    assert DataConfig(dtype="float16").dtype == "float16"
    at, cfg = placed(DataConfig(dtype="auto"), "cpu")
    assert (str(at.device), at.dtype, cfg.dtype, at.block_size) == ("cpu", "float32",
                                                                   "float32", 16)
    same = DataConfig()  # bfloat16 stays bfloat16 on the cpu, as before --device
    assert placed(same, "cpu")[1] is same


def _spawned(config, monkeypatch) -> dict[str, list[str]]:
    """The command lines Cluster.start would run, without running them."""
    from tools.launcher import Cluster

    cluster = Cluster(config, log=lambda m: None)
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(cluster, "_spawn", lambda name, args: spawned.setdefault(name, args))
    monkeypatch.setattr(cluster, "_wait", lambda name, proc, check: None)
    cluster.start()
    return spawned


def test_launcher_passes_device_and_dtype_to_verifiers_and_drafts(monkeypatch):
    from tools.cluster_config import ClusterConfig

    cfg = ClusterConfig(num_drafts=2, num_verifiers=1, redis_url="redis://127.0.0.1:1",
                        gateway_port=1, device="cuda:1", dtype="bfloat16")
    spawned = _spawned(cfg, monkeypatch)
    assert sorted(spawned) == ["draft-0", "draft-1", "gateway", "verifier-0"]
    for name in ("draft-0", "draft-1", "verifier-0"):
        args = spawned[name]
        assert args[args.index("--device") + 1] == "cuda:1"
        assert args[args.index("--dtype") + 1] == "bfloat16"
    assert "--device" not in spawned["gateway"] and "--dtype" not in spawned["gateway"]


def test_launcher_leaves_auto_to_each_process(monkeypatch):
    """auto passes nothing: the workers' own TANDEM_*_DEVICE / _DTYPE, else their auto."""
    from tools.cluster_config import ClusterConfig

    spawned = _spawned(ClusterConfig(redis_url="redis://127.0.0.1:1", gateway_port=1,
                                     dtype="int8"), monkeypatch)
    for name in ("draft-0", "verifier-0"):
        assert "--device" not in spawned[name]
        assert spawned[name][spawned[name].index("--dtype") + 1] == "int8"


def test_report_machine_line_records_the_device():
    from tools.bench.report import machine_md

    old = {"cpu": "x", "cores": 2, "gpu": "none", "torch": "t"}  # results from before --device
    assert machine_md(old) == "x, 2 cores, no GPU"
    assert machine_md({**old, "device": "cpu", "dtype": "float32"}) == \
        "x, 2 cores, no GPU, models on cpu (float32)"
    assert machine_md({**old, "gpu": "NVIDIA H100", "device": "cuda:0", "dtype": "bfloat16"}) \
        == "x, 2 cores, GPU NVIDIA H100, models on cuda:0 (bfloat16)"


def test_machine_says_where_the_models_ran():
    from tandem.device import place
    from tools.bench.host import machine

    m = machine(place("cpu", "float32"))
    assert (m["gpu"], m["device"], m["dtype"]) == ("none", "cpu", "float32")


def test_to_cpu_keeps_state_dict_versions_and_cpu_tensors():
    from tools.distill.train import to_cpu

    module = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(module.parameters())
    module(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = module.state_dict()
    moved = to_cpu(state)
    assert moved._metadata == state._metadata and moved["weight"] is state["weight"]
    assert to_cpu(opt.state_dict())["state"][0]["exp_avg"] is opt.state_dict()["state"][0][
        "exp_avg"]


# --- the same work on the CPU and, where there is one, a GPU --------------------------------

V = 61


def _tiny_llama(root, peaky: bool = True):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    if peaky:  # clear argmaxes, so greedy text is the same on any device
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(40)
    model.save_pretrained(root)
    return root


def _examples(n: int = 6, seed: int = 0):
    from tools.distill.data import Example

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, V, (10 + i,), generator=g)
        gen = len(ids) - 4
        topk = torch.stack([ids[4:], (ids[4:] + 1) % V], 1)
        logp = torch.log(torch.tensor([0.8, 0.2])).expand(gen, 2).clone()
        out.append(Example(ids, 4, topk, logp, False))
    return out


def _draft(device):
    from tandem.engine.draft_vocab import DraftVocab
    from tools.distill.config import DraftArch
    from tools.distill.train import make_draft

    arch = DraftArch(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, vocab=0)
    vocab = DraftVocab(tuple(range(V)), V, 0)
    target = {"max_position_embeddings": 128, "rms_norm_eps": 1e-5}
    return make_draft(arch, target, vocab, None, seed=3).to(device), vocab


@pytest.mark.parametrize("device", DEVICES)
def test_draft_training_step_on_device_matches_cpu(device, tmp_path):
    """A distillation step: same start, same loss and update on the device as on the CPU;
    the checkpoint is CPU tensors and resumes onto the device."""
    from tools.distill.train import (
        apply_state,
        batch_loss,
        make_batches,
        read_state,
        save_state,
    )

    def step(dev):
        model, vocab = _draft(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = make_batches(_examples(), vocab, 256, random.Random(0))[0]
        loss, stats = batch_loss(model, batch, 0.1, bf16=False)
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        opt.step()
        return model, opt, vocab, loss.item(), stats, grads

    _, _, _, ref_loss, ref_stats, ref_grads = step("cpu")
    model, opt, vocab, loss, stats, grads = step(device)
    assert next(model.parameters()).device.type == device
    assert loss == pytest.approx(ref_loss, rel=1e-4)
    assert stats["top1"] == pytest.approx(ref_stats["top1"])
    for name, grad in grads.items():  # (Adam's first step is sign(grad): compare grads)
        torch.testing.assert_close(grad, ref_grads[name], atol=1e-5, rtol=1e-3, msg=name)
    path = tmp_path / "state.pt"
    save_state(path, model, opt, vocab, 1, 0.5, 10)
    raw = torch.load(path, weights_only=True)  # no map_location: it must be CPU already
    tensors = [*raw["model"].values(), *(t for s in raw["opt"]["state"].values()
                                         for t in s.values() if isinstance(t, torch.Tensor))]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    fresh, _ = _draft(device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert apply_state(read_state(path), fresh, fresh_opt) == (1, 0.5, 10)
    exp_avg = next(iter(fresh_opt.state_dict()["state"].values()))["exp_avg"]
    assert exp_avg.device.type == device  # the optimizer's state went back to the device
    # bf16 autocast follows the model's device
    batch = make_batches(_examples(), vocab, 256, random.Random(0))[0]
    assert torch.isfinite(batch_loss(fresh, batch, 0.1, bf16=True)[0])


def _feature_seqs(h: int, n: int = 6):
    from tools.distill.eagle import FeatureSeq

    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, 300, (12 + i,), generator=g)
        gen = len(ids) - 4
        feats = torch.randn(len(ids) - 1, h, generator=g).half()
        topk = torch.stack([ids[4:], (ids[4:] + 3) % 300], 1)
        logp = torch.log(torch.tensor([0.7, 0.3])).expand(gen, 2).half()
        out.append(FeatureSeq(ids, feats, 4, topk, logp))
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_eagle_head_trains_on_device_and_exports_cpu_tensors(device, tmp_path):
    from safetensors.torch import load_file

    from tandem.engine.checkpoint import LlamaConfig
    from tandem.engine.draft_vocab import DraftVocab
    from tandem.engine.eagle import EagleHead
    from tandem.models import ModelPaths
    from tools.distill.config import EagleTrainConfig
    from tools.distill.eagle import _collate, _to, step_losses, train
    from tools.distill.eagle_head import EagleTrainHead

    hf = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
          "tie_word_embeddings": True}
    cfg = LlamaConfig.from_hf(hf)

    def head_on(dev):
        torch.manual_seed(0)
        vocab = DraftVocab(tuple(range(0, 300, 2)), 300, 0)
        return EagleTrainHead(cfg, vocab, torch.randn(150, 32) * 0.5, 64).to(dev)

    seqs = _feature_seqs(32)
    losses = {}
    for dev in ("cpu", device):
        head = head_on(dev)
        batch = _collate(seqs[:3], head.vocab, head.input_map.cpu())
        out = step_losses(head, _to(batch, dev), 0.5)
        losses[dev] = {k: v.item() for k, v in out.items()}
    for key, value in losses["cpu"].items():
        assert losses[device][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    head = head_on(device)
    tc = EagleTrainConfig(vocab=150, time_budget_min=0, epochs=2, batch_tokens=64, warmup=1,
                          val_fraction=0.2)
    stats = train(head, seqs[1:], seqs[:1], tc, tmp_path / "eagle.pt", False, log=lambda m: 0)
    assert stats["steps"] >= 2 and 0 <= stats["top1_step1"] <= 1
    raw = torch.load(tmp_path / "eagle.pt", weights_only=False)
    assert all(t.device.type == "cpu" for t in raw["model"].values())
    resumed = head_on(device)
    tc2 = EagleTrainConfig(**{**tc.__dict__, "epochs": 3})
    assert train(resumed, seqs[1:], seqs[:1], tc2, tmp_path / "eagle.pt", True,
                 log=lambda m: 0)["steps"] > stats["steps"]
    head.export(tmp_path / "head", hf, {"format": "tandem-eagle/1"})
    exported = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert all(t.device.type == "cpu" for t in exported.values())
    assert EagleHead.load(ModelPaths(tmp_path / "head")).model.device.type == "cpu"


@pytest.mark.parametrize("device", DEVICES)
def test_medusa_heads_train_on_device_like_on_cpu(device, tmp_path):
    from tandem.engine.medusa import MedusaConfig, MedusaHeads
    from tools.distill.config import MedusaTrainConfig
    from tools.distill.medusa import evaluate, flatten, train

    h = 16
    seqs = _feature_seqs(h)
    data = flatten(seqs, 2, 2, torch.arange(300), torch.ones(300, dtype=torch.bool))
    tc = MedusaTrainConfig(num_heads=2, vocab=300, epochs=3, batch_positions=16, lr=1e-2,
                           warmup=2, time_budget_min=0)
    result = {}
    for dev in ("cpu", device):
        torch.manual_seed(0)
        heads = MedusaHeads(MedusaConfig(2, 1, h, tuple(range(300)), ((0,),)),
                            torch.randn(300, h)).to(dev)
        stats = train(heads, data, data, tc, tmp_path / f"{dev}.pt", False, log=lambda m: 0)
        result[dev] = (stats, evaluate(heads, data))
        raw = torch.load(tmp_path / f"{dev}.pt", weights_only=False)
        assert all(t.device.type == "cpu" for t in raw["model"].values())
    (cpu_stats, cpu_eval), (stats, ev) = result["cpu"], result[device]
    assert stats["steps"] == cpu_stats["steps"]
    assert stats["ce"] == pytest.approx(cpu_stats["ce"], rel=1e-2)
    assert ev["ce"] == pytest.approx(cpu_eval["ce"], rel=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_data_generation_on_device_matches_cpu(device, tmp_path):
    """The recorded shard (greedy text, teacher top-K, features) is the same on the device,
    and it is written from CPU tensors."""
    from safetensors.torch import load_file

    from tandem.models import resolve_model
    from tandem.sampling_params import SamplingParams
    from tools.distill.data import (
        DataConfig,
        _RecordingGenerator,
        generate_shard,
        placed,
        target_runner,
    )

    paths = resolve_model(_tiny_llama(tmp_path / "target"))
    shards = {}
    for dev in ("cpu", device):
        at, cfg = placed(DataConfig(dtype="float32", max_new_tokens=6, kv_cache_mb=4,
                                    top_k=4, features=True), dev)
        gen = _RecordingGenerator(target_runner(paths, cfg, at), cfg.top_k, features=True)
        path = tmp_path / f"{dev}.safetensors"
        generate_shard(gen, [[1, 5, 9, 4], [1, 7]], SamplingParams(temperature=0.0), cfg,
                       (), path)
        shards[dev] = load_file(str(path))
    ref, got = shards["cpu"], shards[device]
    assert got["gen_ids"].tolist() == ref["gen_ids"].tolist()
    assert got["topk_ids"][:, 0].tolist() == ref["topk_ids"][:, 0].tolist()
    torch.testing.assert_close(got["topk_logprobs"].float(), ref["topk_logprobs"].float(),
                               atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got["features"].float(), ref["features"].float(),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_bench_baselines_on_device(device, tmp_path):
    """The transformers peers (plain and assisted) and the cost timing run on the device; the
    peers produce the requested tokens as on the CPU."""
    from tandem.device import place
    from tools.bench.baselines import load_assistant, load_target, measure_c, run_peer

    root = _tiny_llama(tmp_path / "tiny")
    at = place(device, "float32")
    model = load_target(root, at)
    assistant = load_assistant(root, V, at)
    assert model.device.type == device and assistant.device.type == device
    ids = [1, 5, 9, 4, 7]
    for method in ("plain", "assisted", "prompt_lookup"):
        out = run_peer(model, assistant, ids, method, 6, 0.0, 3)
        assert out["tokens"] == 6 and out["ttft_s"] > 0 and out["e2e_s"] >= out["ttft_s"]
    with torch.no_grad():
        want = load_target(root).generate(torch.tensor([ids]), max_new_tokens=6,
                                          do_sample=False)
        got = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=6,
                             do_sample=False)
    assert got.cpu().tolist() == want.tolist()
    cost = measure_c(str(root), str(root), reps=3, at=at)  # our runner, timed on the device
    assert cost["draft_ms"] > 0 and cost["target_ms"] > 0 and cost["c"] > 0
