"""The GRPO driver loop: sample -> generate -> score -> advantages -> reference -> learn -> sync -> log/checkpoint.

Departures from the GRPO paper, on purpose: rollouts come from quantized generators (mu), so every token's
policy-gradient term is weighted by min(pi_old/mu, C) (FlashRL's truncated importance sampling) and the mismatch
between mu and pi_old is logged each step; log-probs everywhere are those of softmax(logits / temperature).
A step the learner's precision guard skipped moves the generators (or the reference) up the precision ladder.
Each step's groups come from the run's rollout supply (cluster/run/supply.py: synchronous, one step off or a stream
with a staleness bound, one implementation); each step's data (rollouts -> scored rollouts -> train batch) is built
once, as values, by cluster/run/step_data.py; DAPO's dynamic sampling asks the same supply for more groups
(cluster/run/sampling.py).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from qgrpo.actors.common import END_WAIT_S
from qgrpo.cluster.config.schema import Config
from qgrpo.cluster.run.buffer import read_buffer, write_buffer
from qgrpo.cluster.run.control import wanted_rollout_actors
from qgrpo.cluster.run.env_health import EnvHealth, SignalWatch, drop_traces
from qgrpo.cluster.run.follow import FollowWatch
from qgrpo.cluster.run.ladder import GuardStop, PrecisionLadder
from qgrpo.cluster.run.step_data import step_data
from qgrpo.cluster.run.stopping import StopRequest
from qgrpo.cluster.run.stream import open_supply, stream_ages
from qgrpo.cluster.run.supply import StepRollouts
from qgrpo.cluster.rundir.checkpoint import CheckpointState, checkpoint_dir, complete_checkpoints, save_checkpoint
from qgrpo.cluster.rundir.resume import earlier_evals, set_aside_future
from qgrpo.cluster.rundir.rollout_log import RolloutWriter
from qgrpo.cluster.rundir.runlog import RunLog
from qgrpo.core import faults
from qgrpo.core.records import TrainStepResult, WeightSync
from qgrpo.core.storage import RunDir, StorageError
from qgrpo.learner.batch import TrainBatch
from qgrpo.learner.objective.loss import finalize_stats, merge_stats
from qgrpo.rollout.answer_stats import hollow_warnings, majority_baseline, step_answer_metrics
from qgrpo.rollout.data.tasks import PromptSampler, make_task
from qgrpo.rollout.environments.kinds import capabilities
from qgrpo.rollout.episodes import episode_metrics
from qgrpo.rollout.evaluate import eval_items, greedy, score_eval, task_judge
from qgrpo.rollout.rewards import RewardError
from qgrpo.rollout.rewards.judge import JudgeError


class StageClock:
    """Wall time per stage of one step."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        """The time since the last lap counts to `stage` (added up when a stage recurs: dynamic sampling's rounds)."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.last
        self.last = now


def step_metrics(rollouts: StepRollouts, batch: TrainBatch, results: list[TrainStepResult], sync: WeightSync | None,
                 clock: StageClock) -> dict:
    """Everything but the rewards: loss statistics summed over ranks, mismatch, versions, throughput, timings.
    The completions' statistics are of the step's fresh sample (dynamic sampling: its first round), the throughput
    of every generation of the step."""
    stats: dict = {}
    for r in results:
        stats = merge_stats(stats, r.stats)
    loss_stats = finalize_stats(stats)
    first = results[0]  # the scalars every rank holds alike
    gen_stats = rollouts.stats
    new_tokens = sum(s.new_tokens for s in gen_stats)
    completions = [c for g in rollouts.sample for c in g.completions]
    m = {
        "policy_version": first.policy_version,
        "rollout/policy_versions": sorted({s.policy_version for s in gen_stats}),
        "rollout/actors": len({s.generator_id for s in gen_stats}),
        "rollout/staleness": first.staleness,
        # the model's own tokens (a multi-turn trajectory's environment turns are episode/env_tokens)
        "rollout/completion_len": sum(c.model_tokens for c in completions) / len(completions),
        "rollout/stop_frac": sum(c.finish_reason == "stop" for c in completions) / len(completions),
        "loss/total": sum(r.loss for r in results),
        "loss/kl": loss_stats.pop("kl"),
        "loss/grad_norm": first.grad_norm,
        "loss/lr": first.lr,
        **{(k if "/" in k else f"loss/{k}"): v for k, v in loss_stats.items()},  # mismatch/*, entropy/* as named
        # the generators' own time (they run side by side; with stale rollouts allowed, while the learner trains)
        "perf/gen_tokens_per_s": new_tokens / max(rollouts.seconds, 1e-9),
        "perf/learn_tokens_per_s": batch.total_tokens / max(clock.seconds["learn"], 1e-9),
        **{f"time/learn_{k}": v for k, v in first.timing.items()},  # rank 0's split
        **{f"time/{k}": v for k, v in clock.seconds.items()},
        "time/step": clock.last - clock.start,
    }
    if any(s.env_seconds for s in gen_stats):  # multi-turn: the slowest actor's wait on its environments
        m["time/env"] = max(s.env_seconds for s in gen_stats)
    m.update(episode_metrics(rollouts.sample))
    if rollouts.stream:
        m.update(rollouts.stream)
        m.update(stream_ages(rollouts.groups, first.version_before))
    if sync:
        m.update(sync.metrics())
    return m


def train(cfg: Config, run_dir: Path | RunDir, model_path: str, resume: Path | str | None = None,
          stop: StopRequest | None = None, auto_precision: dict | None = None,
          auto_compute: dict | None = None) -> dict:
    """Run the job; returns the last step's metrics, the held-out evaluations by step, the majority baseline
    (rollout/answer_stats.py) and the final checkpoint.
    `model_path` is the resolved initial model (the reference); `resume` a checkpoint of this run to continue from.
    `run_dir`: a folder, or a RunDir whose logs are staged locally and mirrored to a URI (core/storage.py).
    `stop`: set by SIGINT/SIGTERM (cluster/run/stopping.py): the run stops after the step in progress, checkpointed
    where exact, and "stopped" in the result holds the step reached and the latest checkpoint ("checkpoint" too).
    `auto_precision`: the trials that chose rollout.precision (cluster/run/precision_auto.py: Choice.record), written
    into the start event, as is `auto_compute`: the CPU roles' timed work that chose their compute dtype
    (cluster/run/compute_auto.py: ComputeChoice.record).
    Raises RunFailed (cluster/run/supervisor.py) with what happened and how to resume when a fault ends the run."""
    import ray

    from qgrpo.actors.ray_errors import cause_of
    from qgrpo.cluster.run.supervisor import RunFailed

    # the actors started (resumed), logs open
    run = TrainingRun(cfg, run_dir, model_path, resume, auto_precision, auto_compute)
    workers, m, step = run.workers, {}, run.state.step
    stopped = None
    try:
        if run.eval_task and step == 0:
            run.evaluate(0)
        for step in range(run.state.step, cfg.run.steps):
            if stop is not None and stop.requested:  # a step boundary: `step` steps done, checkpointed if exact
                stopped = run.stopped(step, stop.name)
                break
            if faults.fires("driver.slow", step + 1):
                time.sleep(faults.SLOW_SECONDS)
            run.scale(step)
            clock = StageClock()
            data = step_data(run, step, clock)  # sample, generate, score, reference, advantages
            results = workers.learn(data.batch, step + 1)
            clock.lap("learn")
            sync = run.sync(step + 1, results[0])
            climbed = run.climb(step + 1, results[0].skipped)
            clock.lap("sync")
            metrics = step_metrics(data.rollouts, data.batch, results, sync, clock)
            m = run.log_step(step + 1, data.rollouts, data.reward_metrics, metrics, results[0], climbed)
            run.evaluate_if_due(step + 1)
            run.checkpoint_if_due(step + 1, results[0], data.rollouts.cursor,
                                  stopping=stop is not None and stop.requested)
    except (RunFailed, GuardStop, StorageError, RewardError) as e:  # StorageError: the URI, or a run_dir the
        # nodes do not share
        raise run.failed(e, step + 1) from None
    except ray.exceptions.RayError as e:  # any other of Ray's: named in one line, never a traceback
        raise run.failed(RunFailed(f"step {step + 1}: {cause_of(e)}"), step + 1) from None
    finally:
        run.close(failing=sys.exc_info()[0] is not None, stopping=stop is not None and stop.requested)
    return {"last": m, "evals": run.evals, "baseline": run.baseline, "stopped": stopped,
            "reward_failures": run.rewards.health.failures(), "env_failures": run.env_health.failures(),
            "checkpoint": stopped["checkpoint"] if stopped else str(checkpoint_dir(run.dir.root, cfg.run.steps))}


class TrainingRun:
    """One run's parts around the loop: the workers, the prompts and rewards, the logs, the precision ladder, the
    held-out evaluation and the checkpoints. Steps here are 1-based (`done`: the steps finished, this one included)."""

    def __init__(self, cfg: Config, run_dir: Path | RunDir, model_path: str, resume: Path | str | None,
                 auto_precision: dict | None = None, auto_compute: dict | None = None):
        from qgrpo.cluster.run.workers import Workers

        self.cfg, self.model_path = cfg, model_path
        self.dir = RunDir.of(run_dir)  # logs go to dir.local; checkpoints to dir.root (the same folder, or a URI)
        self.state, policy_path, self.evals, aside = CheckpointState(0, 0, model_path=model_path), model_path, {}, None
        if resume is not None:  # continue as one run: what the abandoned run wrote after the checkpoint is set aside
            self.state, policy_path = CheckpointState.read(resume), str(resume)
            aside = set_aside_future(self.dir.local, self.state.step, self.dir.root)
            self.evals = earlier_evals(self.dir.local, self.state.step)
        ro = cfg.rollout
        self.ladder = PrecisionLadder(cfg.guard, ro.backend, ro.precision, cfg.reference.precision
                                      if cfg.reference_actor else None, self.state.guard, cfg.reference.backend,
                                      ro.num_gpus, cfg.reference.num_gpus)
        self.follow = FollowWatch(cfg.sync.follow_floor, cfg.sync.follow_window)
        self.workers = Workers(cfg, policy_path, model_path, self.state.policy_version, self.ladder.rollout,
                               self.ladder.reference)
        if resume is not None:  # optimizer moments and step, LR schedule, fp32 master weights, policy version
            self.workers.load(str(resume), self.state.policy_version)
            if self.ladder.rollout != ro.precision:
                print(f"qgrpo: the precision guard had moved the generators to {self.ladder.rollout}; they resume "
                      f"there (the config says rollout.precision = {ro.precision!r})", file=sys.stderr)
        sampler = PromptSampler(make_task(cfg.task, cfg.run.seed), cursor=self.state.cursor)
        from qgrpo.cluster.run.rewarding import RewardPool

        self.rewards = RewardPool(cfg, self.reward_model_path(), self.dir.local)
        self.env_health, self.signal = self._watches(cfg)
        self.log = RunLog(self.dir.local, cfg.run.steps, self.state.step, cfg.run.progress, cfg.run.tensorboard,
                          cfg.run.wandb_project, cfg.to_dict())
        self.samples = RolloutWriter(self.dir.local, cfg.run.rollouts_flush_every)
        self.log.write({"event": "resume" if resume else "start", "step": self.state.step,
                        "generators": self.workers.rollout_info(), "placement": self.workers.placement(),
                        "cpu_waits": self.workers.waits,
                        "resumed_from": str(resume) if resume else None, "set_aside": str(aside) if aside else None,
                        **({"precision_auto": auto_precision} if auto_precision else {}),
                        **({"compute_auto": auto_compute} if auto_compute else {}), **self.ladder.state()})
        self.eval_task = make_task(cfg.task, cfg.run.seed, split="eval") if cfg.run.eval else None
        # Where each step's groups come from (cluster/run/supply.py), resumed with what a checkpoint drew beyond its
        # step
        buffer = read_buffer(resume) if resume is not None else None
        self.supply = open_supply(cfg, self.workers.rollout, sampler, self.state.step, self.state.published_version,
                                  buffer, self.dir.local)
        for event, line in self.supply.announce():  # an agent source: where its endpoint is
            self.log.write({**event, "step": self.state.step})
            print(line, file=sys.stderr)
        if buffer:  # the groups generated ahead of the checkpoint, trained on as they were sampled
            self.log.write({"event": "stream_restored", "step": self.state.step, "groups": self.supply.restored,
                            "steps": sorted(int(s) + 1 for s in buffer["steps"])})
        self.metric = task_judge(cfg.rewards, self.eval_task or sampler.task, cfg.task.eval_size, self.rewards.model)
        self.log.write({"event": "judge", "metric": self.metric.name, "judge": self.metric.describe()})
        # What always giving the train split's most common answer scores on the held-out prompts (no step: not a
        # scalar)
        self.baseline = self._baseline(sampler.task) if self.eval_task else None
        if self.baseline:
            self.log.write({"event": "baseline", **self.baseline})
        self.published = self.state.published_version  # the policy version the rollout actors hold

    def _watches(self, cfg: Config) -> tuple[EnvHealth, SignalWatch]:
        """The environment's health (failed trajectories, env_errors.log, environment.max_failed_steps) and the
        no-signal warnings (cluster/run/env_health.py), with the environment's tools' names to warn by."""
        env = cfg.environment
        tools = []
        if capabilities(env.name).tools_known:
            from qgrpo.rollout.environments.loader import environment_spec, tool_names

            tools = tool_names(environment_spec(env.name, env.params))
        return (EnvHealth(env.name, env.max_failed_steps, env.on_error, self.dir.local),
                SignalWatch.of(cfg, tools))

    def _baseline(self, train_task) -> dict | None:
        if self.metric.environment:  # a fixed answer is not a trajectory the environment scored: no baseline
            return None
        try:
            return majority_baseline(train_task, eval_items(self.eval_task, self.cfg.task.eval_size), self.metric)
        except JudgeError as e:
            self.log.write({"event": "warning", "step": self.state.step, "message": f"no majority baseline: {e}"})
            return None

    def scale(self, done: int) -> None:
        """`qgrpo scale`: applied between steps, when nothing is in flight."""
        want = wanted_rollout_actors(self.dir.root)
        pool = self.workers.rollout
        if want and want != pool.size:
            self.supply.pause()  # the calls in flight come in first
            self.log.write({"step": done, **self.supply.on_pump(lambda: pool.resize(want))})
            self.supply.resume()

    def _last(self, done: int) -> bool:
        return done == self.cfg.run.steps

    def sync(self, done: int, result: TrainStepResult) -> WeightSync | None:
        """Publish the policy to the rollout actors every algo.update_every steps, if it changed. The last step
        always syncs when evaluation follows, so the held-out score is of the final policy."""
        due = done % self.cfg.algo.update_every == 0 or (self._last(done) and self.eval_task)
        # on the pump, the pool's one owner: the calls in flight go on, and take the weights between decode steps
        sync = self.supply.on_pump(self.workers.sync_weights) if due and result.policy_version != self.published \
            else None
        self.published = sync.version if sync else self.published
        if due:
            self.supply.advance(done, self.published)
        warning = self.follow.after(sync) if sync else None
        if warning:
            self.log.write({"event": "warning", "step": done, "message": warning})
        return sync

    def climb(self, done: int, skipped: str) -> bool:
        """A step the guard skipped moves the generators (or the reference) up the precision ladder; True if so."""
        up_rollout, up_reference = self.ladder.after_step(skipped, done)
        if up_rollout:  # the calls in flight (a stream's) end on the old actors first
            self.supply.pause()
            self.supply.on_pump(lambda: self.workers.rollout.set_precision(up_rollout))
            self.supply.resume()
        if up_reference:
            self.workers.set_reference_precision(up_reference)
        return bool(up_rollout or up_reference)

    def log_step(self, done: int, rollouts: StepRollouts, reward_metrics: dict, metrics: dict,
                 result: TrainStepResult, climbed: bool) -> dict:
        """The step's metrics (returned), the workers' events, and its rollouts for RUN_DIR/rollouts (the groups
        trained on). The reward and answer metrics are of the step's fresh sample of the policy: with dynamic
        sampling its first round, not the batch kept (biased towards groups of mixed results: ~50% accuracy)."""
        m = {"step": done, **reward_metrics, **step_answer_metrics(rollouts.sample, self.metric), **metrics,
             **self.ladder.metrics(result.skipped)}
        accuracy = self.metric.sample_accuracy(rollouts.sample)  # the held-out judge on the step's fresh sample
        if accuracy is not None:
            m["train/accuracy"] = accuracy
        for event in self.rewards.health.end_step(done) + self.env_health.end_step(done, rollouts.sample) + \
                self.signal.end_step(done, m) + self.workers.events() + (
                [{"event": "ladder", "reason": result.skipped, **self.ladder.state()}] if climbed else []):
            self.log.write({"step": done, **event})
        drop_traces(rollouts.sample + rollouts.groups)  # in env_errors.log, not in every row of the rollouts
        self.samples.add(done, rollouts.groups, result.version_before)
        if done % self.cfg.run.log_every == 0 or self._last(done) or result.skipped:
            self.log.write(m)
        self.log.progress(m)
        self.rewards.health.stop_if_broken()
        self.env_health.stop_if_broken()
        return m

    def evaluate(self, done: int) -> None:
        """Held-out accuracy of the policy the rollout actors hold (greedy, task.eval_size prompts)."""
        tokens = self.cfg.run.eval_max_new_tokens or self.cfg.rollout.max_new_tokens
        items = eval_items(self.eval_task, self.cfg.task.eval_size)
        groups = self.supply.evaluate(items, greedy(tokens))  # an agent's: each row played once, sampled greedily
        try:
            self.evals[done] = score_eval(groups, self.metric, details=True)
        except JudgeError as e:
            self.log.write({"event": "warning", "step": done, "message": f"no held-out accuracy at step {done}: {e}"})
            return
        answers = self.dir.local / "evals" / f"step_{done:06d}.jsonl"  # every held-out answer, as the judge scored it
        answers.parent.mkdir(exist_ok=True)
        answers.write_text("".join(json.dumps(d) + "\n" for d in self.evals[done].pop("details")))
        self.log.write({"event": "eval", "step": done, "split": "eval", **self.evals[done]})
        for warning in hollow_warnings(self.evals[done], self.baseline) if done else []:  # step 0: the base model
            self.log.write({"event": "warning", "step": done, "message": warning})

    def evaluate_if_due(self, done: int) -> None:
        every = self.cfg.run.eval_every
        if self.eval_task and (self._last(done) or (every and done % every == 0)):
            self.evaluate(done)

    def checkpoint_if_due(self, done: int, result: TrainStepResult, cursor: int, stopping: bool = False) -> None:
        """Every run.save_every steps and at the end; `cursor`: the sampler's after this step's prompts. `stopping`
        (a signal asked the run to stop): also here if the step is a multiple of algo.update_every, where the
        generators hold the weights checkpointed (elsewhere a resume would not repeat the run: the latest stands)."""
        every = self.cfg.run.save_every
        exact_stop = stopping and done % self.cfg.algo.update_every == 0
        if not (self._last(done) or (every and done % every == 0) or exact_stop):
            return
        self.samples.flush()  # samples up to a checkpoint are on disk with it
        self.dir.sync()  # and, for a URI run, on the URI before the checkpoint is marked complete
        self.state = CheckpointState(
            step=done, policy_version=result.policy_version, cursor=cursor, published_version=self.published,
            model_path=self.model_path, guard=self.ladder.state(), rollout_precision=self.ladder.rollout,
            config=self.cfg.to_dict())
        path = save_checkpoint(self.dir.root, done, self._write_checkpoint, self.state.to_dict(),
                               self.cfg.run.keep_last)
        self.log.write({"event": "checkpoint", "step": done, "path": str(path)})

    def _write_checkpoint(self, folder: str) -> None:
        """The learners' model files, and the supply's state beyond the step (cluster/run/stream.py: snapshot)."""
        self.workers.save(folder)
        buffer = self.supply.snapshot()
        if buffer is not None:
            write_buffer(folder, buffer)

    def failed(self, err: BaseException, step: int) -> Exception:
        """The error to end the run with: what happened, at which step (1-based), and how to resume (logged first)."""
        from qgrpo.cluster.run.supervisor import RunFailed
        from qgrpo.core.invocation import qgrpo_command

        self.samples.flush()  # the steps done since the last checkpoint: a resume sets them aside with the rest
        ckpts = complete_checkpoints(self.dir.root)
        how = (f"continue from its last complete checkpoint (step_{ckpts[-1][0]:06d}) with: "
               f"{qgrpo_command('train', '--resume', self.dir.root)}" if ckpts
               else "no checkpoint was written yet (run.save_every); start it again")
        self.log.write({"event": "failed", "step": step, "error": str(err)})
        return RunFailed(f"{err}\n  the run stopped at step {step}; {how}")

    def stopped(self, done: int, why: str) -> dict:
        """A signal stopped the run after step `done`: logged with the latest complete checkpoint (None: none yet)."""
        ckpts = complete_checkpoints(self.dir.root)
        latest = str(ckpts[-1][1]) if ckpts else None
        self.log.write({"event": "stopped", "step": done, "signal": why, "checkpoint": latest})
        return {"step": done, "signal": why, "checkpoint": latest}

    def reward_model_path(self) -> str:
        """[reward_model].path resolved here (a builtin: materialised, a Hub id found in the cache), or ""."""
        from qgrpo.rollout.modeling.models import resolve_model_path

        path = getattr(getattr(self.cfg, "reward_model", None), "path", "")
        return resolve_model_path(path, self.cfg.model.cache_dir) if path else ""

    def close(self, failing: bool, stopping: bool = False) -> None:
        self.rewards.close(wait_s=0 if stopping else END_WAIT_S)
        self.supply.close()
        self.samples.close()
        self.log.close()
        # Stopping on a signal: the learners' placement group is left to Ray, which removes it with the job. A
        # signal sent to the whole process group reaches Ray's own processes too, and with the GCS gone its removal
        # would wait a minute for it.
        self.workers.shutdown(remove_group=not stopping)
        self.dir.close(failing=failing)  # a URI run: the logs reach it on failure too
