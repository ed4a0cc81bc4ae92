"""In-flight weight updates (algo.max_staleness > 0): a weight load that arrives while a rollout actor generates is
applied between two decode steps (actors/update_gate.py), the completion continues under the new weights, and every
token records the version that sampled it (Completion.token_versions) with that version's log-prob.

The update used here (`_two_token_head`) lets one hidden dimension through the final norm and maps it to tokens 5 and
6 only, with logits of +-1000: every token the new weights sample is 5 or 6 with log-prob ~0, which the tiny model's
old weights (near uniform over its 32 tokens) never give; the split between versions is read off the tokens."""
from __future__ import annotations

import dataclasses
import sys
import threading
import time

import pytest
import torch

from qgrpo.actors.update_gate import UpdateGate
from qgrpo.core.records import PromptItem, SamplingParams
from qgrpo.rollout.backends import torch_graphs
from qgrpo.rollout.backends.common import token_versions

ITEMS = [PromptItem(f"p{i}", f"{i}+{i + 1}=", str(2 * i + 1)) for i in (0, 5)]
SAMPLING = SamplingParams(group_size=4, max_new_tokens=24, temperature=1.0, seed=11)


def test_token_versions_from_change_points():
    assert token_versions([(0, 3)], 5) is None
    assert token_versions([(0, 3), (5, 4)], 5) is None  # the change came after the last token
    assert token_versions([(0, 3), (2, 4)], 5) == [3, 3, 4, 4, 4]
    assert token_versions([(0, 3), (1, 4), (3, 6)], 4) == [3, 4, 4, 6]


def _generator(tiny_model_path, loop: str, precision: str = "bf16"):
    if loop == "mlx":  # mlx-lm's model in MLX's own decode loop (mlx-cpu here)
        from qgrpo.rollout.backends import make_generator

        return make_generator("mlx", model_path=tiny_model_path, precision=precision, generator_id="mlx-inflight")
    from qgrpo.rollout.backends.torch_backend import TorchGenerator

    gen = TorchGenerator(tiny_model_path, precision=precision)
    if loop == "graphs":  # the CUDA-graph loop's steps, run eagerly on the CPU
        gen.graphs = torch_graphs.GraphDecoder(gen.model, gen.pad_id, gen.stop_ids, graphs=False)
    elif loop == "forward":  # transformers' forward on its dynamic cache
        gen.decoder = None
    return gen


X, Y = 5, 6
MLX = pytest.mark.skipif(sys.platform not in ("linux", "darwin"), reason="MLX runs on Linux and macOS")


def _two_token_head(tiny_model_path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    weights = load_file(f"{tiny_model_path}/model.safetensors")
    norm, head = torch.zeros_like(weights["model.norm.weight"]), torch.zeros_like(weights["lm_head.weight"])
    norm[0] = 1.0
    head[X, 0], head[Y, 0] = 1000.0, -1000.0
    weights["model.norm.weight"], weights["lm_head.weight"] = norm, head
    return list(weights.items())


def _new(c, start: int) -> bool:
    """Tokens from `start` on are the new weights' (5 or 6, log-prob ~0)."""
    return all(t in (X, Y) and lp > -1e-2 for t, lp in zip(c.token_ids[start:], c.logprobs[start:]))


@pytest.mark.parametrize("loop, precision", [
    ("static", "bf16"), ("static", "int8"), ("graphs", "bf16"), ("forward", "bf16"),
    pytest.param("mlx", "bf16", marks=MLX), pytest.param("mlx", "int8", marks=MLX)])
def test_an_update_between_two_steps_samples_the_rest_with_the_new_weights(tiny_model_path, loop, precision,
                                                                          monkeypatch):
    monkeypatch.setattr(torch_graphs, "CHECK_EVERY", 3)  # the graph loop looks between steps every 3 columns
    gen = _generator(tiny_model_path, loop, precision)
    before = gen.generate(ITEMS, SAMPLING)  # no update: the reference run
    new = _two_token_head(tiny_model_path)
    at = []

    def boundary():  # what the gate does: apply the load waiting, here at the 7th boundary
        if not at and len(seen) >= 6:
            gen.load_weights(1, new)
            at.append(len(seen))
        seen.append(0)

    seen: list[int] = []
    gen.step_boundary = boundary
    groups = gen.generate(ITEMS, SAMPLING)
    assert at, "no step boundary reached"
    (col,) = [c for c, v in gen._changes if v == 1]
    assert col == 7  # a boundary before each column (the graph loop's too, between its looks every 3 steps)
    mixed = 0
    for g0, g in zip(before, groups):
        assert g.policy_version == 0  # the version the call began with
        for c0, c in zip(g0.completions, g.completions):
            n = min(col, len(c0.token_ids))
            assert c.token_ids[:n] == c0.token_ids[:n] and c.logprobs[:n] == c0.logprobs[:n]  # same draws
            if len(c.token_ids) <= col:
                assert c.token_versions is None
                continue
            mixed += 1
            assert c.token_versions == [0] * col + [1] * (len(c.token_ids) - col)
            assert _new(c, col)  # the new weights' tokens
            assert all(lp < -1e-2 for lp in c.logprobs[:col])  # ... and not the old ones'
            assert c.versions(0) == c.token_versions
    assert mixed > 0
    assert gen.policy_version == 1


VLLM = [pytest.mark.vllm, pytest.mark.skipif(sys.platform != "linux", reason="vLLM runs on Linux")]


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=VLLM), pytest.param("int8", marks=VLLM)])
def test_vllm_applies_an_update_between_two_engine_steps(tiny_model_path, precision):
    """vLLM's engine is stepped by the generator, with the step boundary between two steps: a load there samples the
    rest of every completion in flight with the new weights, and vLLM's own weight-version spans say which tokens
    each version sampled. The requests are scheduled together, so after 7 engine steps each holds 7 tokens."""
    from qgrpo.rollout.backends import make_generator

    gen = make_generator("vllm", model_path=tiny_model_path, precision=precision, generator_id=f"vllm-{precision}")
    try:
        assert gen.updates_between_steps
        before = gen.generate(ITEMS, SAMPLING)
        new, seen = _two_token_head(tiny_model_path), []

        def boundary():  # the gate's step_boundary: the load waiting runs after the 7th engine step
            if len(seen) == 6:
                gen.load_weights(1, new)
            seen.append(0)

        gen.step_boundary = boundary
        groups = gen.generate(ITEMS, SAMPLING)
        col, mixed = 7, 0
        for g0, g in zip(before, groups):
            assert g.policy_version == 0  # the version the call began with
            for c0, c in zip(g0.completions, g.completions):
                n = min(col, len(c0.token_ids))
                assert c.token_ids[:n] == c0.token_ids[:n]  # the same draws up to the load
                assert c.logprobs[:n] == pytest.approx(c0.logprobs[:n], abs=1e-5)
                if len(c.token_ids) <= col:
                    assert c.token_versions is None
                    continue
                mixed += 1
                assert c.token_versions == [0] * col + [1] * (len(c.token_ids) - col)
                assert _new(c, col) and all(lp < -1e-2 for lp in c.logprobs[:col])
        assert mixed > 0 and gen.policy_version == 1
        assert not gen._stale_prefix  # the prefix cache the old weights wrote was reset once the call ended
        gen.step_boundary = None
        for g in gen.generate(ITEMS, SAMPLING):  # the next call: the new weights throughout, one version
            assert g.policy_version == 1
            assert all(c.token_versions is None and _new(c, 0) for c in g.completions)
    finally:
        gen.close()


def test_without_a_boundary_hook_nothing_changes(tiny_model_path):
    gen = _generator(tiny_model_path, "static")
    a = gen.generate(ITEMS, SAMPLING)
    gen.step_boundary = lambda: None
    b = gen.generate(ITEMS, SAMPLING)
    for ga, gb in zip(a, b):
        for ca, cb in zip(ga.completions, gb.completions):
            assert (ca.token_ids, ca.logprobs, cb.token_versions) == (cb.token_ids, cb.logprobs, None)


def test_the_gate_runs_a_load_at_the_next_step_boundary_of_the_call_in_flight(tiny_model_path):
    """Real threads: the generation call holds the gate; a load from another thread waits, runs in the decode loop
    between two steps (not after the call), and its result returns to the loading thread."""
    gen = _generator(tiny_model_path, "static")
    gate = UpdateGate(gen)
    gate.delay = 0.02  # a step every 20 ms: the call lasts long enough for the load to land in it
    new = _two_token_head(tiny_model_path)
    out, threads = {}, {}

    def call():
        out["groups"] = gate.call(lambda: gen.generate(ITEMS, SAMPLING))
        out["call_end"] = time.monotonic()

    def load():
        threads["load"] = None
        out["ack"] = gate.load(lambda: (threading.current_thread().name, gen.load_weights(1, new)))
        out["load_end"] = time.monotonic()

    t = threading.Thread(target=call, name="generate")
    t.start()
    time.sleep(0.15)  # a few steps in
    load()
    t.join(30)
    assert out["ack"][0] == "generate"  # applied in the decode loop's thread
    assert out["load_end"] < out["call_end"] and gate.applied_mid_call == 1
    comps = [c for g in out["groups"] for c in g.completions]
    assert any(c.token_versions is not None and c.token_versions[0] == 0 for c in comps)
    # the model free again: a load now runs at once, in the caller's thread
    assert gate.load(lambda: threading.current_thread().name) == threading.current_thread().name


def test_a_load_that_fails_in_the_decode_loop_raises_in_the_loading_thread_only(tiny_model_path):
    gen = _generator(tiny_model_path, "static")
    gate = UpdateGate(gen)
    gate.delay = 0.02
    out = {}

    def bad():
        raise ValueError("broken update")

    t = threading.Thread(target=lambda: out.setdefault("groups", gate.call(lambda: gen.generate(ITEMS, SAMPLING))))
    t.start()
    time.sleep(0.15)
    with pytest.raises(ValueError, match="broken update"):
        gate.load(bad)
    t.join(30)
    assert len(out["groups"]) == 2 and gen.policy_version == 0


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=MLX), pytest.param("vllm", marks=VLLM)])
def test_a_rollout_actor_applies_a_sync_between_two_decode_steps_of_its_call_in_flight(ray_session, tiny_model_path,
                                                                                       tmp_path, backend):
    """Real Ray: a RolloutActor (int8) generates with 0.25 s per decode step (the fault rollout.slow_decode); a sync
    sent meanwhile returns its SyncAck while the call is still running, and the call's completions switch to the new
    weights' tokens at the boundary where it landed, each token with its version. MLX's generator lives on the
    actor's home thread, where its loads run too; vLLM's engine is stepped by its generator."""
    import ray
    from transformers import AutoTokenizer

    from qgrpo.actors.rollout_actor import RolloutActor
    from qgrpo.actors.weights import ObjectStoreTransport
    from qgrpo.rollout.backends import make_generator
    from qgrpo.rollout.backends.common import probe_ids

    env = {"QGRPO_FAULTS": "rollout.slow_decode@1+", "QGRPO_FAULTS_STATE": str(tmp_path)}
    actor = RolloutActor.options(runtime_env={"env_vars": env}).remote(
        backend, dict(model_path=tiny_model_path, precision="int8", generator_id=f"inflight-{backend}"), 1)
    try:
        new = _two_token_head(tiny_model_path)
        probe = probe_ids(AutoTokenizer.from_pretrained(tiny_model_path))
        # the receiver's own format scores the probe
        twin = make_generator(backend, model_path=tiny_model_path, precision="int8", generator_id="twin")
        twin.load_weights(1, new)
        update = ObjectStoreTransport(1 << 12).publish(1, new, probe_ids=probe, probe_logprobs=twin.score(probe))
        twin.close()
        ray.get(actor.info.remote())  # started
        call = actor.generate.remote(ITEMS, SamplingParams(group_size=4, max_new_tokens=12, temperature=1.0, seed=3), 1)
        time.sleep(1.0)  # a few steps in
        ack = ray.get(actor.load_weights.remote(update), timeout=60)
        assert ack.version == 1
        assert not ray.wait([call], timeout=0)[0], "the sync waited for the whole call"
        groups, stats = ray.get(call, timeout=60)
        assert stats.policy_version == 0 and ray.get(actor.updates_mid_call.remote()) == 1
        comps = [c for g in groups for c in g.completions]
        mixed = [c for c in comps if c.token_versions is not None]
        assert mixed and all(g.policy_version == 0 for g in groups)
        for c in mixed:
            col = c.token_versions.index(1)
            assert 0 < col and c.token_versions == [0] * col + [1] * (len(c.token_ids) - col)
            assert _new(c, col) and all(lp < -1e-2 for lp in c.logprobs[:col])
        # the next call is all the new weights'
        after = ray.get(actor.generate.remote(ITEMS, SamplingParams(group_size=2, max_new_tokens=4, seed=4), 1))[0]
        assert all(_new(c, 0) and c.token_versions is None for g in after for c in g.completions)
    finally:
        ray.kill(actor)


def test_token_versions_reach_the_learners_batch_and_its_staleness():
    """pack_rollouts carries each completion token's version to the learner ([B, T], prompt and padding at the row's
    version); the learner's staleness is then the mean over completion tokens. Without token versions the batch holds
    none and the staleness is the rows' mean, as before."""
    from qgrpo.core.records import Completion, GroupRollout
    from qgrpo.learner.batch import advantages_of, pack_rollouts, staleness

    item = PromptItem("p", "1+1=", "2")
    mixed = Completion([4, 5, 6], [-1.0, -1.0, -1.0], "length", "", token_versions=[3, 4, 4])
    plain = Completion([7], [-1.0], "stop", "")
    groups = [GroupRollout(item, [1, 2], [mixed, plain], policy_version=3, generator_id="g", precision="bf16",
                           advantages=[1.0, -1.0])]
    batch = pack_rollouts(groups, 0, 3).train_batch(advantages_of(groups))
    assert batch.token_versions.tolist() == [[3, 3, 3, 4, 4], [3, 3, 3, 3, 3]]
    # version_before 5: ages 2, 1, 1 and 2 over the four completion tokens
    assert staleness(batch, 5) == pytest.approx((2 + 1 + 1 + 2) / 4)
    assert staleness(batch.shard(1, 2), 5) == pytest.approx(2.0)
    groups[0] = dataclasses.replace(groups[0], completions=[dataclasses.replace(mixed, token_versions=None), plain])
    batch = pack_rollouts(groups, 0, 3).train_batch(advantages_of(groups))
    assert batch.token_versions is None and staleness(batch, 5) == pytest.approx(2.0)


def test_a_load_arriving_as_a_call_ends_is_not_left_waiting():
    """A load that arrives after the call's last look at the waiting loads, before the model is freed, is run
    before the call returns (the look and the release are one step); it never waits for a next call."""
    gen = type("Gen", (), {"updates_between_steps": False})()
    gate = UpdateGate(gen)
    run_waiting, out = gate._run_waiting, {}

    def late_load():  # the call's first look at the waiting loads found none; a load comes in just then
        n = run_waiting()
        if "thread" not in out:
            out["thread"] = threading.Thread(target=lambda: out.setdefault("ack", gate.load(lambda: "loaded")),
                                             daemon=True)
            out["thread"].start()
            while not gate.waiting:  # it waits for the model, which the call still holds
                time.sleep(0.001)
        return n

    gate._run_waiting = late_load
    assert gate.call(lambda: "generated") == "generated"
    out["thread"].join(5)
    assert out.get("ack") == "loaded" and not gate.busy
