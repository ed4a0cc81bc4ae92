"""Every rollout of a run as Parquet files under RUN_DIR/rollouts/, readable with pandas, DuckDB or pyarrow:
`pyarrow.parquet.read_table(run_dir / "rollouts")` reads them all as one table."""
from __future__ import annotations

from pathlib import Path

from qgrpo.core.records import GroupRollout

SCHEMA_FIELDS = ("step", "prompt_id", "prompt", "reference", "completion", "reward", "advantage", "finish_reason",
                 "num_tokens", "mean_logprob", "policy_version", "staleness", "precision", "generator_id")


class RolloutWriter:
    """Buffers rows and writes one file per `flush_every` steps (and at close), so a crash loses at most that many
    steps of samples and a long run does not produce thousands of tiny files."""

    def __init__(self, run_dir: Path, flush_every: int = 10):
        self.dir = run_dir / "rollouts"
        self.flush_every = flush_every
        self.rows: dict[str, list] = {k: [] for k in SCHEMA_FIELDS}
        self.first_step: int | None = None
        self.last_step: int | None = None

    def add(self, step: int, groups: list[GroupRollout], trained_from: int) -> None:
        """`trained_from`: the learner's policy version the step trained from; staleness = it - the sampler's."""
        for g in groups:
            for c, r, a in zip(g.completions, g.rewards, g.advantages, strict=True):
                row = (step, g.item.prompt_id, g.item.prompt, g.item.reference, c.text, r, a, c.finish_reason,
                       len(c.token_ids), sum(c.logprobs) / max(len(c.logprobs), 1), g.policy_version,
                       trained_from - g.policy_version, g.precision, g.generator_id)
                for k, v in zip(SCHEMA_FIELDS, row):
                    self.rows[k].append(v)
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        if (step - self.first_step + 1) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.first_step is None:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"steps_{self.first_step:06d}-{self.last_step:06d}.parquet"
        tmp = self.dir / f".{name}.tmp"
        pq.write_table(pa.table(self.rows), tmp)
        tmp.rename(self.dir / name)
        self.rows = {k: [] for k in SCHEMA_FIELDS}
        self.first_step = self.last_step = None

    close = flush
