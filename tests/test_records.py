"""The typed records on the way back from the actors, and what the learner is built with: they pickle (Ray carries
them), the sync's metrics keep their names, trainer_state.json keeps its keys (old run directories resume), and the
learner's settings come from the config sections they name."""
import json
import math
import pickle

from qgrpo.cluster.config.schema import load_config
from qgrpo.cluster.run.learners import learner_settings
from qgrpo.cluster.rundir.checkpoint import STATE_FILE, CheckpointState, read_state, save_checkpoint
from qgrpo.core.records import SyncAck, TrainStepResult, WeightSync
from qgrpo.learner.settings import LearnerSettings


def _ack(gap: float, seconds: float = 0.5, changed: float = 1e-3) -> SyncAck:
    return SyncAck("torch-0", 3, seconds=seconds, receive_seconds=0.1, requantize_seconds=0.2, verify_seconds=0.05,
                   fingerprint_gap=gap, fingerprint_corr=1.0 - gap, code_change_frac=changed, bf16_change_frac=0.1,
                   update_norm_ratio=changed * 100, update_projection=1.0)


def test_records_cross_into_a_fresh_process(tmp_path):
    """Records reach other Ray processes by pickling: a fresh interpreter, which has imported none of our modules,
    loads them and pickles them back unchanged (a record defined in a test or holding a lambda would fail here)."""
    import subprocess
    import sys

    result = TrainStepResult(stats={"tokens": 12.0}, loss=0.5, grad_norm=1.5, lr=1e-6, policy_version=3,
                             version_before=2, staleness=0.0, timing={"forward": 0.1, "backward": 0.2,
                                                                      "optimizer": 0.01}, skipped="mismatch")
    records = [result, _ack(0.01), LearnerSettings(world_size=2, lora={"rank": 4}),
               CheckpointState(step=1, policy_version=1)]
    (tmp_path / "in.pkl").write_bytes(pickle.dumps(records))
    code = ("import pickle, sys; r = pickle.load(open(sys.argv[1], 'rb')); "
            "assert all(type(x).__module__.startswith('qgrpo.') for x in r); pickle.dump(r, open(sys.argv[2], 'wb'))")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "in.pkl"), str(tmp_path / "out.pkl")], check=True,
                   cwd=tmp_path, timeout=120)
    assert pickle.loads((tmp_path / "out.pkl").read_bytes()) == records


def test_weight_sync_metrics_keep_their_names():
    sync = WeightSync.of(3, nbytes=1024, buckets=2, seconds=1.0, export_seconds=0.25,
                         acks=[_ack(0.01, seconds=0.5), _ack(0.03, seconds=0.7, changed=2e-4),
                               _ack(0.02, changed=math.nan)])  # an actor at bf16 measures nothing
    assert sync.version == 3 and sync.load_seconds_max == 0.7
    assert sync.fingerprint_gap_max == 0.03 and math.isclose(sync.fingerprint_corr_min, 0.97)
    assert sync.code_change_frac_min == 2e-4 and math.isclose(sync.update_norm_ratio_min, 0.02)
    assert list(sync.metrics()) == [
        "sync/nbytes", "sync/buckets", "sync/seconds", "sync/export_seconds", "sync/receive_seconds_max",
        "sync/requantize_seconds_max", "sync/verify_seconds_max", "sync/load_seconds_max",
        "sync/fingerprint_gap_max", "sync/fingerprint_corr_min", "sync/code_change_frac_min", "sync/bf16_change_frac",
        "sync/update_norm_ratio_min", "sync/update_projection_min", "sync/norm_noise"]
    assert sync.norm_noise == 0.0  # no actor added exploration noise


def _writer(out: str) -> None:
    for name, text in (("model.safetensors", "w"), ("config.json", "{}")):
        with open(f"{out}/{name}", "w") as f:
            f.write(text)


def test_checkpoint_state_keeps_its_keys_and_reads_old_run_directories(tmp_path):
    state = CheckpointState(step=4, policy_version=3, cursor=64, published_version=2, model_path="/m",
                            guard={"rollout_precision": "int8"}, rollout_precision="int8", config={"run": {}})
    path = save_checkpoint(tmp_path, 4, _writer, state.to_dict(), keep_last=1)
    on_disk = json.loads((path / STATE_FILE).read_text())
    assert list(on_disk) == ["step", "policy_version", "cursor", "published_version", "model_path", "guard",
                             "rollout_precision", "config"]
    assert CheckpointState.read(path) == state and read_state(path) == on_disk
    # An older trainer_state.json, before published_version and the guard were saved: it resumes as it did.
    old = CheckpointState.from_dict({"step": 2, "policy_version": 2, "cursor": 32, "model_path": "/m",
                                     "config": {"run": {}}})
    assert (old.published_version, old.guard, old.cursor) == (2, None, 32)


def test_learner_settings_come_from_the_config_sections():
    cfg = load_config(None, ["model.path='builtin:tiny-digits'", "learner.world_size=2", "learner.lr=3e-5",
                             "learner.beta2=0.99", "rollout.prompts_per_step=6", "rollout.group_size=3",
                             "algo.clip_high=0.28", "algo.updates_per_batch=2", "run.steps=7", "guard.enabled=false",
                             "learner.mode=lora", "learner.lora.rank=4"])
    s = learner_settings(cfg)
    assert (s.world_size, s.lr, s.betas, s.sequences_per_rank) == (2, 3e-5, (0.9, 0.99), 9)  # 18 sequences over 2
    assert s.objective.loss_params.high == 0.28 and s.objective.updates_per_batch == 2 and s.total_updates == 14
    assert s.guard is False and s.mode == "lora" and s.lora["rank"] == 4
    assert s.deepspeed_config()["gradient_accumulation_steps"] == math.ceil(9 / s.micro_batch_per_rank)


def test_a_completion_answers_for_its_optional_fields():
    """Consumers ask a Completion for its model tokens, mask and versions; none tests the optional fields for None."""
    from qgrpo.core.records import Completion

    plain = Completion([4, 5, 6], [-1.0] * 3, "length", "x")
    assert plain.mask() == [1, 1, 1] and plain.model_tokens == 3 and not plain.multi_turn
    assert plain.versions(7) == [7, 7, 7]
    turns = [{"role": "assistant", "content": "5", "start": 0, "end": 1}, {"role": "user", "content": "no",
                                                                             "start": 1, "end": 3}]
    traj = Completion([4, 5, 6, 7], [-1.0, 0.0, 0.0, -1.0], "stop", "x", model_mask=[1, 0, 0, 1], turns=turns,
                      env_score=1.0, token_versions=[3, 3, 3, 4])
    assert traj.mask() == [1, 0, 0, 1] and traj.model_tokens == 2 and traj.multi_turn
    assert traj.versions(7) == [3, 3, 3, 4]
