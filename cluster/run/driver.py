"""The GRPO driver loop: sample -> generate -> score -> advantages -> reference -> learn -> sync -> log/checkpoint.

Departures from the GRPO paper, on purpose: rollouts come from quantized generators (mu), so every token's
policy-gradient term is weighted by min(pi_old/mu, C) (FlashRL's truncated importance sampling) and the mismatch
between mu and pi_old is logged each step; log-probs everywhere are those of softmax(logits / temperature).
A step the learner's precision guard skipped moves the generators (or the reference) up the precision ladder.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from qgrpo.rollout.answer_stats import hollow_warnings, majority_baseline, step_answer_metrics
from qgrpo.cluster.rundir.checkpoint import checkpoint_dir, complete_checkpoints, read_state, save_checkpoint
from qgrpo.cluster.config.schema import Config
from qgrpo.cluster.run.control import wanted_rollout_actors
from qgrpo.rollout.evaluate import accuracy_reward, eval_items, greedy, score_eval
from qgrpo.cluster.run.ladder import GuardStop, PrecisionLadder
from qgrpo.cluster.run.overlap import RolloutSource
from qgrpo.cluster.rundir.resume import earlier_evals, set_aside_future
from qgrpo.cluster.rundir.rollout_log import RolloutWriter
from qgrpo.cluster.rundir.runlog import RunLog
from qgrpo.core.storage import RunDir, StorageError
from qgrpo.learner.batch import TrainBatch, build_train_batch
from qgrpo.learner.loss import finalize_stats, merge_stats
from qgrpo.rollout.advantages import group_advantages
from qgrpo.core.records import GenerationStats, GroupRollout
from qgrpo.rollout.rewards import WeightedRewards
from qgrpo.rollout.tasks import PromptSampler, make_task

PAD_ID = 0  # right padding is never attended to (causal attention), so any valid id will do


def score_groups(groups: list[GroupRollout], rewards: WeightedRewards, scale: str) -> dict[str, float]:
    """Fill rewards and group-normalised advantages in place; return reward metrics."""
    parts: dict[str, list[float]] = {}
    for g in groups:
        g.rewards = []
        for c in g.completions:
            total, per_fn = rewards.score(c.text, g.item.reference, g.item.prompt_id)
            g.rewards.append(total)
            for k, v in per_fn.items():
                parts.setdefault(k, []).append(v)
    adv = group_advantages(torch.tensor([g.rewards for g in groups], dtype=torch.float32), scale=scale)
    for g, a in zip(groups, adv.tolist()):
        g.advantages = a
    flat = [r for g in groups for r in g.rewards]
    mixed = sum(1 for g in groups if max(g.rewards) > min(g.rewards))
    return {
        "reward/mean": statistics.fmean(flat), "reward/std": statistics.pstdev(flat),
        "reward/groups_with_signal": mixed / len(groups), "reward/errors": rewards.errors,
        **{f"reward/{k}": statistics.fmean(v) for k, v in parts.items()},
    }


class StageClock:
    """Wall time per stage of one step."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self.last
        self.last = now


def step_metrics(groups: list[GroupRollout], gen_stats: list[GenerationStats], batch: TrainBatch,
                 results: list[dict], sync: dict | None, clock: StageClock) -> dict:
    """Everything but the rewards: loss statistics summed over ranks, mismatch, versions, throughput, timings."""
    stats: dict = {}
    for r in results:
        stats = merge_stats(stats, r["stats"])
    loss_stats = finalize_stats(stats)
    new_tokens = sum(s.new_tokens for s in gen_stats)
    completions = [c for g in groups for c in g.completions]
    m = {
        "policy_version": results[0]["policy_version"],
        "rollout/policy_versions": sorted({s.policy_version for s in gen_stats}),
        "rollout/actors": len({s.generator_id for s in gen_stats}),
        "rollout/staleness": results[0]["staleness"],
        "rollout/completion_len": new_tokens / len(completions),
        "rollout/stop_frac": sum(c.finish_reason == "stop" for c in completions) / len(completions),
        "loss/total": sum(r["loss"] for r in results),
        "loss/kl": loss_stats.pop("kl"),
        "loss/grad_norm": results[0]["grad_norm"],
        "loss/lr": results[0]["lr"],
        **{(k if k.startswith("mismatch/") else f"loss/{k}"): v for k, v in loss_stats.items()},
        # the generators' own time (they run side by side; with algo.overlap, while the learner trains)
        "perf/gen_tokens_per_s": new_tokens / max(max(s.seconds for s in gen_stats), 1e-9),
        "perf/learn_tokens_per_s": batch.total_tokens / max(clock.seconds["learn"], 1e-9),
        **{f"time/learn_{k}": v for k, v in results[0].get("timing", {}).items()},  # rank 0's split
        **{f"time/{k}": v for k, v in clock.seconds.items()},
        "time/step": clock.last - clock.start,
    }
    if sync:
        m.update({f"sync/{k}": v for k, v in sync.items() if k != "version"})
    return m


def train(cfg: Config, run_dir: Path | RunDir, model_path: str, resume: Path | str | None = None) -> dict:
    """Run the job; returns the last step's metrics, the held-out evaluations by step, the majority baseline
    (rollout/answer_stats.py) and the final checkpoint.
    `model_path` is the resolved initial model (the reference); `resume` a checkpoint of this run to continue from.
    `run_dir`: a folder, or a RunDir whose logs are staged locally and mirrored to a URI (core/storage.py).
    Raises RunFailed (cluster/run/workers.py) with what happened and how to resume when a fault ends the run."""
    from qgrpo.cluster.run.workers import RunFailed, Workers

    run = RunDir.of(run_dir)  # logs go to run.local; checkpoints to run.root (the same folder, or a URI)
    state, policy_path, evals, aside = {"step": 0, "policy_version": 0, "cursor": 0}, model_path, {}, None
    if resume is not None:  # continue as one run: what the abandoned run wrote after the checkpoint is set aside
        state, policy_path = read_state(resume), str(resume)
        aside, evals = set_aside_future(run.local, state["step"], run.root), earlier_evals(run.local, state["step"])
    ro, algo = cfg.rollout, cfg.algo
    ladder = PrecisionLadder(cfg.guard, ro.backend, ro.precision, cfg.reference.precision if cfg.reference_actor
                             else None, state.get("guard"), cfg.reference.backend, ro.num_gpus, cfg.reference.num_gpus)
    workers = Workers(cfg, policy_path, model_path, state["policy_version"], ladder.rollout, ladder.reference)
    if resume is not None:  # optimizer moments and step, LR schedule, fp32 master weights, policy version
        workers.load(str(resume), state["policy_version"])
        if ladder.rollout != ro.precision:
            print(f"qgrpo: the precision guard had moved the generators to {ladder.rollout}; they resume there "
                  f"(the config says rollout.precision = {ro.precision!r})", file=sys.stderr)
    sampler = PromptSampler(make_task(cfg.task, cfg.run.seed), cursor=state["cursor"])
    rewards = WeightedRewards.from_config(cfg.rewards)
    metric = accuracy_reward([s.name for s in cfg.rewards.functions])
    log = RunLog(run.local, cfg.run.steps, state["step"], cfg.run.progress, cfg.run.tensorboard,
                 cfg.run.wandb_project, cfg.to_dict())
    samples = RolloutWriter(run.local, cfg.run.rollouts_flush_every)
    log.write({"event": "resume" if resume else "start", "step": state["step"], "generators": workers.rollout_info(),
               "placement": workers.placement(), "resumed_from": str(resume) if resume else None,
               "set_aside": str(aside) if aside else None, **ladder.state()})
    eval_task = make_task(cfg.task, cfg.run.seed, split="eval") if cfg.run.eval else None
    source = RolloutSource(workers, sampler, ro, cfg.run.seed, algo.overlap)  # one step ahead with algo.overlap
    # What always giving the train split's most common answer scores on the held-out prompts (no step: not a scalar)
    baseline = majority_baseline(sampler.task, eval_items(eval_task, cfg.task.eval_size), metric) if eval_task else None
    if baseline:
        log.write({"event": "baseline", **baseline})
    published = state.get("published_version", state["policy_version"])

    def evaluate(step: int) -> None:
        tokens = cfg.run.eval_max_new_tokens or ro.max_new_tokens
        groups, _ = workers.generate(eval_items(eval_task, cfg.task.eval_size), greedy(tokens))
        evals[step] = score_eval(groups, metric)
        log.write({"event": "eval", "step": step, "split": "eval", **evals[step]})
        for warning in hollow_warnings(evals[step], baseline) if step else []:  # step 0 is the base model
            log.write({"event": "warning", "step": step, "message": warning})

    m: dict = {}
    step = state["step"]
    try:
        if eval_task and step == 0:
            evaluate(0)
        for step in range(state["step"], cfg.run.steps):
            want = wanted_rollout_actors(run.root)  # `qgrpo scale`: applied between steps, nothing in flight
            if want and want != len(workers.rollout.actors):
                log.write({"step": step, **workers.rollout.resize(want)})
            clock = StageClock()
            rollouts = source.take(step, cfg.run.steps)
            groups, gen_stats = rollouts.groups, rollouts.stats
            clock.lap("generate")
            reward_metrics = score_groups(groups, rewards, algo.advantage_scale)
            batch = build_train_batch(groups, PAD_ID, ro.max_new_tokens)
            if workers.reference is not None:
                batch = batch.with_ref(workers.reference_logprobs(batch))
            clock.lap("reference")
            results = workers.train(batch, step + 1)
            clock.lap("learn")
            source.settle()  # the next step's rollouts (algo.overlap) are done: the generators are free to sync
            clock.lap("rollout_wait")
            skipped, last = results[0]["skipped"], step + 1 == cfg.run.steps
            # The last step always syncs when evaluation follows, so the held-out score is of the final policy.
            due = (step + 1) % algo.update_every == 0 or (last and eval_task)
            sync = workers.sync_weights() if due and results[0]["policy_version"] != published else None
            published = sync["version"] if sync else published
            up_rollout, up_reference = ladder.after_step(skipped, step + 1)  # a skipped step moves up the ladder
            if up_rollout:
                workers.rollout.set_precision(up_rollout)
            if up_reference:
                workers.set_reference_precision(up_reference)
            clock.lap("sync")

            m = {"step": step + 1, **reward_metrics, **step_answer_metrics(groups, metric),
                 **step_metrics(groups, gen_stats, batch, results, sync, clock), **ladder.metrics(skipped)}
            if f"reward/{metric}" in m:
                m["train/accuracy"] = m[f"reward/{metric}"]
            for event in workers.events() + ([{"event": "ladder", "reason": skipped, **ladder.state()}]
                                             if up_rollout or up_reference else []):
                log.write({"step": step + 1, **event})
            samples.add(step + 1, groups, results[0]["version_before"])
            if (step + 1) % cfg.run.log_every == 0 or last or skipped:
                log.write(m)
            log.progress(m)
            if eval_task and (last or (cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0)):
                evaluate(step + 1)
            if last or (cfg.run.save_every and (step + 1) % cfg.run.save_every == 0):
                samples.flush()  # samples up to a checkpoint are on disk with it
                run.sync()  # and, for a URI run, on the URI before the checkpoint is marked complete
                state = {"step": step + 1, "policy_version": m["policy_version"], "cursor": rollouts.cursor,
                         "published_version": published, "model_path": model_path, "guard": ladder.state(),
                         "rollout_precision": ladder.rollout, "config": cfg.to_dict()}
                path = save_checkpoint(run.root, step + 1, workers.save, state, cfg.run.keep_last)
                log.write({"event": "checkpoint", "step": step + 1, "path": str(path)})
    except (RunFailed, GuardStop, StorageError) as e:  # StorageError: the URI, or a run_dir the nodes do not share
        samples.flush()  # the steps done since the last checkpoint: a resume sets them aside with the rest
        done = complete_checkpoints(run.root)
        how = (f"continue from its last complete checkpoint (step_{done[-1][0]:06d}) with: qgrpo train --resume "
               f"{run.root}"
               if done else "no checkpoint was written yet (run.save_every); start it again")
        log.write({"event": "failed", "step": step + 1, "error": str(e)})
        raise RunFailed(f"{e}\n  the run stopped at step {step + 1}; {how}") from None
    finally:
        source.close()
        samples.close()
        log.close()
        workers.shutdown()
        run.close(failing=sys.exc_info()[0] is not None)  # a URI run: the logs reach it on failure too
    return {"last": m, "evals": evals, "baseline": baseline, "checkpoint": str(checkpoint_dir(run.root, cfg.run.steps))}
