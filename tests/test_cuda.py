"""The GPU paths, end to end, on a real CUDA GPU (`cuda` mark; skipped on a machine without one).

In-process first (no Ray needed: the device machine has torch + CUDA and may have nothing else): the learner trains
on its GPU with the guard on (inputs moved, guard collectives on CUDA under NCCL), QLoRA quantizes its base on the GPU,
the torch generator quantizes and samples on the GPU at each precision (its static-cache decode loop sampling the
served model's distribution), and the reference scores there (packed completions equal to the padded pass). Then, with
Ray (and vLLM where installed): the tiny job learns on one shared GPU with the torch generator (int8, int4, nf4) and
with vLLM (int8, fp8); two learner ranks at ZeRO-2 on two GPUs match one. The NCCL weight broadcast between two GPUs
is tests/test_transport.py::test_nccl_broadcast_between_two_gpus; the quantized layers against a float32 reference
are in tests/test_quant_devices.py.
"""
import importlib.util
import json
import math

import pytest
import torch

from qgrpo.learner.objective.settings import objective_settings
from qgrpo.learner.settings import LearnerSettings
from tests.helpers import random_batch, skip_below_capability

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("dist_env")]  # the one-rank process-group environment (tests/conftest.py)
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None or importlib.util.find_spec("deepspeed") is None,
                               reason="needs Ray and DeepSpeed")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# ------------------------------------------------------------------------------------------------ in-process


@pytest.fixture(scope="module")
def cuda_learner(tiny_model_path):
    from qgrpo.learner.engine import Learner

    if torch.distributed.is_initialized() and torch.distributed.get_backend() != "nccl":
        pytest.skip("an earlier test of this process made a gloo group; run these alone: pytest -m cuda")
    return Learner(tiny_model_path, LearnerSettings(lr=1e-3, micro_batch_per_rank=8, sequences_per_rank=16,
                                                    grad_clip=1.0, objective=objective_settings(kl_coeff=0.0)),
                   device="cuda:0")


def test_learner_trains_on_its_gpu_with_the_guard_on(cuda_learner):
    assert cuda_learner.device.type == "cuda" and torch.distributed.get_backend() == "nccl"
    assert next(cuda_learner.engine.module.parameters()).device.type == "cuda"
    before = {n: p.detach().clone() for n, p in cuda_learner.engine.module.named_parameters()}
    out = cuda_learner.train_step(random_batch(32))  # a CPU batch, as the driver sends it
    assert out.skipped == "" and math.isfinite(out.loss) and math.isfinite(out.grad_norm)
    assert any(not torch.equal(before[n], p) for n, p in cuda_learner.engine.module.named_parameters())
    lp = cuda_learner.score([1, 5, 7, 9, 2])  # the sync fingerprint's probe
    assert len(lp) == 4 and all(math.isfinite(x) for x in lp)
    assert {t.device.type for _, t in cuda_learner.named_weights()} == {"cuda"}


def test_guard_skips_a_poisoned_step_on_the_gpu(cuda_learner):
    batch = random_batch(32)
    batch.mu_logp[batch.completion_mask > 0] = float("nan")
    before = {n: p.detach().clone() for n, p in cuda_learner.engine.module.named_parameters()}
    out = cuda_learner.train_step(batch)
    assert out.skipped == "sampler_logprobs"
    assert all(torch.equal(before[n], p) for n, p in cuda_learner.engine.module.named_parameters())


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4", "nf4", "fp8"])
def test_torch_generator_quantizes_and_samples_on_its_gpu(tiny_model_path, precision):
    from qgrpo.core.records import PromptItem, SamplingParams
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    skip_below_capability(precision)
    gen = TorchGenerator(tiny_model_path, precision, device="cuda:0", chat_template=False)
    assert {p.device.type for p in gen.model.parameters()} == {"cuda"}
    groups = gen.generate([PromptItem("p0", "1+2=", "3"), PromptItem("p1", "2+2=", "4")],
                          SamplingParams(group_size=4, max_new_tokens=3, temperature=1.0, seed=0))
    lps = [x for g in groups for c in g.completions for x in c.logprobs]
    assert len(groups) == 2 and lps and all(math.isfinite(x) and x <= 0 for x in lps)
    # a sync: the received weights are quantized again in place, on the GPU
    from transformers import AutoModelForCausalLM

    weights = list(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).named_parameters())
    gen.load_weights(1, weights)
    assert gen.policy_version == 1 and {p.device.type for p in gen.model.parameters()} == {"cuda"}


def _logprob_gap(gen, groups) -> float:
    """Largest |sampled log-prob - the served model's full forward log-prob| over every completion token."""
    from qgrpo.core.scoring import token_logprobs

    diffs = []
    for g in groups:
        for c in g.completions:
            ids = torch.tensor([g.prompt_ids + c.token_ids], device="cuda:0")
            ref = token_logprobs(gen.model, ids)[0, len(g.prompt_ids):].float().cpu()
            diffs += (ref - torch.tensor(c.logprobs)).abs().tolist()
    assert diffs and all(math.isfinite(d) for d in diffs)
    return max(diffs)


@pytest.mark.parametrize("graphs", [False, True, "fused"], ids=["eager", "graphs", "graphs_fused"])
@pytest.mark.parametrize("precision", ["bf16", "int8", "int4", "nf4", "fp8"])
def test_static_decode_on_the_gpu_samples_the_served_models_distribution(tiny_model_path, precision, graphs,
                                                                         monkeypatch):
    """The preallocated-cache decode loop on CUDA, eager and replayed as CUDA graphs: each sampled token's log-prob
    is the served model's own full forward's, rows finishing at different steps (and, with graphs, moving to smaller
    buckets)."""
    from qgrpo.core.records import PromptItem, SamplingParams
    from qgrpo.rollout.backends import torch_graphs
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    skip_below_capability(precision)
    monkeypatch.setattr(torch_graphs, "CHECK_EVERY", 2)  # look at finished rows often: compactions happen
    gen = TorchGenerator(tiny_model_path, precision, device="cuda:0", chat_template=False,
                         options={"cuda_graphs": bool(graphs), "fused_step": graphs == "fused"})
    assert gen.decoder is not None
    groups = gen.generate([PromptItem(f"p{i}", f"{i}+{i + 1}=", "0") for i in (0, 5, 12)],
                          SamplingParams(group_size=8, max_new_tokens=12, temperature=1.0, seed=7))
    info = gen.decode_info()
    assert info["loop"] == ("graphs" if graphs else "static"), info
    if graphs:
        assert info["captures"] >= 1 and info["fallback"] is None, info
    if graphs == "fused":  # triton_step's kernels passed their self-check on this GPU and run in the step
        assert info["kernels"] == "triton", info
    assert _logprob_gap(gen, groups) < 0.05


@pytest.mark.parametrize("fused", [False, True], ids=["static_step", "fused_step"])
@pytest.mark.parametrize("precision", ["bf16", "int8", "int4", "nf4", "fp8"])
def test_a_sync_changes_what_the_graph_computes(tiny_model_path, precision, fused):
    """A captured graph replays the addresses it recorded: a sync must write the new weights (codes and scales) into
    that storage. After a sync the same graphs (no new capture) sample the new weights' distribution, and greedy
    output changes; a re-allocated weight would have kept the old policy."""
    from transformers import AutoModelForCausalLM

    from qgrpo.core.records import PromptItem, SamplingParams
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    skip_below_capability(precision)
    gen = TorchGenerator(tiny_model_path, precision, device="cuda:0", chat_template=False,
                         options={"cuda_graphs": True, "fused_step": fused})
    assert gen.decode_info()["fused"] == fused and gen.decode_info()["kernels"] == ("triton" if fused else None)
    items = [PromptItem(f"p{i}", f"{i}+{i + 1}=", "0") for i in (0, 5, 12)]
    greedy = SamplingParams(group_size=2, max_new_tokens=10, temperature=0.0)
    before = [c.token_ids for g in gen.generate(items, greedy) for c in g.completions]
    captures = gen.decode_info()["captures"]
    assert captures >= 1 and gen.decode_info()["fallback"] is None
    new = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * p.float().std().clamp(min=1e-3).to(p.dtype))
    gen.load_weights(1, [(n, p.detach()) for n, p in new.named_parameters()])
    groups = gen.generate(items, greedy)
    assert gen.decode_info()["captures"] == captures  # the weights kept their addresses: the same graphs replay
    assert [c.token_ids for g in groups for c in g.completions] != before
    assert _logprob_gap(gen, groups) < 0.05  # what the served (new) weights compute
    sampled = gen.generate(items, SamplingParams(group_size=8, max_new_tokens=10, temperature=1.0, seed=3))
    assert _logprob_gap(gen, sampled) < 0.05


def test_packed_scoring_on_the_gpu_equals_the_padded_pass(tiny_model_path, monkeypatch):
    """Completions packed per group (seq_lens) under SDPA on CUDA give the padded shared-prompt pass's log-probs.
    Given the same seq_lens both passes hold exactly 0 at the padding (positions at or past a row's length) and
    agree everywhere; the padded pass without lengths scores the pad tokens there, so it is compared where consumers
    read it, on the completion positions (prompt_lens .. seq_lens)."""
    import qgrpo.core.scoring as scoring
    from qgrpo.rollout.backends.reference import ReferenceScorer

    g = torch.Generator().manual_seed(1)
    rows, plens, gids = [], [], []
    for gid, plen in enumerate((4, 7)):
        prompt = torch.randint(3, 20, (plen,), generator=g).tolist()
        for n in (1, 3, 5):
            rows.append(prompt + torch.randint(3, 20, (n,), generator=g).tolist())
            plens.append(plen)
            gids.append(gid)
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    scorer = ReferenceScorer(tiny_model_path, "bf16", device="cuda:0")
    plens, gids, lens = torch.tensor(plens), torch.tensor(gids), torch.tensor(list(map(len, rows)))
    col = torch.arange(ids.shape[1])
    pad, completion = col >= lens[:, None], (col >= plens[:, None]) & (col < lens[:, None])
    assert pad.any() and scoring.packs(scorer.model, 2 * ids.shape[1])  # the packed path runs, with padding to fill
    packed = scorer.score(ids, 1.0, plens, gids, lens)
    unlengthed = scorer.score(ids, 1.0, plens, gids)  # the padded pass, told no lengths
    with monkeypatch.context() as m:
        m.setattr(scoring, "packs", lambda *a: False)  # the padded pass, told the lengths
        padded = scorer.score(ids, 1.0, plens, gids, lens)
    assert torch.isfinite(packed).all() and torch.isfinite(padded).all() and torch.isfinite(unlengthed).all()
    assert (packed[pad] == 0).all() and (padded[pad] == 0).all(), "padding positions must hold exactly 0"
    assert (packed[completion] != 0).all()
    assert (packed - padded).abs().max() < 0.05
    assert ((packed - unlengthed) * completion).abs().max() < 0.05


def test_reference_scores_on_its_gpu_like_the_cpu(tiny_model_path):
    from qgrpo.rollout.backends.reference import ReferenceScorer

    ids = torch.randint(3, 30, (4, 9), generator=torch.Generator().manual_seed(0))
    gpu = ReferenceScorer(tiny_model_path, "bf16", device="cuda:0").score(ids)
    cpu = ReferenceScorer(tiny_model_path, "bf16", device="cpu").score(ids)
    assert gpu.device.type == "cpu" and torch.isfinite(gpu).all()
    assert (gpu - cpu).abs().max() < 0.05  # bf16 on two devices (different kernels)


def test_qlora_base_is_quantized_on_the_gpu(tiny_model_path):
    from qgrpo.learner.adapters import load_model

    model = load_model(tiny_model_path, "qlora", lora={"rank": 4, "alpha": 8.0, "dropout": 0.0,
                                                       "target_modules": ["all-linear"]}, device="cuda:0")
    four_bit = [p for p in model.parameters() if type(p).__name__ == "Params4bit"]
    assert four_bit and {p.device.type for p in four_bit} == {"cuda"}


def test_qlora_learner_trains_its_adapters_on_the_gpu(cuda_learner, tiny_model_path):
    """QLoRA on the rank's GPU: a step moves the adapters, leaves the NF4 base bit-identical, and the merged export
    is finite (cuda_learner: the process group is already up)."""
    from qgrpo.learner.engine import Learner

    learner = Learner(tiny_model_path, LearnerSettings(
        lr=1e-2, micro_batch_per_rank=8, sequences_per_rank=16, grad_clip=0.0,
        objective=objective_settings(kl_coeff=0.0),
        mode="qlora", lora={"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"]}),
        device="cuda:0")
    params = dict(learner.engine.module.named_parameters())
    frozen = {n: p.detach().clone() for n, p in params.items() if not p.requires_grad}
    trained = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
    out = learner.train_step(random_batch(32))
    assert out.skipped == "" and math.isfinite(out.loss)
    assert all(torch.equal(frozen[n], params[n]) for n in frozen)
    assert any(not torch.equal(trained[n], params[n]) for n in trained)
    assert all(torch.isfinite(t.float()).all() for _, t in learner.named_weights())


def test_the_agent_endpoint_serves_the_gpu_generator_and_an_update_splits_a_calls_versions(tiny_model_path):
    """The OpenAI-compatible endpoint (rollout/endpoint/) over the torch generator on CUDA, decoding through the
    fused step's CUDA graphs behind the rollout actor's UpdateGate: a token-in call answers the served model's own
    log-probs, and a load sent while a call decodes lands at the next graph-step boundary, the answer's
    weight-version spans saying which tokens each version sampled."""
    import threading
    import time

    import httpx
    from transformers import AutoModelForCausalLM

    from qgrpo.actors.update_gate import UpdateGate
    from qgrpo.rollout.backends.torch_backend import TorchGenerator
    from qgrpo.rollout.endpoint.local import serve_local

    gen = TorchGenerator(tiny_model_path, "int8", device="cuda:0", chat_template=False,
                         options={"cuda_graphs": True, "fused_step": True})
    gate = UpdateGate(gen)

    class Gated:  # RolloutActor.complete: each call holds the gate; a load meanwhile runs at a step boundary
        def continue_ids(self, sequences, sampling):
            return gate.call(lambda: gen.continue_ids(sequences, sampling))

        def __getattr__(self, name):
            return getattr(gen, name)

    local = serve_local([Gated()], max_tokens=16)
    try:
        ids = gen.tokenizer("3+4=")["input_ids"]
        r = httpx.post(f"{local.address}/inference/v1/generate", timeout=60, json={
            "token_ids": ids, "sampling_params": {"max_tokens": 8, "temperature": 1.0}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out, lps = choice["token_ids"], [x["logprob"] for x in choice["logprobs"]["content"]]
        assert out and len(lps) == len(out) and gen.decode_info()["loop"] == "graphs", gen.decode_info()
        from qgrpo.core.scoring import token_logprobs

        full = torch.tensor([ids + out], device="cuda:0")
        ref = token_logprobs(gen.model, full)[0, len(ids):].float().cpu()
        assert (ref - torch.tensor(lps)).abs().max() < 0.05  # what the served (int8) model computes

        new = [(n, p.detach()) for n, p in AutoModelForCausalLM.from_pretrained(
            tiny_model_path, dtype=torch.bfloat16).named_parameters()]  # the same values, a new version
        version, res = gen.policy_version, {}
        gen.stop_ids = [-1]  # no token is -1: the call runs its max_tokens (the endpoint keeps the real stop ids)
        gate.delay = 0.05  # a decode step every 50 ms at least: the call lasts long enough for the load to land
        try:
            t = threading.Thread(target=lambda: res.setdefault("r", httpx.post(
                f"{local.base_url}/completions", timeout=60, json={
                    "model": "qgrpo-policy", "prompt": "1+2=", "max_tokens": 24, "temperature": 1.0})))
            t.start()
            deadline = time.monotonic() + 30
            while not gate.busy and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(0.15)
            gate.load(lambda: gen.load_weights(version + 1, new))
            t.join(60)
        finally:
            gate.delay = 0.0
        assert gate.applied_mid_call == 1 and gen.policy_version == version + 1
        assert res["r"].status_code == 200, res["r"].text
        choice = res["r"].json()["choices"][0]
        spans, n = choice["weight_versions"], len(choice["token_ids"])
        assert [s["version"] for s in spans] == [str(version), str(version + 1)], spans
        assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < n == spans[1]["end"]
    finally:
        local.close()


# ------------------------------------------------------------------------------------------------ with Ray


def _train(tmp_path, tiny_model_path, *overrides):
    from qgrpo.cluster.cli.app import main

    rc = main(["train", "configs/tiny.toml", "--set", f"model.path='{tiny_model_path}'",
               "--set", f"run.output_dir='{tmp_path}'", "--set", "run.progress=false",
               "--set", "learner.num_gpus=0.5", "--set", "reference.num_gpus=0.2", "--set", "rollout.num_gpus=0.3",
               *[a for o in overrides for a in ("--set", o)]])
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def _learned(rows) -> None:
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    assert all(math.isfinite(r["loss/total"]) for r in rows)
    assert last - first >= 0.3, (first, last)


@needs_ray
@pytest.mark.parametrize("precision", ["int8", "int4", "nf4"])
def test_tiny_job_learns_on_one_gpu_with_the_torch_generator(tmp_path, tiny_model_path, precision):
    _learned(_train(tmp_path, tiny_model_path, f"rollout.precision={precision}"))


@needs_ray
def test_the_tiny_job_learns_as_a_stream_of_two_actors_on_one_gpu_with_in_flight_updates(tmp_path, tiny_model_path,
                                                                                          monkeypatch):
    """The asynchronous stream (algo.max_staleness = 1) with two int4 rollout actors decoding through CUDA graphs on
    one shared GPU: the reward rises, and syncs land inside completions in flight (from step 280 the actors decode at
    0.25 s a step, the fault rollout.slow_decode, so a chunk outlasts the learner's step and the sync after it)."""
    monkeypatch.setenv("QGRPO_FAULTS", "rollout.slow_decode@280+")
    (tmp_path / "fault-state").mkdir()
    monkeypatch.setenv("QGRPO_FAULTS_STATE", str(tmp_path / "fault-state"))
    out = tmp_path / "run"
    rows = _train(out, tiny_model_path, "algo.max_staleness=1", "rollout.num_actors=2", "rollout.num_gpus=0.15")
    _learned(rows)
    assert max(r.get("stream/staleness_max", 0) for r in rows) >= 1  # the stream ran ahead of the learner
    assert sum(r.get("stream/mixed_completions", 0) for r in rows) > 0  # completions that span two weight versions


@needs_ray
@needs_vllm
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_tiny_job_learns_on_one_gpu_with_vllm(tmp_path, tiny_model_path, precision):
    _learned(_train(tmp_path, tiny_model_path, "rollout.backend=vllm", f"rollout.precision={precision}"))


@needs_ray
@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_two_learner_ranks_at_zero2_on_two_gpus(ray_session, tiny_model_path, tmp_path):
    import ray

    from qgrpo.actors.learner_actor import start_learners
    from qgrpo.core.devices import role_env

    def ranks(world):
        settings = LearnerSettings(world_size=world, lr=1e-3, micro_batch_per_rank=4, sequences_per_rank=16 // world,
                                   zero_stage=2, grad_clip=0.0, objective=objective_settings(kl_coeff=0.0))
        opts = [{"num_gpus": 1, "runtime_env": {"env_vars": role_env(1)}}] * world
        actors, setups = start_learners(tiny_model_path, settings, 1, str(tmp_path), opts)
        ray.get(setups)
        return actors

    batch = random_batch(32)
    one, two = ranks(1), ranks(2)
    try:
        (r1,) = ray.get([a.train_step.remote(batch) for a in one])
        r2 = ray.get([a.train_step.remote(batch.shard(i, 2)) for i, a in enumerate(two)])
        assert r2[0].grad_norm == pytest.approx(r1.grad_norm, rel=0.02)
        assert sum(r.loss for r in r2) == pytest.approx(r1.loss, rel=1e-2, abs=1e-4)
    finally:
        for a in one + two:
            ray.kill(a)
