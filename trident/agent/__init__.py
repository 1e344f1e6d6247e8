"""Agentic rollout: the multi-turn agent loop (``trident.agent.loop``: ``run_trajectory`` /
``rollout_env_group``, token-in/token-out trajectories of an ``Env`` through a ``RolloutEngine``,
budgets, the drift check) and the OpenAI-compatible proxy for black-box agents
(``trident.agent.proxy``). Tool parsing and tools live in ``trident.tools``.
"""

from trident.agent.loop import AgentConfig, agent_metrics, rollout_env_group, run_trajectory

__all__ = ["AgentConfig", "agent_metrics", "rollout_env_group", "run_trajectory"]
