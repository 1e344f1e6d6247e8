"""Weights: online sync from the trainer into running vLLM servers, verified on every server.

Trainer side: ``sync`` (``WeightSync``: pause, send, resume, verify, rejoin; the ``Transport``
protocol; probes), ``shm`` (the shm transport; its bucket files are ``buckets``), ``nccl``
(vLLM's GPU engines as a transport), ``control`` (the weight-update routes), ``backend`` (which
backend, which transport). Engine side: ``vllm_plugin`` (the plugin hook vLLM loads) and
``shm_engine`` (the ``trident_shm`` engine). Nothing is imported here: vLLM imports the plugin
in each of its processes, and that must stay cheap.
"""
