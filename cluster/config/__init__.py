"""The run's configuration: the schema (schema, with its sections in sections and training, their field types in
fields, the rules spanning fields in rules, error wording in errors), TOML in and out (tomlio), the field reference
docs/reference/config.md (reference), MLX-GRPO files translated into it (mlx_grpo), the GPU and placement plan
(plan), and the checks of the machine a config runs on (preflight)."""
