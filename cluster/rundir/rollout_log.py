"""Every rollout of a run as Parquet files under RUN_DIR/rollouts/, readable with pandas, DuckDB or pyarrow:
`pyarrow.parquet.read_table(run_dir / "rollouts")` reads them all as one table.

A multi-turn trajectory (rollout/episodes.py) is one row: `completion` is its last model turn, `num_tokens` and
`mean_logprob` count the model's tokens only, and `turns` holds its turns as JSON ([{"role", "content", "start",
"end", "tool_calls", "error"}, ...]; null for a single-turn completion).

Besides SCHEMA_FIELDS, each reward entry's own score (GroupRollout.scores: unweighted, before reward shaping) is a
float column `reward_LABEL` (`score_column`), null where the entry returned None or its call failed. The entries
are fixed for a run, so every file of a run (a resumed one's included) has the same columns."""
from __future__ import annotations

import json
import re
from pathlib import Path

from qgrpo.core.records import GroupRollout

SCHEMA_FIELDS = ("step", "prompt_id", "prompt", "reference", "completion", "reward", "advantage", "finish_reason",
                 "num_tokens", "mean_logprob", "policy_version", "staleness", "last_version", "precision",
                 "generator_id", "turns")


def score_column(label: str) -> str:
    """The column of a reward entry's scores: "reward_" + its label, every character other than a letter, a digit or
    "_" made "_", so pandas (df.reward_answer_correct) and DuckDB (SELECT reward_answer_correct) take it unquoted."""
    return "reward_" + re.sub(r"[^0-9A-Za-z_]", "_", label)


class RolloutWriter:
    """Buffers rows and writes one file per `flush_every` steps (and at close), so a crash loses at most that many
    steps of samples and a long run does not produce thousands of tiny files."""

    def __init__(self, run_dir: Path, flush_every: int = 10):
        self.dir = run_dir / "rollouts"
        self.flush_every = flush_every
        self.rows: dict[str, list] = {k: [] for k in SCHEMA_FIELDS}
        self.scores: dict[str, list] = {}  # score_column(label) -> one value per row
        self.first_step: int | None = None
        self.last_step: int | None = None

    def add(self, step: int, groups: list[GroupRollout], trained_from: int) -> None:
        """`trained_from`: the learner's policy version the step trained from; staleness = it - the sampler's
        (policy_version: the version of the completion's first token; last_version: of its last, a later one where
        a weight update landed while it was generated, Completion.token_versions)."""
        for g in groups:
            for c, r, a in zip(g.completions, g.rewards, g.advantages, strict=True):
                mask, n = c.mask(), c.model_tokens
                row = (step, g.item.prompt_id, g.item.prompt, g.item.reference, c.text, r, a, c.finish_reason,
                       n, sum(lp for lp, m in zip(c.logprobs, mask) if m) / max(n, 1), g.policy_version,
                       trained_from - g.policy_version, c.versions(g.policy_version)[-1] if c.token_ids else
                       g.policy_version, g.precision, g.generator_id,
                       json.dumps(c.turns) if c.multi_turn else None)
                for k, v in zip(SCHEMA_FIELDS, row):
                    self.rows[k].append(v)
            self._add_scores(g)
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        if (step - self.first_step + 1) >= self.flush_every:
            self.flush()

    def _add_scores(self, g: GroupRollout) -> None:
        """The group's per-entry scores; a column first seen now is null for the rows before, one the group lacks is
        null for its rows (every column keeps one value per row)."""
        n, before = len(g.completions), len(self.rows["step"]) - len(g.completions)
        got: dict[str, list] = {}
        for label, values in g.scores.items():  # labels are unique; two that read alike get _2, _3, ... in order
            column = base = score_column(label)
            while column in got:
                column = f"{base}_{int(column[len(base) + 1:] or 1) + 1}"
            got[column] = values
        for column in got:
            if column not in self.scores:
                self.scores[column] = [None] * before
        for column, values in self.scores.items():
            values.extend(got.get(column) or [None] * n)

    def flush(self) -> None:
        if self.first_step is None:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"steps_{self.first_step:06d}-{self.last_step:06d}.parquet"
        tmp = self.dir / f".{name}.tmp"
        rows = {**self.rows, "turns": pa.array(self.rows["turns"], pa.string())}  # typed, also when all null
        table = pa.table({**rows, **{k: pa.array(v, pa.float64()) for k, v in self.scores.items()}})
        pq.write_table(table, tmp)
        tmp.rename(self.dir / name)
        self.rows = {k: [] for k in SCHEMA_FIELDS}
        self.scores = {}
        self.first_step = self.last_step = None

    close = flush
