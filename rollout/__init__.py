"""Rollouts of general agents: tasks run by an agent program against the gateway, n per task,
each in a sandbox (``sandbox``), scored by the task's verifier (``runner``). ``nextstate rollout``
is its command."""
