"""An OpenAI-compatible endpoint served by the rollout actors (docs/agents.md): agent programs call it as they call
any server, and every call's exact tokens, the quantized generator's log-probs and the weight versions that sampled
them are kept per session, stitched into training rows by token identity.

chat.py renders messages to token ids and parses the model's tool calls; sessions.py keeps each session's calls as a
tree and turns a branch into a training row; engine.py batches calls onto generators; server.py is the HTTP front
(its routes and response shapes); local.py serves generators of this process on a thread."""
