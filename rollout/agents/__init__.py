"""Agent programs as a rollout source (environment.name = "agent:FILE.py:NAME"), by job: the user's contract
(contract.py: loading the agent function, what it is given, playing one episode into an Outcome), training rows from
the episodes' sessions (rows.py), why an episode may have scored 0 (findings.py), and `qgrpo check`'s episode against
the base model (probe.py). The run plays the episodes on Ray (cluster/run/agents.py, actors/agent_runner.py); how to
write one: docs/agents.md."""
