"""TRL's side of bench/vs_trl.py: TRL's GRPOTrainer on the same weights, prompts and rewards as our side, in a process
of its own. Not meant to be run by hand: vs_trl.py starts it with one JSON argument and reads the JSON it writes.

    python bench/trl_runner.py '{"config": "bench/vs_trl.toml", "overrides": [...], "model_path": ..., "out": ...}'

What is the same as our side: the model folder (bf16), the prompts (our task code on our config: items 0, 1, ... in
order, `shuffle_dataset=False`, as our PromptSampler hands them out; the chat template applied by TRL is checked to
give exactly the token ids our generators feed, see `prompt_ids_match`), the rewards (our rollout/rewards.py functions
with the config's weights; TRL sums weighted rewards before normalising by the group std, as we do), G completions per
prompt, up to N new tokens, T = 1, no top-k / top-p, lr, grad clip 1, the KL coefficient (TRL's `beta`, our
`algo.kl_coeff`; both the k3 estimator; 0 = no reference model), clip 0.2 on both sides, token-mean loss (TRL's
`dapo`, our `token_mean`), one optimizer step per batch of prompts x G, gradient checkpointing as
`learner.gradient_checkpointing` says (TRL's default is on; bench/vs_trl.toml turns it off on both sides).
What differs, inherent to TRL here: HF `generate` (no vLLM), bf16 weights trained directly (AdamW on bf16 parameters,
no fp32 master copy: less work and memory than our DeepSpeed BF16 learner; at lr 1e-5 a step leaves ~98% of the bf16
weights unchanged, as the update is below their rounding step), one process for generation and learning. `--trl-dtype
float32` in vs_trl.py loads fp32 weights instead (bf16 autocast in the learner; generation then runs in fp32).
`--trl-set` in vs_trl.py changes any GRPOConfig field. With `"device": "cuda"` in the spec, TRL trains and
generates on the GPU (`use_cpu` false); the record then holds torch's peak allocated GPU memory.

Timing: wall clock at each `on_step_end` (a step's interval therefore also holds the previous step's logging, as our
side's metrics timestamps do); generation is timed around `_generate_single_turn` (HF generate of all P x G rows).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _reward(name: str):
    """Our reward function `name` as TRL calls one: on the last message of each completion, against its reference."""
    from qgrpo.rollout.rewards import CHECKS

    fn = CHECKS[name]  # per completion: TRL's conversational completions are unpacked here

    def score(prompts, completions, reference, **_):
        return [fn(c[-1]["content"], ref) for c, ref in zip(completions, reference)]
    score.__name__ = name  # TRL logs rewards/<name>
    return score


def _grpo_config(cfg, spec: dict) -> dict:
    """GRPOConfig's fields for our config (the module doc says which match ours), then the --trl-set ones."""
    ro = cfg.rollout
    grpo = dict(
        output_dir=spec["tmp_dir"], use_cpu=spec.get("device", "cpu") == "cpu", bf16=True, seed=cfg.run.seed,
        max_steps=cfg.run.steps, per_device_train_batch_size=ro.prompts_per_step * ro.group_size,
        gradient_accumulation_steps=1, num_generations=ro.group_size, max_completion_length=ro.max_new_tokens,
        temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k, learning_rate=cfg.learner.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.learner.weight_decay,
        adam_beta1=cfg.learner.beta1, adam_beta2=cfg.learner.beta2, max_grad_norm=cfg.learner.grad_clip,
        beta=cfg.algo.kl_coeff, epsilon=cfg.algo.clip_low, epsilon_high=cfg.algo.clip_high, loss_type="dapo",
        scale_rewards="group", num_iterations=1, use_vllm=False, shuffle_dataset=False,
        gradient_checkpointing=cfg.learner.gradient_checkpointing, logging_steps=1, save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        reward_weights=[s.weight for s in cfg.rewards.functions])
    grpo.update(spec["trl_set"])
    return grpo


def main(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from qgrpo.cluster.config.schema import load_config
    from qgrpo.rollout.backends.common import format_prompt
    from qgrpo.rollout.data.tasks import make_task

    cfg = load_config(spec["config"], spec["overrides"])
    ro = cfg.rollout
    path, steps, per_step = spec["model_path"], cfg.run.steps, ro.prompts_per_step
    task = make_task(cfg.task, cfg.run.seed)
    items = [task.item(i) for i in range(steps * per_step)]  # our PromptSampler's order: step k gets items 4k..4k+3
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected_ids = [format_prompt(tokenizer, it, cfg.task.chat_template) for it in items]
    rows = {"prompt": [[{"role": r, "content": c} for r, c in it.history] + [{"role": "user", "content": it.prompt}]
                       for it in items],
            "reference": [it.reference for it in items]}

    grpo = _grpo_config(cfg, spec)

    class Timed(GRPOTrainer):
        """Times every generation and checks the prompt ids TRL built against ours."""

        def _generate_single_turn(self, prompt_ids, *a, **k):
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *a, **k)
            record["generate_s"].append(time.perf_counter() - t0)
            record["completion_tokens"].append(sum(len(c) for c in completion_ids))
            record["completions"].append(len(completion_ids))
            step = len(record["generate_s"]) - 1
            want = expected_ids[step * per_step:(step + 1) * per_step]
            got = [list(p) for p in prompt_ids]
            record["prompt_ids_match"].append(sorted(map(tuple, got)) == sorted(tuple(w) for w in want
                                                                                for _ in range(ro.group_size)))
            return completion_ids, logprobs

    class Clock(TrainerCallback):
        def on_train_begin(self, *_, **__):
            record["train_begin"] = time.time()

        def on_step_end(self, *_, **__):
            record["step_end"].append(time.time())

        def on_log(self, args, state, control, logs=None, **__):
            record["logs"].append(dict(logs or {}))

    record = {"generate_s": [], "completion_tokens": [], "completions": [], "prompt_ids_match": [], "step_end": [],
              "logs": [], "grpo_config": {k: v for k, v in grpo.items() if k != "output_dir"}}
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, spec.get("dtype", "bfloat16")))
    trainer = Timed(model=model, reward_funcs=[_reward(s.name) for s in cfg.rewards.functions],
                    args=GRPOConfig(**grpo), train_dataset=Dataset.from_dict(rows), processing_class=tokenizer,
                    callbacks=[Clock()])
    record["setup_s"] = time.time() - t0
    trainer.train()
    record["threads"] = torch.get_num_threads()
    if torch.cuda.is_available() and spec.get("device") == "cuda":
        record["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    Path(spec["out"]).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(json.loads(sys.argv[1]))
