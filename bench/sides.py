"""One side of a comparison bench (bench/vs_trl.py, bench/default_job.py) run in a process of its own under a memory
sampler: `run_side` starts the command and `MemorySampler` sums the RSS and PSS of its whole process tree, per role
(`role`); `side_env` is the environment every side gets, `versions` what the results record of the software.

bench/vs_trl.py's docstring says how the memory is sampled and what the numbers mean.
"""
from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GB = 2**30
# Process titles Ray gives actor processes -> role; other processes are told apart by `role`.
# The rollout actor's class is _RolloutActor (actors/rollout_actor.py); before it was listed here its processes were
# counted as "ray system" (bench/published/ results up to gpu_step_h200*.json).
# Ray titles an actor's process with its class's name: the rollout actor's is _ThreadedRolloutActor (its concurrency
# groups' subclass, actors/rollout_actor.py), which the earlier prefixes missed, counting it as "ray system".
ACTOR_ROLES = (("ray::LearnerActor", "learner"), ("ray::RolloutActor", "rollout"), ("ray::_RolloutActor", "rollout"),
               ("ray::_ThreadedRolloutActor", "rollout"), ("ray::ReferenceActor", "reference"))
PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "deepspeed", "ray", "reasoning-gym", "psutil")


def role(cmdline: list[str], pid: int, root: int) -> str:
    if pid == root:
        return "driver"
    cmd = " ".join(cmdline)
    for prefix, name in ACTOR_ROLES:
        if cmd.startswith(prefix):
            return name
    if cmd.startswith("ray::IDLE"):
        return "ray idle workers"
    # Ray's own: its agents (ray::DashboardAgent, ...), gcs_server, raylet and helpers, all run from the ray package
    return "ray system" if cmd.startswith("ray::") or "/ray/" in cmd else "other"


class MemorySampler(threading.Thread):
    """Sums over process `pid` and all its descendants: RSS every `interval` s, PSS every `pss_every`-th sample;
    peaks of the sums, per role and per pid. PSS is read from /proc/PID/smaps_rollup, for which the kernel walks the
    page tables (~0.1 s for a 5 GB process here): read at every sample it took a sixth of a core on this 2-core
    machine, so PSS is sampled less often (peaks shorter than that may be missed) and the thread's own CPU time is
    reported."""

    def __init__(self, pid: int, interval: float = 0.5, pss_every: int = 6, gpu: bool = False):
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.pid, self.interval, self.pss_every = psutil, pid, interval, pss_every
        self.stop, self.series = threading.Event(), []  # series: (time, rss sum, pss sum or None)
        self.roles: dict[int, str] = {}  # pid -> role (an actor keeps its role once its title shows it)
        self.pid_peak: dict[int, list[int]] = {}  # pid -> [rss, pss] peaks
        self.role_peak: dict[str, list[int]] = {}  # role -> [rss, pss] peaks of the role's sums
        self.session, self.unowned = "", set()  # our Ray session folder; processes naming it outside our tree
        self.cpu_s = 0.0  # this thread's own CPU time
        self.tree_cpu: dict[int, float] = {}  # pid -> CPU seconds (user + system) when last seen
        self.machine_busy = busy_seconds(psutil)  # to tell how much CPU other jobs took meanwhile (`others_cores`)
        self.t0, self.load_start = time.time(), os.getloadavg()[0]
        # gpu: nvidia-smi's memory per process (pid -> peak MiB; a process in another PID namespace, as in some
        # containers, is not ours to name: it counts only in the device's total) and the device's used memory
        self.gpu, self.gpu_pid_peak, self.gpu_used_peak, self.gpu_used_start, self.gpu_error = gpu, {}, 0, None, None

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.thread_time()
            self.sample()
            self.cpu_s += time.thread_time() - t0
            self.stop.wait(self.interval)

    def sample(self) -> None:
        ps = self.psutil
        try:
            root = ps.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except ps.NoSuchProcess:
            return
        full = len(self.series) % self.pss_every == 0
        t, rss, pss, by_role, ours = time.time(), 0, 0, {}, set()
        for p in procs:
            try:
                mem, cmd = (p.memory_full_info() if full else p.memory_info()), p.cmdline()
            except (ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess):
                continue
            ours.add(p.pid)
            with contextlib.suppress(ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess):
                cpu = p.cpu_times()
                self.tree_cpu[p.pid] = cpu.user + cpu.system
            if self.roles.get(p.pid) not in dict(ACTOR_ROLES).values():
                self.roles[p.pid] = role(cmd, p.pid, self.pid)
            mem_pss = mem.pss if full else 0
            rss, pss = rss + mem.rss, pss + mem_pss
            agg = by_role.setdefault(self.roles[p.pid], [0, 0])
            agg[0], agg[1] = agg[0] + mem.rss, agg[1] + mem_pss
            peak = self.pid_peak.setdefault(p.pid, [0, 0])
            peak[0], peak[1] = max(peak[0], mem.rss), max(peak[1], mem_pss)
            if not self.session:
                self.session = next((a.split("/sockets/")[0].rsplit("/", 1)[-1] for a in cmd
                                     if "session_" in a and "/sockets/" in a), "")
        for r, (a, b) in by_role.items():
            peak = self.role_peak.setdefault(r, [0, 0])
            peak[0], peak[1] = max(peak[0], a), max(peak[1], b)
        self.series.append((t, rss, pss if full else None))
        if self.gpu:
            self.sample_gpu()
        if self.session and len(self.series) % 10 == 1:  # every ~5 s: Ray processes of our session outside our tree
            for p in ps.process_iter(["pid", "cmdline"]):
                if p.info["pid"] not in ours and any(self.session in a for a in p.info["cmdline"] or ()):
                    self.unowned.add(p.info["pid"])

    def sample_gpu(self) -> None:
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                   "nounits"], capture_output=True, text=True, timeout=10).stdout
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as e:
            self.gpu, self.gpu_error = False, f"{type(e).__name__}: {e}"
            return
        for line in apps.splitlines():
            pid, _, mib = line.partition(",")
            if pid.strip().isdigit() and mib.strip().isdigit():
                p = int(pid)
                self.gpu_pid_peak[p] = max(self.gpu_pid_peak.get(p, 0), int(mib))
        total = sum(int(x) for x in used.split() if x.strip().isdigit())
        if self.gpu_used_start is None:
            self.gpu_used_start = total
        self.gpu_used_peak = max(self.gpu_used_peak, total)

    def gpu_result(self) -> dict:
        """Peak GPU memory (MiB) per role (processes of the side's tree that nvidia-smi named), and the device's used
        memory: its peak, and at the first sample (before the side had touched the GPU, or other jobs' share)."""
        per_role: dict[str, int] = {}
        for pid, mib in self.gpu_pid_peak.items():
            if pid in self.roles:
                per_role[self.roles[pid]] = per_role.get(self.roles[pid], 0) + mib
        return {"per_role_peak_mib": per_role, "device_used_peak_mib": self.gpu_used_peak,
                "device_used_start_mib": self.gpu_used_start,
                "unnamed_pids": sorted(p for p in self.gpu_pid_peak if p not in self.roles), "error": self.gpu_error}

    def finish(self) -> None:
        """Once the side has exited: the CPU other jobs used meanwhile, in cores on average (machine busy time minus
        this side's processes and this sampler; ~0 on a quiet machine, up to the core count when something else
        saturates it)."""
        wall = time.time() - self.t0
        others = busy_seconds(self.psutil) - self.machine_busy - sum(self.tree_cpu.values()) - self.cpu_s
        self.others_cores, self.load_end = max(others, 0.0) / wall, os.getloadavg()[0]

    def result(self, windows: dict[str, tuple[float, float]]) -> dict:
        def peak(k, a=0.0, b=float("inf")):
            return max((s[k] for s in self.series if a <= s[0] <= b and s[k] is not None), default=0)

        per_pid = {}
        for pid, (r, p) in self.pid_peak.items():
            per_pid.setdefault(self.roles[pid], []).append({"pid": pid, "rss": r, "pss": p})
        return {"peak_rss": peak(1), "peak_pss": peak(2),
                "peak_in": {name: {"rss": peak(1, a, b), "pss": peak(2, a, b)} for name, (a, b) in windows.items()},
                "per_role_peak": {r: {"rss": a, "pss": b, "processes": len(per_pid.get(r, []))}
                                  for r, (a, b) in self.role_peak.items()},
                "per_process_peak": per_pid, "ray_session": self.session, "unowned_ray_processes": sorted(self.unowned),
                **({"gpu": self.gpu_result()} if self.gpu or self.gpu_error else {}),
                "samples": len(self.series), "interval_s": self.interval, "pss_every": self.pss_every,
                "sampler_cpu_s": round(self.cpu_s, 1), "tree_cpu_s": round(sum(self.tree_cpu.values()), 1),
                "others_cores": round(self.others_cores, 2), "load_avg": [self.load_start, self.load_end],
                "series": [(round(t, 2), round(a / 2**20), None if b is None else round(b / 2**20))
                           for t, a, b in self.series]}


def busy_seconds(psutil) -> float:
    """CPU seconds the machine has spent busy since boot, all cores."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


def run_side(cmd: list[str], env: dict, log: Path, timeout_s: float,
             gpu: bool = False) -> tuple[int, MemorySampler, float]:
    """Run one side to completion under the memory sampler (`gpu`: GPU memory too); on timeout or Ctrl-C stop it
    and every descendant."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        sampler = MemorySampler(proc.pid, gpu=gpu)
        sampler.start()
        t0 = time.time()
        try:
            rc = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as e:
            stop_tree(proc, sampler)
            if isinstance(e, KeyboardInterrupt):
                raise
            rc = -1
            print(f"  timed out after {timeout_s:.0f} s (see {log})", file=sys.stderr)
        sampler.stop.set()
        sampler.join()
        sampler.finish()
    return rc, sampler, time.time() - t0


def stop_tree(proc: subprocess.Popen, sampler: MemorySampler) -> None:
    """SIGINT first (our CLI shuts its Ray down in a `finally`), then SIGKILL to whatever of the tree is left, by
    pid."""
    ps = sampler.psutil
    try:
        tree = [ps.Process(proc.pid), *ps.Process(proc.pid).children(recursive=True)]
    except ps.NoSuchProcess:
        tree = []
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for p in tree:
        with contextlib.suppress(ps.NoSuchProcess):
            p.kill()
    proc.wait()


def side_env(threads: int = 0) -> dict:
    from qgrpo.actors.common import thread_env

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    # the project first, then what the caller's path already had (a machine whose packages live there: the GPU kit)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    if threads:
        env.update(thread_env(threads))
    return env


def versions() -> dict:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    def git(*a) -> str:  # "" outside a checkout (the GPU kit's copy of the tree) or without git
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""
    head = git("rev-parse", "HEAD")
    # a copy of the tree outside its checkout (the GPU kit) is told its commit by QGRPO_COMMIT
    out["qgrpo_commit"] = (head + (" (dirty)" if git("status", "--porcelain", "--", ".") else "") if head
                           else os.environ.get("QGRPO_COMMIT", ""))
    return out


def machine() -> str:
    """The CPU in words (model, cores, native bf16 / AMX) and whether a GPU was there."""
    flags, model = set(), platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    native = ", ".join(x for x in ("avx512_bf16", "amx_bf16") if x in flags) or "no native bf16"
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except Exception:
        gpu = "no GPU"
    return f"{os.cpu_count()}-core {model} ({native}{'' if 'amx_bf16' in flags else ', no AMX'}), {gpu}"
