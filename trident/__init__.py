"""trident: RL post-training for language models.

Three engines, one small controller: vLLM servers generate, plain functions and sandboxes score,
FSDP2 trains; weights flow back to the servers every step and each sync is verified.
"""

__version__ = "0.1.0"
