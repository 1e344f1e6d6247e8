"""Weights: online sync from the trainer into running vLLM servers, verified on every server.

``trident.weights.sync`` is the trainer side (buckets, pause/transfer/verify/resume, probes);
``trident.weights.vllm_plugin`` is the engine side (the ``trident_shm`` vLLM backend). Nothing is
imported here: vLLM imports the plugin in each of its processes, and that must stay cheap.
"""
