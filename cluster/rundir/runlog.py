"""Run directory: metrics.jsonl, TensorBoard / W&B, progress bar (the effective config is written by
cluster/config/tomlio.py)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

LOUD = ("warning", "reward_errors")  # events whose message is also printed on the terminal


class RunLog:
    """metrics.jsonl always; TensorBoard event files when tensorboard is installed (run.tensorboard); Weights & Biases
    when run.wandb_project is set; a progress bar on the terminal."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, wandb_project: str = "", config: dict | None = None):
        self.dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.bar = self.tb = self.wandb = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="grpo", unit="step", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional: pip install tensorboard
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1 or None)
        if wandb_project:
            import wandb  # checked at config time

            self.wandb = wandb.init(project=wandb_project, name=run_dir.name, config=config, resume="allow",
                                    id=run_dir.name.replace("/", "-"))

    def write(self, record: dict[str, Any]) -> None:
        """A line of metrics.jsonl (scalars of a step also to TensorBoard / W&B); a warning is also printed."""
        record = {"time": time.time(), **record}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if record.get("event") in LOUD and record.get("message"):
            message = record["message"].removeprefix("warning: ")
            self.say(f"qgrpo: warning: step {record.get('step', '?')}: {message}")
        step = record.get("step")
        if step is None:
            return
        scalars = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def say(self, line: str) -> None:
        """A line on stderr, above the progress bar."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def progress(self, m: dict[str, Any]) -> None:
        if self.bar is None:
            return
        post = {"reward": f"{m['reward/mean']:.3f}"}
        if "train/accuracy" in m:
            post["acc"] = f"{m['train/accuracy']:.2f}"
        post.update({"kl": f"{m.get('loss/kl', 0.0):.4f}", "mismatch": f"{m.get('mismatch/kl_mu_old', 0.0):.4f}",
                     "tok/s": f"{m['perf/gen_tokens_per_s']:.0f}"})
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
