"""POST /inference/v1/generate: vLLM's token-in, token-out schema (token_ids + sampling_params -> choices[].token_ids,
logprobs.content[].{token_id, logprob}, weight_versions), as `renderers` and verifiers' TrainClient call it; and the
token-in call every prompt given as tokens or text makes (`token_call`, routes_completions.py's too): the child of the
session's call whose prompt and sampled ids begin its prompt, token by token."""
from __future__ import annotations

import time

from qgrpo.rollout.endpoint import protocol as p
from qgrpo.rollout.endpoint.engine import Sample
from qgrpo.rollout.endpoint.serving import Endpoint, weight_spans
from qgrpo.rollout.endpoint.sessions import Call, Session


async def generate(ep: Endpoint, session: Session, body: dict) -> tuple[Call, p.GenerateAnswer]:
    req = p.parse(p.GenerateRequest, body)
    ep.check_model(req.model, session, required=False)
    ids = ep.check_ids(req.token_ids, "token_ids")
    params = req.sampling_params
    call, sample = await token_call(ep, session, "generate", ids, ep.sampling(params, len(ids), "token_ids"),
                                    set(params.stop_token_ids or ()))
    logprobs = p.TokenLogprobs(content=[p.TokenLogprob(token=f"token_id:{t}", token_id=t, logprob=lp)
                                      for t, lp in zip(sample.ids, sample.logprobs)])
    choice = p.GenerateChoice(finish_reason=sample.finish, token_ids=sample.ids, logprobs=logprobs,
                            weight_versions=weight_spans(sample))
    request_id = str(req.request_id or call.id)
    return call, p.GenerateAnswer(choices=[choice], request_id=request_id, **ep.answer(call, sample))


async def token_call(ep: Endpoint, session: Session, route: str, prompt: list[int], sampling: dict,
                     stops: set[int] = frozenset()) -> tuple[Call, Sample]:
    """A token-in call; `stops`: the client's own stop tokens besides the model's (renderers send them), where the
    sample is cut (the tokens up to there are exactly those sampled)."""
    parent = session.token_parent(prompt)
    fork = "" if parent is not None else session.fork_reason(route, None, prompt)
    cut = parent.prompt_len + len(parent.ids) if parent is not None else 0
    own = prompt[cut:]
    call = Call(ep.book.next_call_id(session.id), parent.id if parent else None, route, own,
                base=parent.chunks if parent else (), fork=fork, linked_by="tokens" if parent else "",
                tail_messages=[{"role": "user", "content": ep.renderer.decode(own)}] if parent is not None else [])
    t0 = time.monotonic()
    sample, grant = await ep.sample(session, prompt, sampling)
    end = next((i + 1 for i, t in enumerate(sample.ids) if t in stops), None)
    if end is not None and end < len(sample.ids):
        sample = Sample(sample.ids[:end], sample.logprobs[:end], [p for p in sample.spans if p[0] < end] or
                        sample.spans[:1], "stop", sample.seconds)
    return ep.record(session, call, sample, grant, t0), sample
