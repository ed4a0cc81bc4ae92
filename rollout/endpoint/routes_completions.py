"""POST /v1/completions: a prompt as text or token ids (a token-in call: routes_tokens.token_call), answered with
OpenAI's text completion and its logprobs (tokens, token_logprobs, text_offset); `stream: true` replays it as
server-sent events (`events`)."""
from __future__ import annotations

from qgrpo.rollout.endpoint import protocol as p
from qgrpo.rollout.endpoint.chat import prompt_of_completion, token_text
from qgrpo.rollout.endpoint.routes_chat import replay
from qgrpo.rollout.endpoint.routes_tokens import token_call
from qgrpo.rollout.endpoint.serving import Endpoint, weight_spans
from qgrpo.rollout.endpoint.sessions import Call, Session


async def completions(ep: Endpoint, session: Session, body: dict) -> tuple[Call, p.CompletionAnswer]:
    req = p.parse(p.CompletionRequest, body)
    ep.check_model(req.model, session)
    prompt = prompt_of_completion(ep.renderer, req.prompt)
    if not isinstance(req.prompt, str):
        ep.check_ids(prompt, "prompt")
    call, sample = await token_call(ep, session, "completions", prompt, ep.sampling(req, len(prompt), field="prompt"))
    texts = token_text(ep.tokenizer, sample.ids)
    offsets = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    logprobs = p.TextLogprobs(tokens=texts, token_logprobs=sample.logprobs, text_offset=offsets)
    choice = p.CompletionChoice(text=call.text, finish_reason=sample.finish, logprobs=logprobs, token_ids=sample.ids,
                              prompt_token_ids=prompt, weight_versions=weight_spans(sample))
    return call, p.CompletionAnswer(choices=[choice], **ep.answer(call, sample))


def events(out: p.CompletionAnswer, include_usage: bool):
    """The answer as text_completion chunks: the text with its logprobs, then the finish with the token ids."""
    choice = out.choices[0]
    chunks = [p.TextChunkChoice(text=choice.text, logprobs=choice.logprobs),
              p.TextChunkChoice(text="", finish_reason=choice.finish_reason, token_ids=choice.token_ids,
                              weight_versions=choice.weight_versions)]
    return replay(out, "text_completion", chunks, include_usage)
