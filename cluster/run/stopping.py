"""Stopping a run on request: Ctrl-C (SIGINT) and SIGTERM (what `timeout`, a scheduler or `ray job stop` send) are a
way to stop, not a crash.

The first signal asks the driver loop to stop at the next step boundary: the step in progress finishes and is logged,
is checkpointed if no checkpoint of it exists and one there is exact (a multiple of algo.update_every, when the
generators hold the checkpointed weights; elsewhere the latest earlier checkpoint stands), and the run closes as at its
end (rollouts flushed, actors and Ray shut down). `qgrpo train` then prints one line, `stop_line`, with the step
reached, the latest checkpoint and the command that resumes the run, and exits 130 (SIGINT) or 143 (SIGTERM). A
second signal exits at once with its own status, waiting for nothing; checkpoints are written atomically, so the run
directory still holds its last complete one, and the exit line says which one and how to resume from it, or that
there is none yet (`StopRequest.run_root`, set once the run directory exists; a URI run's is not listed from a handler,
which must not wait on the network).

The handlers only set a flag and write a line with os.write, so they cannot raise inside Ray: Ray runs Python's signal
handlers while it waits (ray.get and ray.wait check for signals), and a handler that returns lets the wait go on.
`ray.init` installs SIGTERM handlers of its own in the driver (the C++ core worker's prints a stack dump and aborts), so
`StopRequest.install` is called again once Ray is up; Python's `signal.signal` replaces the C-level handler too.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Callable

from qgrpo.cluster.rundir.checkpoint import complete_checkpoints
from qgrpo.core import storage

# imported now, not in the handler: an import there could wait on a lock the interrupted code holds
from qgrpo.core.invocation import qgrpo_command

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    """What a shell reports for a process a signal ended: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signum


def _say(line: str) -> None:
    """One line on stderr without Python's buffered stream, which a handler may interrupt in the middle of a write; on
    a terminal on a line of its own (after the progress bar and the ^C the terminal echoes)."""
    try:
        os.write(2, (("\n" if os.isatty(2) else "") + line + "\n").encode())
    except OSError:
        pass


class StopRequest:
    """Set by the first SIGINT or SIGTERM while its handlers are installed; the driver loop reads `requested` at step
    boundaries. `on_exit`: best-effort clean-up before a second signal's immediate exit (the Ray this process
    started). `run_root`: the run directory once it exists (None before), for what the second signal's line says."""

    who = "qgrpo"  # what its lines start with
    first = "stopping after the step in progress"  # what the first signal does

    def __init__(self):
        self.signum: int | None = None
        self.on_exit: Callable[[], None] | None = None
        self.run_root: Any = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def status(self) -> int:
        return exit_status(self.signum) if self.signum else 0

    def install(self) -> None:
        """Handle SIGINT and SIGTERM here (again: after `ray.init`, which replaces SIGTERM's handler). A signal the
        process was started with ignored (`nohup`, a background job of a script) stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            if s not in self._previous:
                self._previous[s] = signal.getsignal(s)
            if self._previous[s] is not signal.SIG_IGN:
                signal.signal(s, self._handle)

    def restore(self) -> None:
        """The handlers as they were before the first `install`."""
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @contextmanager
    def handling(self):
        self.install()
        try:
            yield self
        finally:
            self.restore()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
            _say(f"{self.who}: {name}: {self.first} ({again} to exit at once)")
            return
        left = self.left_behind()
        _say(f"{self.who}: {name} again: exiting at once" + (f" ({left})" if left else ""))
        try:
            if self.on_exit is not None:
                self.on_exit()
        finally:
            os._exit(exit_status(signum))

    def left_behind(self) -> str:
        """What an immediate exit leaves: no run directory yet, no checkpoint yet, or the last complete one and the
        command that resumes from it. Never raises (it runs in the signal handler)."""
        root = self.run_root
        if root is None:
            return "the run directory was not created yet; nothing was written"
        try:
            if storage.is_uri(root):
                return f"{root} keeps the checkpoints completed so far, if any"
            ckpts = complete_checkpoints(root)
            if not ckpts:
                return f"no checkpoint was written yet, so there is nothing to resume in {root}: start the run again"
            return (f"the run directory keeps its last complete checkpoint, {ckpts[-1][1]}; resume with: "
                    f"{qgrpo_command('train', '--resume', root)}")
        except Exception:  # noqa: BLE001 - a handler must not raise
            return f"{root} keeps the checkpoints completed so far, if any"


def local_ray_killer() -> Callable[[], None]:
    """For a second signal's exit when this process started Ray: SIGKILL every process under this one (Ray's head:
    GCS, raylet and its agents; the actors' workers). Left to themselves, the raylet's agents outlive a head killed
    at once (they try to report its death to the dead GCS). psutil (which Ray ships) is imported now, not in the
    handler."""
    import psutil

    def kill() -> None:
        try:
            for p in psutil.Process().children(recursive=True):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        except Exception:  # noqa: BLE001 - best-effort on the way out
            pass

    return kill


def stop_line(stop: StopRequest, step: int, steps: int, run_root, checkpoint) -> str:
    """What `qgrpo train` prints when a signal stopped the run: the step reached, the latest complete checkpoint
    (`checkpoint`, or None) and the command that resumes the run from it."""
    head = f"qgrpo: stopped at step {step} of {steps} ({stop.name})"
    if checkpoint is None:
        return f"{head}; no checkpoint was written yet, so there is nothing to resume: start the run again"
    return f"{head}; checkpoint {checkpoint} is the latest; resume with: {qgrpo_command('train', '--resume', run_root)}"
