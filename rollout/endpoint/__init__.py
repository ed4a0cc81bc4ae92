"""An OpenAI-compatible endpoint served by the rollout actors (docs/agents.md): agent programs call it as they call
any server, and every call's exact tokens, the quantized generator's log-probs and the weight versions that sampled
them are kept per session, stitched into training rows by token identity.

In parts (docs/agents.md, "How it is served"): protocol.py the request and answer models; auth.py the key, the body
limit and the naming of sessions; admission.py when a call may sample; sessions.py each session's call tree (the only
code that changes a session) and rows.py its branches as training rows; chat.py renders messages to token ids;
parsers.py the tool-call parsers; serving.py the Endpoint (its state, limits, one call's sampling); routes_chat.py,
routes_completions.py and routes_tokens.py the routes; engine.py batches calls onto generators; server.py assembles
the app; local.py serves generators of this process on a thread."""
