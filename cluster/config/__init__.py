"""The run's configuration: the schema and its rules (schema), MLX-GRPO files translated into it (mlx_grpo), the GPU
and placement plan (plan), and the checks of the environment a config runs in (preflight)."""
