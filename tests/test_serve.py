"""`qgrpo serve CONFIG|CHECKPOINT` (cluster/cli/serve.py): the run's endpoint over rollout actors on a local Ray, with
no run. One served process answers each route (chat, completions, vLLM's token-in generate, the model list) with the
token ids, log-probs and weight versions a run's endpoint gives, and stops on SIGINT with exit 0; bad input is one
line and exit 2 before Ray starts; a checkpoint serves its own model files with the config saved in it; a rollout
actor that dies inside a call is replaced and the call answered by the replacement; an endpoint that dies is started
again at the same address."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from qgrpo.core.invocation import Invocation, qgrpo_command

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
BASE_URL = re.compile(r"^\s*base URL:\s+(http://\S+/v1)\s*$", re.M)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    return {**env, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _command(cwd: Path, *args) -> list[str]:
    """`qgrpo ARGS` as a user in `cwd` would start it (core/invocation.py: CI's PATH lacks .venv/bin)."""
    return shlex.split(qgrpo_command(*args, how=Invocation(cwd=str(cwd))))


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert answer.status == 200
        return json.loads(answer.read())


def _check_tokens(choice: dict, logprobs: list[float], max_tokens: int) -> None:
    ids = choice["token_ids"]
    assert 1 <= len(ids) <= max_tokens and all(isinstance(t, int) for t in ids)
    assert len(logprobs) == len(ids) and all(lp <= 0 for lp in logprobs)
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": len(ids)}]


@pytest.mark.ray  # a qgrpo process of its own, with its own Ray
def test_serve_answers_every_route_and_stops_on_sigint(tiny_model_path, tmp_path):
    cache = Path(tiny_model_path).parents[1]  # the test cache the fixture built the tiny model into
    out, err = (tmp_path / "serve.stdout").open("w"), (tmp_path / "serve.stderr").open("w")
    command = _command(tmp_path, "serve", TINY, "--port", "0", "--set", f"model.cache_dir={json.dumps(str(cache))}")
    state = tmp_path.parent / f"{tmp_path.name}-faults"  # not in cwd: nothing is written there
    state.mkdir()
    # the endpoint dies at its third batch (the token route's call below): served again at the same address
    env = {**_env(), "QGRPO_FAULTS": "endpoint.kill@3", "QGRPO_FAULTS_STATE": str(state)}
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline, found = time.monotonic() + 240, None
        while found is None:
            found = BASE_URL.search((tmp_path / "serve.stdout").read_text())
            log = (tmp_path / "serve.stderr").read_text
            assert proc.poll() is None, f"serve ended (rc {proc.returncode}):\n{log()}"
            assert time.monotonic() < deadline, log()
            time.sleep(0.2)
        base = found.group(1)
        printed = (tmp_path / "serve.stdout").read_text()
        assert "model:    qgrpo-policy" in printed and f"curl {base}/chat/completions" in printed

        models = json.loads(urllib.request.urlopen(f"{base}/models", timeout=60).read())
        assert [m["id"] for m in models["data"]] == ["qgrpo-policy"] and models["data"][0]["max_model_len"] > 0

        # tiny-digits has no chat template: the messages are rendered as plain text
        chat = _post(f"{base}/chat/completions", {"model": "qgrpo-policy", "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "1+2="}]})
        choice = chat["choices"][0]
        _check_tokens(choice, [c["logprob"] for c in choice["logprobs"]["content"]], 3)
        assert chat["prompt_token_ids"] and chat["qgrpo"]["precision"] == "int4"  # rollout.precision of tiny.toml

        text = _post(f"{base}/completions", {"model": "qgrpo-policy", "prompt": "1+2=", "max_tokens": 2})
        _check_tokens(text["choices"][0], text["choices"][0]["logprobs"]["token_logprobs"], 2)

        root = base.removesuffix("/v1")
        body = {"token_ids": chat["prompt_token_ids"], "sampling_params": {"max_tokens": 3, "temperature": 0.0}}
        with pytest.raises(OSError):  # the endpoint's process dies under this call (urllib: connection reset)
            _post(f"{root}/inference/v1/generate", body)
        deadline = time.monotonic() + 120
        while "serving again at" not in (tmp_path / "serve.stderr").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.stderr").read_text()
            time.sleep(0.2)
        assert "the endpoint died (ActorDiedError" in (tmp_path / "serve.stderr").read_text()
        gen = _post(f"{root}/inference/v1/generate", body)  # the new endpoint, at the same address
        _check_tokens(gen["choices"][0], [c["logprob"] for c in gen["choices"][0]["logprobs"]["content"]], 3)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.stderr").read_text()
        assert "qgrpo serve: stopped (SIGINT)" in (tmp_path / "serve.stderr").read_text()
        assert {p.name for p in tmp_path.iterdir()} == {"serve.stdout", "serve.stderr"}  # nothing written in cwd
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the qgrpo process and the Ray it started
            proc.wait()
        out.close()
        err.close()


@pytest.mark.slow  # `make test-slow` (docs/testing.md)
@pytest.mark.ray
def test_a_served_call_whose_rollout_actor_dies_is_answered_by_its_replacement(tiny_model_path, tmp_path,
                                                                              tmp_path_factory):
    cache = Path(tiny_model_path).parents[1]
    state = tmp_path_factory.mktemp("faults")
    out, err = (tmp_path / "serve.stdout").open("w"), (tmp_path / "serve.stderr").open("w")
    command = _command(tmp_path, "serve", TINY, "--port", "0", "--set", f"model.cache_dir={json.dumps(str(cache))}")
    env = {**_env(), "QGRPO_FAULTS": "rollout.kill@1", "QGRPO_FAULTS_STATE": str(state)}  # the first call's actor
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=err, start_new_session=True)
    try:
        deadline, found = time.monotonic() + 240, None
        while found is None:
            found = BASE_URL.search((tmp_path / "serve.stdout").read_text())
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.stderr").read_text()
            time.sleep(0.2)
        text = _post(f"{found.group(1)}/completions", {"model": "qgrpo-policy", "prompt": "1+2=", "max_tokens": 2})
        _check_tokens(text["choices"][0], text["choices"][0]["logprobs"]["token_logprobs"], 2)
        log = (tmp_path / "serve.stderr").read_text()
        assert "qgrpo serve: rollout actor torch-0 failed (ActorDiedError" in log
        assert "rollout actor torch-0 replaced by torch-0.1" in log
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.stderr").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.close()
        err.close()


def test_serve_refuses_a_missing_file_in_one_line():
    proc = subprocess.run(_command(ROOT, "serve", "no/such/config.toml"), cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qgrpo serve: no/such/config.toml: no such file or folder"), \
        proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def _args(target, *overrides: str, port: int | None = 0) -> argparse.Namespace:
    return argparse.Namespace(target=str(target), overrides=list(overrides), port=port, host=None, model_name=None)


def test_serve_refuses_a_config_with_errors_and_a_port_in_use(tiny_model_path):
    from qgrpo.cluster.cli.serve import listen_address, resolve
    from qgrpo.cluster.cli.train import Refused

    cache = f"model.cache_dir={json.dumps(str(Path(tiny_model_path).parents[1]))}"
    with contextlib.ExitStack() as stack:
        with pytest.raises(Refused, match="rollout.temperature"):
            resolve(_args(TINY, cache, "rollout.temperature=-1"), stack)
        served = resolve(_args(TINY, cache), stack)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(Refused, match=f"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            listen_address(_args(TINY, port=taken.getsockname()[1]), served.cfg)
    assert listen_address(_args(TINY, port=0), served.cfg) == ("127.0.0.1", 0)


def test_a_checkpoint_serves_its_model_files_with_its_saved_config(tiny_model_path, tmp_path):
    """A checkpoint's trainer_state.json config (its rollout settings, its served model name) with model.path the
    checkpoint itself; a run directory serves its newest complete checkpoint."""
    from qgrpo.cluster.cli.serve import resolve
    from qgrpo.cluster.config.schema import load_config

    cfg = load_config(TINY, [f"model.path={json.dumps(tiny_model_path)}", "rollout.precision='int8'",
                             "rollout.temperature=0.7", "environment.served_model='tiny-policy'"])
    ckpt = tmp_path / "run" / "checkpoints" / "step_000004"
    shutil.copytree(tiny_model_path, ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 4, "config": cfg.to_dict()}))
    before = sorted(p.name for p in ckpt.iterdir())
    for target in (ckpt, tmp_path / "run"):
        with contextlib.ExitStack() as stack:
            served = resolve(_args(target, "rollout.top_k=5"), stack)
        assert served.model_path == str(ckpt) and served.cfg.model.path == str(ckpt)
        ro = served.cfg.rollout
        assert (ro.precision, ro.temperature, ro.top_k) == ("int8", 0.7, 5)
        assert served.cfg.environment.served_model == "tiny-policy"
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing written into it
