"""`qgrpo submit` without a cluster: `submit(args)` with `subprocess.call` replaced, so no ray CLI runs, and a tiny HTTP
server on 127.0.0.1 standing in for the dashboard's /api/version (nothing else is contacted).

- Without --python, the job's interpreter is the one cluster/ray_cluster.yaml installs on the nodes; a different
  interpreter here is refused in one line naming both paths; --python is used as given.
- A config outside the project, or files it names from outside it, are uploaded in a staging copy of the project
  under _submitted/, with --set overrides; the user's config is untouched and the copy is gone afterwards. A config
  naming nothing outside keeps the project folder as the working directory; a local model above UPLOAD_MAX is not
  uploaded (a note says so).
- An unreachable dashboard (a closed port) or a ray:// address is one line and exit 2, before any ray CLI runs."""
import argparse
import json
import re
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import qgrpo.cluster.cli.submit as sub

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
CLUSTER_PY = "/home/ubuntu/qgrpo/.venv/bin/python"  # ~/qgrpo of cluster/ray_cluster.yaml's file_mounts


class _Dashboard(BaseHTTPRequestHandler):
    status = 200  # what /api/version answers (the class attribute is set per server)

    def do_GET(self):
        code = self.status if self.path == "/api/version" else 404
        body = json.dumps({"version": "4", "ray_version": "2.60.0"}).encode() if code == 200 else b"no"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # quiet
        pass


def _serve(status: int = 200):
    handler = type("Handler", (_Dashboard,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def dashboard():
    server, url = _serve()
    yield url
    server.shutdown()
    server.server_close()


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 that was bound and closed again: nothing listens there."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(autouse=True)
def _local_only(monkeypatch, tmp_path):
    """No proxy between the probe and 127.0.0.1, no auth token of this machine, no real `ray job submit`."""
    for var in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "RAY_AUTH_TOKEN",
                "RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "no-token"))
    calls = []

    def fake_call(argv, env=None):
        runtime_env = json.loads(argv[argv.index("--runtime-env-json") + 1])
        wd = Path(runtime_env["working_dir"])
        # what the upload would hold, seen while `ray job submit` runs (the staging copy is deleted afterwards)
        files = {} if wd == ROOT else {p.relative_to(wd).as_posix(): p.read_bytes() for p in wd.rglob("*")
                                       if p.is_file()}
        calls.append({"argv": argv, "runtime_env": runtime_env, "files": files})
        return 0

    monkeypatch.setattr(sub.subprocess, "call", fake_call)
    return calls


def _args(config, address, *overrides, python=sys.executable, no_wait=False):
    return argparse.Namespace(config=str(config), overrides=list(overrides), address=address, python=python, env=[],
                              submission_id="qgrpo-test", no_wait=no_wait)


def _entry(argv: list[str]) -> tuple[str, dict[str, str]]:
    """(the config the job trains, its --set overrides as {field: value})."""
    entry = argv[argv.index("--") + 1:]
    sets = [entry[i + 1] for i, a in enumerate(entry) if a == "--set"]
    return entry[entry.index("train") + 1], dict(s.split("=", 1) for s in sets)


def _jsonl(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(rows)))
    return path


def _with_task(task: str) -> str:
    """configs/tiny.toml with its [task] table replaced."""
    text = TINY.read_text()
    before, after = text.split("\n[task]\n", 1)
    return f"{before}\n[task]\n{task}\n\n[{after.split(chr(10) + '[', 1)[1]}"


def test_without_python_the_clusters_interpreter_is_required(dashboard, monkeypatch, capsys, _local_only):
    # This interpreter (the test's .venv) is not the one cluster/ray_cluster.yaml installs on the nodes: refused.
    assert sub.submit(_args(TINY, dashboard, python=None)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert sub.yaml_python() == CLUSTER_PY
    assert sys.executable in line and f"--python {CLUSTER_PY}" in line and "which python" in line
    assert _local_only == []
    # Submitting from the head's own checkout: that interpreter is the cluster's, so it is the job's.
    monkeypatch.setattr(sub.sys, "executable", CLUSTER_PY)
    assert sub.submit(_args(TINY, dashboard, python=None)) == 0
    assert _local_only[-1]["runtime_env"]["py_executable"] == CLUSTER_PY
    # An explicit --python is used as given, and said.
    assert sub.submit(_args(TINY, dashboard, python="/opt/env/bin/python")) == 0
    call = _local_only[-1]
    assert call["runtime_env"]["py_executable"] == "/opt/env/bin/python"
    assert call["argv"][call["argv"].index("--") + 1] == "/opt/env/bin/python"
    assert "the job and its actors run /opt/env/bin/python (--python)" in capsys.readouterr().err


def test_config_outside_the_project_is_uploaded_with_its_data(dashboard, tmp_path, monkeypatch, capsys, _local_only):
    monkeypatch.chdir(tmp_path)  # the user's folder: the config names its data relative to it
    (tmp_path / "data").mkdir()
    train, held = _jsonl(tmp_path / "data" / "train.jsonl", 20), _jsonl(tmp_path / "data" / "held.jsonl", 8)
    cfg = tmp_path / "mine.toml"
    cfg.write_text(_with_task('name = "jsonl"\npath = "data/train.jsonl"\neval_path = "data/held.jsonl"\n'
                              "eval_size = 4"))
    before = cfg.read_bytes()
    assert sub.submit(_args(cfg, dashboard, "run.output_dir='/shared/runs'", no_wait=True)) == 0
    (call,) = _local_only
    wd = Path(call["runtime_env"]["working_dir"])
    assert wd != ROOT and "excludes" not in call["runtime_env"]  # a staged copy, filtered already
    files = call["files"]
    # the project tree without what EXCLUDES leaves out, plus _submitted/
    assert {"cluster/cli/submit.py", "cluster/cli/app.py", "configs/tiny.toml", "pyproject.toml"} <= set(files)
    assert not any(f.split("/")[0] in (".venv", ".git", "runs", ".cache") or "__pycache__" in f for f in files)
    assert files["_submitted/mine.toml"] == before
    assert files["_submitted/task.path/train.jsonl"] == train.read_bytes()
    assert files["_submitted/task.eval_path/held.jsonl"] == held.read_bytes()
    config, sets = _entry(call["argv"])
    assert config == "_submitted/mine.toml"
    assert sets["task.path"] == '"_submitted/task.path/train.jsonl"'
    assert sets["task.eval_path"] == '"_submitted/task.eval_path/held.jsonl"'
    assert sets["run.output_dir"] == "'/shared/runs'" and "--no-wait" in call["argv"]
    err = capsys.readouterr().err
    assert f"task.path '{tmp_path / 'data' / 'train.jsonl'}' is uploaded with the job" in err  # read next to mine.toml
    assert cfg.read_bytes() == before  # the user's config is never rewritten
    assert not wd.exists()  # the staging copy is gone once `ray job submit` returned


def test_project_config_is_staged_only_when_it_names_files_outside(dashboard, tmp_path, _local_only):
    # Everything inside the project: the project folder itself is the working directory, nothing staged.
    assert sub.submit(_args(TINY, dashboard)) == 0
    call = _local_only[-1]
    assert call["runtime_env"]["working_dir"] == str(ROOT) and call["runtime_env"]["excludes"] == sub.EXCLUDES
    assert _entry(call["argv"])[0] == "configs/tiny.toml"
    # The same config with a dataset from elsewhere: staged, the config under _submitted/ beside the data.
    data = _jsonl(tmp_path / "sums.jsonl", 20)
    assert sub.submit(_args(TINY, dashboard, "task.name=jsonl", f"task.path='{data}'", "task.eval_size=4")) == 0
    call = _local_only[-1]
    wd = Path(call["runtime_env"]["working_dir"])
    assert wd != ROOT and not wd.exists()
    assert call["files"]["_submitted/task.path/sums.jsonl"] == data.read_bytes()
    assert call["files"]["_submitted/tiny.toml"] == TINY.read_bytes()
    config, sets = _entry(call["argv"])
    assert config == "_submitted/tiny.toml" and sets["task.path"] == '"_submitted/task.path/sums.jsonl"'


def test_local_model_folder_is_uploaded_unless_too_large(dashboard, tmp_path, monkeypatch, capsys, _local_only):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    assert sub.submit(_args(TINY, dashboard, f"model.path='{model}'")) == 0
    call = _local_only[-1]
    assert call["files"]["_submitted/model.path/my-model/model.safetensors"] == b"\0" * 4096
    assert _entry(call["argv"])[1]["model.path"] == '"_submitted/model.path/my-model"'
    # Above UPLOAD_MAX: not uploaded, left to the nodes, and said; nothing else to stage.
    monkeypatch.setattr(sub, "UPLOAD_MAX", 1024)
    capsys.readouterr()
    assert sub.submit(_args(TINY, dashboard, f"model.path='{model}'")) == 0
    call = _local_only[-1]
    assert call["runtime_env"]["working_dir"] == str(ROOT)
    assert _entry(call["argv"])[1]["model.path"] == f"'{model}'"  # as the user gave it
    assert re.search(r"model\.path .*my-model.* NOT uploaded; every node must have it", capsys.readouterr().err)


def test_unreachable_dashboard_is_one_line(closed_port, tmp_path, capsys, _local_only):
    address = f"http://127.0.0.1:{closed_port}"
    assert sub.submit(_args(TINY, address)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"qgrpo submit: cannot reach the Ray dashboard at {address} (")
    assert line.endswith("ssh -L 8265:localhost:8265), and is the address http://HOST:8265?")
    assert _local_only == []  # no ray CLI ran
    # staged or not, nothing is left behind: a config from elsewhere was copied before the probe
    cfg = tmp_path / "mine.toml"
    cfg.write_text(TINY.read_text())
    staged = set(Path(sub.tempfile.gettempdir()).glob("qgrpo-submit-*"))
    assert sub.submit(_args(cfg, address)) == 2 and _local_only == []
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert set(Path(sub.tempfile.gettempdir()).glob("qgrpo-submit-*")) == staged
    # ray:// is the Ray Client protocol, not the job API
    assert sub.submit(_args(TINY, "ray://127.0.0.1:10001")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "ray://" in line and "http://HEAD:8265" in line and _local_only == []


def test_probe(dashboard, closed_port, monkeypatch, tmp_path):
    assert sub.probe(dashboard) is None
    assert sub.probe(dashboard.removeprefix("http://") + "/") is None  # no scheme: http
    assert "Connection refused" in sub.probe(f"127.0.0.1:{closed_port}")
    for status, reason in ((404, "HTTP 404"), (500, "HTTP 500")):
        server, url = _serve(status)
        try:
            assert f"cannot reach the Ray dashboard at {url} ({reason}" in sub.probe(url)
        finally:
            server.shutdown()
            server.server_close()
    # a dashboard with token authentication answers 401 without the token: reachable when a token is found here
    server, url = _serve(401)
    try:
        assert "wants an auth token (HTTP 401)" in sub.probe(url)
        monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
        assert sub.probe(url) is None
    finally:
        server.shutdown()
        server.server_close()
