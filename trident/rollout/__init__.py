"""Rollout: vLLM servers, their HTTP clients and the router."""
