"""A real multi-node Ray cluster on this machine, started with the `ray start` command line as a user would, on free
ports, and stopped by killing only its own processes (never `ray stop`, which stops every Ray on the host).

Ray 2.60 turns token authentication on for a head when a token exists (~/.ray/auth_token, which a local `ray.init()`
creates), and then every node and client must present it. The cluster here always runs with a token of its own:
`client_env()` is what a process needs to talk to it (RAY_AUTH_TOKEN; plus RAY_AUTH_MODE=token for the nodes).

Each node has a temp dir of its own, as on separate hosts. Nodes sharing one would share its runtime_resources/ folder,
and Ray's runtime-env agent (one per node) deletes and re-extracts a job's working_dir there the first time one of its
own workers needs it: workers of other nodes already running in that folder lost their current directory, and those
that import torch then died at start ("Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so", exit code 2)."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

RAY = str(Path(os.sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, num_cpus: int = 1, resources: dict | None = None, dashboard: bool = False):
        self.token = secrets.token_hex(16)
        # Unix socket paths must stay under 108 characters: a short folder of its own.
        self.temp_dir = tempfile.mkdtemp(prefix="qgrpo-ray-", dir="/tmp")
        self.node_dirs = [self.temp_dir]
        self.dashboard = f"http://127.0.0.1:{free_port()}" if dashboard else None
        port = free_port()
        args = ["--head", f"--port={port}", "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}",
                f"--ray-client-server-port={free_port()}", *self._node_ports()]
        if dashboard:
            args += ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                     f"--dashboard-port={self.dashboard.rsplit(':', 1)[1]}"]
        else:
            args += ["--include-dashboard=false"]
        self._start(args, num_cpus, resources)
        self.address = f"127.0.0.1:{port}"

    @staticmethod
    def _node_ports() -> list[str]:
        """Every per-node port that has a fixed default, so that several nodes coexist on one host."""
        return [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]

    def _start(self, args: list[str], num_cpus: int, resources: dict | None, labels: dict | None = None) -> None:
        args = [RAY, "start", *args, f"--num-cpus={num_cpus}", "--disable-usage-stats"]
        if resources:
            args.append(f"--resources={json.dumps(resources)}")
        if labels:
            args.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        env = {**self.client_env(), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
        r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")

    def client_env(self) -> dict[str, str]:
        return {**os.environ, "RAY_AUTH_TOKEN": self.token}

    def add_node(self, num_cpus: int = 1, resources: dict | None = None, labels: dict | None = None) -> None:
        self.node_dirs.append(tempfile.mkdtemp(prefix="qgrpo-ray-", dir="/tmp"))
        self._start([f"--address={self.address}", "--node-ip-address=127.0.0.1", f"--temp-dir={self.node_dirs[-1]}",
                     *self._node_ports()], num_cpus, resources, labels)

    def wait_nodes(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = subprocess.run([RAY, "status", f"--address={self.address}"], capture_output=True, text=True,
                               env={**self.client_env(), "RAY_AUTH_MODE": "token"})
            if r.stdout.count(" node_") >= n:
                return
            time.sleep(1)
        raise RuntimeError(f"the cluster did not reach {n} nodes:\n{r.stdout}\n{r.stderr}")

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: every process whose command line names one of its temp dirs, and their
        children."""
        found: set[psutil.Process] = set()
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(d in a for a in p.info["cmdline"] or () for d in self.node_dirs):
                    found.add(p)
                    found.update(p.children(recursive=True))
            except psutil.Error:
                pass
        return list(found)

    def worker_logs(self, text: str, lines: int = 40) -> str:
        """What Ray's logs say of every worker process `text` names (Ray's "pid: N" in an actor's death notice): its
        own stderr, and the lines of every node's logs (raylet.out: why it was killed) that name the pid or report an
        error. A worker that died in native code, or was killed, says why only there."""
        out = []
        for pid in sorted(set(re.findall(r"pid: (\d+)", text))):
            for f in sorted(f for d in self.node_dirs for f in Path(d).glob("session_*/logs/*")):
                if not f.is_file() or f.name.startswith("events"):
                    continue
                own = pid in f.name and f.suffix in (".err", ".out")
                hits = [ln for ln in f.read_text(errors="replace").splitlines()
                        if own or pid in ln or (f.name.startswith("raylet") and " E " in ln)]
                if hits:
                    out.append(f"--- {f.name}\n" + "\n".join(hits[-lines:]))
        return "\n".join(out) or "(no Ray log names the pids in the output)"

    def stop(self) -> None:
        procs = self.processes()
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        for d in self.node_dirs:
            shutil.rmtree(d, ignore_errors=True)
