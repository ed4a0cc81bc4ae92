"""What is optimised, in one place (pure functions and records; no Ray, no config):

    settings.py     ObjectiveSettings: the [algo] record (the config generates [algo] from its knobs, knobs.py), and
                    objective_settings(**keys) to build it from [algo]'s flat keys
    options.py      the choices (advantage scales, KL estimators, aggregations, correction levels and modes)
    rules.py        combinations of [algo] keys the config refuses
    advantages.py   group-relative advantages (GRPO, Dr. GRPO), and the groups with theirs
    shaping.py      DAPO's overlong shaping of rewards, and which completions its overlong filter leaves out
    groups.py       which groups a step keeps under DAPO's dynamic sampling, and how many prompts a round draws
    losses.py       the registry of policy losses (GRPO, GSPO, CISPO, SAPO), each a function and its parameters
    corrections.py  the sampler/learner mismatch correction, the off-policy sequence mask, the top-entropy mask
    loss.py         the loss: the policy term, corrections and masks, the KL term and entropy, aggregated

A new policy loss is one function and one `register_loss` entry in losses.py (docs/algorithms.md, "Adding a policy
loss"). Importing this package does not import torch: settings, knobs, options, rules and the registry are torch-free.
"""
