"""Run directory: effective config, metrics.jsonl, progress bar."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def to_toml(data: dict[str, Any]) -> str:
    """Write the effective config back as TOML (our schema: tables of scalars, lists of scalar tables)."""

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if v != v else ("inf" if v > 0 else "-inf")
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    out = []
    for section, fields in data.items():
        out.append(f"[{section}]")
        out += [f"{k} = {val(v)}" for k, v in fields.items()]
        out.append("")
    return "\n".join(out)


class RunLog:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, progress: bool = True):
        self.dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="grpo", unit="step", dynamic_ncols=True)

    def write(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def progress(self, m: dict[str, Any]) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix({
            "reward": f"{m['reward/mean']:.3f}", "kl": f"{m.get('loss/kl', 0.0):.4f}",
            "mismatch": f"{m.get('mismatch/kl_mu_old', 0.0):.4f}", "tok/s": f"{m['perf/gen_tokens_per_s']:.0f}",
        }, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
