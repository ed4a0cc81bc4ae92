"""Run directory: metrics.jsonl, TensorBoard / W&B, progress bar (the effective config is written by
cluster/config/tomlio.py).

The bar is drawn when run.progress is on and stderr is a terminal. Otherwise (run.progress = false, or stderr a file
or a pipe, as in a `ray job submit` log) every run.log_every steps, and at the last step, one plain line says the step,
the reward's mean, the loss, the accuracies there are and the seconds per step (`RunLog.plain_line`).

The progress bar owns the terminal's last line, redrawn in place. Whatever else this process writes while it is up (a
Python warning, Ray's copies of its actors' output, a line of this package) must not land inside it: while the bar
is shown, sys.stderr (and sys.stdout on a terminal) go through `_AboveBar`, which clears the bar before a line starts
and redraws it once the line is complete. The bar's ETA is tqdm's, from the steps measured in this process (a resumed
run's steps before its checkpoint are not counted as done in its time).
"""
from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path
from typing import Any

LOUD = ("warning", "reward_errors", "env_errors")  # events whose message is also printed on the terminal


class _AboveBar(io.TextIOBase):
    """A text stream that writes to `stream` above `bar`: the bar is cleared before a line's first character and
    redrawn after its newline, so that a line never starts inside the bar's."""

    def __init__(self, stream, bar):
        self.stream, self.bar = stream, bar
        self._line_start = True

    def write(self, s: str) -> int:
        if not s:
            return 0
        with self.bar.get_lock():
            if self._line_start:
                self.bar.clear()
            self.stream.write(s)
            self._line_start = s.endswith("\n")
            if self._line_start:
                self.stream.flush()
                self.bar.refresh()
        return len(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):
        return getattr(self.stream, "encoding", "utf-8")

    def __getattr__(self, name: str):  # what else a caller reads of a stream (buffer, errors, ...): the real one's
        return getattr(self.stream, name)


class RunLog:
    """metrics.jsonl always; TensorBoard event files when tensorboard is installed (run.tensorboard); Weights & Biases
    when run.wandb_project is set; a progress bar on the terminal."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int = 0, progress: bool = True,
                 tensorboard: bool = True, wandb_project: str = "", config: dict | None = None,
                 log_every: int | None = None, terminal: bool | None = None):
        self.dir = run_dir
        self.metrics_path = run_dir / "metrics.jsonl"
        self.bar = self.tb = self.wandb = None
        self._streams: dict[str, Any] = {}  # sys.stderr / sys.stdout as they were before the bar (module docstring)
        # without the bar (run.progress = false, or stderr a file or a pipe: a `ray job submit` log), a plain line
        # every run.log_every steps (`log_every`, else the config's)
        self.total, self.log_every = total_steps, log_every or (config or {}).get("run", {}).get("log_every") or 1
        self.held_out: tuple[int, float] | None = None  # the last held-out accuracy logged: (step, accuracy)
        self._since: list[float] = []  # the seconds of the steps since the last plain line
        self._clock = time.monotonic()
        if progress and (_isatty(sys.stderr) if terminal is None else terminal):
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="grpo", unit="step", dynamic_ncols=True,
                            file=sys.stderr)
            self._above_bar()
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
        if record.get("event") == "eval" and isinstance(record.get("accuracy"), (int, float)):
            self.held_out = (record.get("step", 0), record["accuracy"])
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

    def _above_bar(self) -> None:
        """sys.stderr, and sys.stdout when it shares the terminal, through `_AboveBar` while the bar is up."""
        for name in ("stderr", "stdout"):
            stream = getattr(sys, name)
            if name == "stdout" and not (_isatty(stream) and _isatty(self._streams["stderr"])):
                continue  # stdout to a file or a pipe: the bar's line is not in it
            self._streams[name] = stream
            setattr(sys, name, _AboveBar(stream, self.bar))

    def _restore_streams(self) -> None:
        for name, stream in self._streams.items():
            if isinstance(getattr(sys, name), _AboveBar):
                setattr(sys, name, stream)
        self._streams.clear()

    def say(self, line: str) -> None:
        """A line on stderr, on a line of its own above the progress bar, which is redrawn after it."""
        if self.bar is not None:
            self.bar.write(line, file=self._streams.get("stderr", sys.stderr))
        else:
            print(line, file=sys.stderr, flush=True)

    def progress(self, m: dict[str, Any]) -> None:
        """A step done: the bar moves, or without one, a plain line every log_every steps (`plain_line`)."""
        if self.bar is None:
            now = time.monotonic()
            self._since.append(m.get("time/step") or now - self._clock)
            self._clock = now
            step = m.get("step")
            if isinstance(step, int) and (step % self.log_every == 0 or step == self.total):
                self.say(self.plain_line(m))
                self._since = []
            return
        post = {"reward": f"{m['reward/mean']:.3f}"}
        if "train/accuracy" in m:
            post["acc"] = f"{m['train/accuracy']:.2f}"
        post.update({"kl": f"{m.get('loss/kl', 0.0):.4f}", "mismatch": f"{m.get('mismatch/kl_mu_old', 0.0):.4f}",
                     "tok/s": f"{m['perf/gen_tokens_per_s']:.0f}"})
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def plain_line(self, m: dict[str, Any]) -> str:
        """One step as a line, as TRL and verl log without a bar: the step, the reward's mean, the loss, the sample's
        accuracy and the last held-out accuracy where there are, the seconds per step since the last line."""
        parts = [f"qgrpo: step {m.get('step')}/{self.total}"]
        for key, name, fmt in (("reward/mean", "reward", ".3f"), ("loss/total", "loss", ".4f"),
                               ("train/accuracy", "accuracy", ".2f")):
            if isinstance(m.get(key), (int, float)):
                parts.append(f"{name} {m[key]:{fmt}}")
        if self.held_out is not None:
            parts.append(f"held-out {self.held_out[1]:.2f} (step {self.held_out[0]})")
        if self._since:
            per = sum(self._since) / len(self._since)
            parts.append(f"{per:.1f} s/step")
        return "  ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self._restore_streams()
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False
