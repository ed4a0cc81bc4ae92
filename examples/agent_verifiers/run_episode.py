"""Play guess_game.py's verifiers v1 environment N times against an OpenAI-compatible endpoint and print one JSON line:
each rollout's reward and the token ids of each model turn as verifiers recorded them in its trace. Run it with the
verifiers venv's interpreter (verifiers 0.4.0 pins openai<3, the main venv holds openai 3):

    .venv-verifiers/bin/python examples/agent_verifiers/run_episode.py \
        --base-url http://127.0.0.1:8000/v1 --model qgrpo-policy \
        --tokenizer ~/.cache/qgrpo/models/smollm2-135m-instruct-v1 --row '{"secret": 7}' --n 2

verifiers' TrainClient sits behind the agent program: it renders each turn's messages to token ids with the
tokenizer in --tokenizer (a local folder: no model hub here; `renderers` picks its renderer by the tokenizer's
name_or_path and falls back to the chat template, DefaultRenderer, for SmolLM2), posts them to
`{base-url minus /v1}/inference/v1/generate` with `X-Session-ID: <trace id>` and the bearer key, and reads back the
completion's token ids and log-probs. So a qgrpo agent program can call this script as a subprocess and compare the
turns printed here with the endpoint's own record of the session.

Printed (one line, JSON): {"n": N, "rewards": [...], "episodes": [{"ok", "reward", "rewards", "metrics", "errors",
"turns": [{"prompt_ids", "completion_ids", "logprobs", "finish_reason", "content"}]}]}. A turn's prompt_ids are the
whole sequence the model was given (its path in the trace's message graph up to the generation prompt), its
completion_ids the sampled tokens (the node's masked span), logprobs one per completion id.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # the taskset id `guess_game` is this folder's module

API_KEY_VAR = "QGRPO_VF_API_KEY"  # TrainClientConfig reads the key from an environment variable


def turns_of(trace) -> list[dict]:
    """Each sampled (model) turn of `trace`, in order: the full prompt ids (the path's tokens before the sampled span),
    the completion ids and their log-probs."""
    nodes = trace.nodes
    finish = {c.node: c.finish_reason for c in trace.calls if c.node is not None}
    out = []
    for k, node in enumerate(nodes):
        if not node.sampled:
            continue
        path, parent = [], node.parent
        while parent is not None:
            path.append(parent)
            parent = nodes[parent].parent
        prompt = [t for p in reversed(path) for t in nodes[p].token_ids]
        first = node.mask.index(True) if True in node.mask else len(node.token_ids)
        prompt += node.token_ids[:first]
        out.append({"prompt_ids": prompt,
                    "completion_ids": [t for t, m in zip(node.token_ids, node.mask) if m],
                    "logprobs": list(node.logprobs),
                    "finish_reason": finish.get(k),
                    "content": getattr(node.message, "content", None)})
    return out


def errors_of(items) -> list[str]:
    return [f"{e.type}: {e.message}" for e in items]


async def play(args) -> dict:
    import verifiers.v1 as vf
    from guess_game import make_task
    from verifiers.v1.env import RunSlot

    os.environ[API_KEY_VAR] = args.api_key
    # The agent program runs in this process (ChatHarness): a local "subprocess" runtime, not the default cloud one
    # (which would need a Prime login and a tunnel to reach the local interception server).
    config = vf.SingleAgentEnvConfig(taskset={"id": "guess_game"}, agent={"runtime": {"type": "subprocess"}})
    env = vf.load_environment(config)
    client = vf.TrainClientConfig(base_url=args.base_url, api_key_var=API_KEY_VAR,
                                  renderer_model_name=args.tokenizer,
                                  timeout={"connect": 10.0, "read": args.timeout})
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    ctx = vf.ModelContext(model=args.model, client=client, sampling=vf.Sampling(**sampling))
    task = make_task(json.loads(args.row), env.taskset.config.task)
    async with env.serving():
        slots = [RunSlot(task) for _ in range(args.n)]
        episodes = await asyncio.gather(*(env.run_slot(slot, ctx) for slot in slots))
    out = []
    for ep in episodes:
        traces = list(ep.traces)
        trace = traces[-1] if traces else None
        out.append({
            "ok": bool(ep.ok),
            "reward": float(trace.reward) if trace is not None else 0.0,
            "rewards": {k: (None if r is None else r.score) for k, r in trace.rewards.items()} if trace else {},
            "metrics": dict(trace.metrics) if trace else {},
            "errors": errors_of(ep.errors) + (errors_of(trace.errors) if trace else []),
            "turns": turns_of(trace) if trace else [],
        })
    return {"n": args.n, "rewards": [e["reward"] for e in out], "episodes": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the endpoint's OpenAI base URL, ending in /v1")
    ap.add_argument("--model", required=True, help="the model name the endpoint serves")
    ap.add_argument("--tokenizer", required=True, help="a local folder with the model's tokenizer and chat template")
    ap.add_argument("--row", required=True, help='the game as JSON: {"secret": 7, "high": 10, "max_guesses": 3}')
    ap.add_argument("--n", type=int, default=1, help="rollouts of the row")
    ap.add_argument("--api-key", default="EMPTY", help="sent as the bearer key. verifiers also sends "
                    "X-Session-ID: <its trace id>, which qgrpo's endpoint prefers to the key: to put the calls in a "
                    "given session, pass its session base URL (http://HOST:PORT/sessions/SID/v1) as --base-url")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=120.0, help="read timeout of one call, seconds")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    result = asyncio.run(play(args))
    print(json.dumps(result), flush=True)
    return 0 if all(e["ok"] for e in result["episodes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
