"""LoRA (``model.lora``, peft): only the adapters train and hold optimizer state; the merged
weights are what the servers get (verified by every sync) and what checkpoints export; resume
restores the adapters and their optimizer moments."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_algo_learning import BASE, make_samples
from trident.cluster.net import free_port
from trident.config import load_config

LORA = "model.lora={r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}"  # fmt: skip


def _worker(model: str, *overrides: str, rank: int = 0, world: int = 1, port: int = 0):
    from trident.train.policy import PolicyWorker

    cfg = load_config([], [*BASE, f"model.path={model}", "trainer.lr=1e-2", LORA, *overrides])
    return PolicyWorker(cfg, rank, world, "127.0.0.1", port or free_port())


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from trident.weights.tensors import full_tensor

    return {n: full_tensor(p).clone() for n, p in model.named_parameters()}


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    from trident.weights.tensors import full_tensor

    return sum(
        full_tensor(v).numel() * v.element_size()
        for state in opt.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def test_lora_trains_only_the_adapters_and_the_export_is_the_merged_model(tiny_model, tmp_path):
    """After a ``train_step``: base weights bit-identical, every adapter B moved (A from the
    second step: B starts at 0), the
    optimizer's state is the adapters' alone (two float32 moments each); the HF export loads as
    a plain model whose logprobs are the adapter model's; a resumed worker has the same adapters
    and moments and takes the same next step."""
    from trident.models.load import load_causal_lm
    from trident.weights.sync import make_probe, probe_logprobs

    t0 = time.perf_counter()
    worker = _worker(tiny_model)
    try:
        samples = make_samples(worker.tokenizer, prompts=2, n=3)
        before = _params(worker.model)
        worker.train_step(samples)
        after = _params(worker.model)
        base = [n for n in before if ".lora_" not in n]
        adapters = [n for n in before if ".lora_" in n]
        assert len(adapters) == 2 * 7 * worker.model.config.num_hidden_layers
        for n in base:
            assert torch.equal(before[n], after[n]), n
        for n in adapters:  # B starts at 0, so A's first gradient is 0: it moves from step 2
            assert torch.equal(before[n], after[n]) == (".lora_A." in n), n
        trained = {p for p in worker.model.parameters() if p.requires_grad}
        named = dict(worker.model.named_parameters())
        assert trained == {named[n] for n in adapters}
        assert set(worker.opt.state) == trained
        adapter_elements = sum(after[n].numel() for n in adapters)
        steps = sum(s["step"].numel() * s["step"].element_size() for s in worker.opt.state.values())
        assert _state_bytes(worker.opt) - steps == 2 * 4 * adapter_elements  # exp_avg, exp_avg_sq

        # the export: merged, base names, a plain HF model with the adapter model's logprobs
        probe = make_probe(worker.tokenizer, 32)
        expected = probe_logprobs(worker.model, probe)
        ckpt = tmp_path / "ckpt"
        worker.save_state(str(ckpt))
        plain = load_causal_lm(str(ckpt))
        assert not any("lora" in n or "base_layer" in n for n in plain.state_dict())
        got = probe_logprobs(plain, probe)
        assert max(abs(g - e) for g, e in zip(got, expected, strict=True)) < 1e-5
        worker.train_step(samples)
        next_step = _params(worker.model)
        for n in base:
            assert torch.equal(before[n], next_step[n]), n
        for n in adapters:
            assert not torch.equal(after[n], next_step[n]), n
    finally:
        worker.shutdown()
    # resume: base from model.path, adapters and moments from the checkpoint; the same next step
    resumed = _worker(tiny_model)
    try:
        resumed.load_state(str(ckpt))
        assert all(torch.equal(v, after[n]) for n, v in _params(resumed.model).items())
        resumed.train_step(samples)
        for n, v in _params(resumed.model).items():
            assert torch.allclose(v, next_step[n], atol=1e-6), n
    finally:
        resumed.shutdown()
    print(f"test wall time {time.perf_counter() - t0:.1f} s")


def test_lora_r16_optimizer_state_is_under_5_percent_of_full_fine_tuning():
    """At the qwen2.5-0.5b shape (24 layers, vocabulary 151,936; built on the meta device) with
    r=16 on every projection: AdamW keeps two float32 moments per trained element, so the
    state is 8 bytes times the trained parameters (the tiny model's step shows the same count),
    and LoRA's is under 5% of full fine-tuning's."""
    from transformers import AutoModelForCausalLM

    from trident.config.schema import LoraConfig
    from trident.models.factory import LIKE, hf_config
    from trident.train import lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(LIKE["qwen2.5-0.5b"]))
    full = sum(p.numel() for p in model.parameters())  # tied head counted once
    wrapped = lora.wrap(model, LoraConfig(r=16))
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    lora_bytes, full_bytes = 8 * trained, 8 * full
    print(
        f"optimizer state: LoRA r=16 {lora_bytes / 2**20:.1f} MiB, full {full_bytes / 2**20:.1f} MiB"
    )
    assert full == pytest.approx(494e6, rel=0.01)
    assert lora_bytes < 0.05 * full_bytes


def _two_ranks(rank: int, model: str, port: int, out: str) -> None:
    """One of two FSDP2 ranks of a LoRA policy: two steps, then the merged stream consumed
    the way the shm transport does on rank 0 (buckets with one of lookahead, then a second
    pass, as a GPU backend makes for a second server) and drained on rank 1; rank 0 writes the
    largest difference from the merge of the whole tensors."""
    import json

    from trident.train import lora
    from trident.weights.buckets import full_cpu, iter_buckets, mark_last
    from trident.weights.sync import drain, hf_named_tensors
    from trident.weights.tensors import full_tensor

    torch.set_num_threads(1)
    worker = _worker(model, "model.lora={r: 4, alpha: 32}", rank=rank, world=2, port=port)
    for seed in (0, 1):
        worker.train_step(make_samples(worker.tokenizer, prompts=2, n=2, seed=seed))
    whole = {n: full_tensor(t) for n, t in worker.model.state_dict().items()}  # collective
    weights = lora.MergedWeights(worker.model)  # collective
    passes: list[dict[str, torch.Tensor]] = []
    # whether the head goes out as the embedding, as WeightSender reads it
    tied = bool(lora.base_model(worker.model).config.tie_word_embeddings)
    for _ in range(2):
        stream = hf_named_tensors(weights, tied)
        if rank == 0:
            buckets = mark_last(iter_buckets(stream, 4096))
            passes.append({n: full_cpu(t) for bucket, _ in buckets for n, t in bucket})
        else:
            drain(stream)
    passes.append(lora.merged_state_dict(worker.model))  # collective: the HF export's
    adapters = lora.adapter_tensors(worker.model)  # the adapter sync's stream, gathered as sent
    sent = {n: full_tensor(t) for n, t in adapters} if rank == 0 else {}
    drain(adapters)  # rank 1's share of the gathers (rank 0's stream is spent)
    worker.shutdown()
    if rank == 0:
        expected = {}
        for name, t in whole.items():
            layer, _, leaf = name.rpartition(".base_layer.")
            if ".lora_" in name:
                continue
            if layer and leaf == "weight":
                a, b = (
                    whole[f"{layer}.lora_A.default.weight"],
                    whole[f"{layer}.lora_B.default.weight"],
                )
                t = t + b @ a * (32 / 4)
            expected[lora.base_name(name)] = t
        worst = max((p[n] - t).abs().max().item() for p in passes for n, t in expected.items())
        largest_b = max(t.abs().max().item() for n, t in whole.items() if ".lora_B." in n)
        names = [sorted(p) == sorted(expected) for p in passes[:2]]
        lora_whole = {n.replace(".default.", "."): t for n, t in whole.items() if ".lora_" in n}
        assert sorted(sent) == sorted(lora_whole)
        adapter_worst = max((sent[n] - t).abs().max().item() for n, t in lora_whole.items())
        result = {"worst": worst, "largest_b": largest_b, "names": names, "adapter": adapter_worst}
        Path(out).write_text(json.dumps(result))


def test_the_merged_stream_on_two_fsdp_ranks_is_the_merge_of_the_whole_tensors(
    tiny_model, tmp_path
):
    """FSDP2 shards W and B alike: each rank merges its own rows, the stream runs no collective
    of its own, and two ranks consuming it as the transports do (rank 0 with lookahead, twice)
    stay in step and send exactly W + B @ A * alpha / r; the adapter sync's stream, gathered on
    rank 0 and drained on rank 1, is exactly the whole A and B under peft's saved names."""
    import json

    from torch.multiprocessing.spawn import start_processes

    out = tmp_path / "result.json"
    start_processes(
        _two_ranks, args=(tiny_model, free_port(), str(out)), nprocs=2, start_method="spawn"
    )
    result = json.loads(out.read_text())
    print(result)
    assert result["names"] == [True, True]
    assert result["largest_b"] > 1e-3  # the adapters moved: the merge is not W alone
    assert result["worst"] == 0.0
    assert result["adapter"] == 0.0


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_a_lora_runs_syncs_verify(tiny_model, tmp_path, sync):
    """``trident train`` with ``model.lora`` against real vLLM servers: every sync sends the
    adapters alone, which the server (``--enable-lora``) loads in place and the rollout's
    requests name, or the merged weights under the base names; either way the server reproduces
    the adapter model's probe logprobs (``sync.verify``): a merge that is wrong, a missing
    scale, an adapter not loaded or not asked for would fail here. The adapter sync sends the
    adapters' bytes, a fraction of the model's."""
    from trident.pipeline.run import run_train
    from trident.telemetry.metrics import read_metrics

    cfg = load_config(
        [],
        [f"model.path={tiny_model}", f"run.dir={tmp_path}", "run.name=lora", LORA,
         f"model.lora.sync={sync}",
         "pipeline.steps=2", "pipeline.prompts_per_step=2", "rollout.n=4", "rollout.max_tokens=16",
         "trainer.lr=1e-2", "trainer.cpu_threads=1", "eval.before_after=false",
         "telemetry.progress=false", "telemetry.tensorboard=false",
         "reward.fns=[{name: 'tests.test_lora:distinct_characters'}]"],
    )  # fmt: skip
    results = run_train(cfg)
    metrics = read_metrics(cfg.derived.run_dir)
    print([(m["version"], m["sync/max_abs_dlogp"], m["sync/bytes"]) for m in metrics])
    assert [m["version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["sync/max_abs_dlogp"] <= cfg.sync.tolerance
        assert m["grad_norm"] > 0
    # the rollout sampled with the adapted policy: at step 1 the engine's logprobs of its own
    # samples are the trainer's (the base alone is 0.69 away on the probe, below)
    assert metrics[1]["mismatch_abs_logp_diff_max"] <= cfg.sync.tolerance
    model_bytes = sum(
        t.numel() * 4 for t in load_file(Path(tiny_model) / "model.safetensors").values()
    )
    if sync == "adapter":  # r=16 on every projection of the 4 layers: 0.63 MB of 3.6 MB
        assert all(m["sync/bytes"] < model_bytes / 4 for m in metrics)
        assert not (Path(cfg.derived.run_dir) / "lora_adapter").exists()  # removed at the end
    else:
        assert all(m["sync/bytes"] >= model_bytes for m in metrics)
    # the servers verified weights the adapters moved: the exported merge is not the base
    name = "model.layers.0.self_attn.q_proj.weight"
    base = load_file(Path(tiny_model) / "model.safetensors")[name]
    final = load_file(Path(results["final_checkpoint"]) / "model.safetensors")
    assert not any("lora" in n for n in final)
    assert (final[name] - base).abs().max() > 1e-4
    # ...by more than the check allows: serving the base (the adapters dropped) fails verify
    from trident.models.load import load_causal_lm, load_tokenizer
    from trident.weights.sync import make_probe, probe_logprobs

    probe = make_probe(load_tokenizer(tiny_model), cfg.sync.probe_tokens, seed=cfg.run.seed)
    trained = probe_logprobs(load_causal_lm(results["final_checkpoint"]), probe)
    untrained = probe_logprobs(load_causal_lm(tiny_model), probe)
    moved = max(abs(a - b) for a, b in zip(trained, untrained, strict=True))
    print(f"probe max |dlogp| trained vs base: {moved:.3g}")
    assert moved > 100 * cfg.sync.tolerance


def distinct_characters(response: str, **_: object) -> float:
    """A reward that varies across a random model's responses, so the adapters get gradients."""
    return len(set(response)) / 16


def test_the_adapter_sync_brings_a_restarted_server_back(tiny_model, tmp_path):
    """The adapter backend's transport into a real vLLM server started for adapters: adapters that change
    the model's logprobs (the base is far from them) sync and verify; the server restarted
    serves the base again and fails the check, until ``WeightSync.rejoin`` loads the last
    version from the adapter directory and verifies it."""
    from trident.config.schema import LoraConfig, SyncConfig
    from trident.models.load import load_causal_lm, load_tokenizer
    from trident.rollout.engine import ADAPTER_MODEL
    from trident.rollout.vllm_server import VLLMServer, lora_server_args
    from trident.train import lora
    from trident.weights.adapter import AdapterTransport
    from trident.weights.backend import make_transport
    from trident.weights.control import WeightSyncError
    from trident.weights.sync import WeightSync, hf_named_tensors, make_probe, probe_logprobs

    torch.manual_seed(0)
    model = lora.wrap(load_causal_lm(tiny_model), LoraConfig(r=8))
    with torch.no_grad():  # as after training (B starts at 0)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    probe = make_probe(load_tokenizer(tiny_model), 32)
    expected = probe_logprobs(model, probe)
    base = probe_logprobs(load_causal_lm(tiny_model), probe)
    assert max(abs(a - b) for a, b in zip(expected, base, strict=True)) > 0.1
    args, env = lora_server_args(8)
    server = VLLMServer(tiny_model, tmp_path / "server.log", extra_args=args, extra_env=env)
    transport = make_transport(
        "adapter",
        SyncConfig(),
        adapter_dir=tmp_path / "adapter",
        adapter_config=lora.adapter_config(model),
    )
    assert isinstance(transport, AdapterTransport) and transport.served_model == ADAPTER_MODEL
    try:
        url = server.start()
        sync = WeightSync([url], transport)
        sync.init()
        pushed = sync.push(hf_named_tensors(lora.adapter_tensors(model), False), 1)
        assert pushed["bytes"] == sum(
            p.numel() * 4 for n, p in model.named_parameters() if "lora" in n
        )
        assert sync.verify(probe, expected, 1, 2e-3)["max_abs_dlogp"] <= 2e-3
        server.stop()
        assert server.start() == url
        with pytest.raises(WeightSyncError, match="version check failed"):
            sync.verify(probe, expected, 1, 2e-3)
        assert sync.rejoin(url, probe, expected, 2e-3)["max_abs_dlogp"] <= 2e-3
    finally:
        server.stop()
        transport.close()
