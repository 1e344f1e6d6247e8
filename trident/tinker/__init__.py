"""The training service: the Tinker API served from trident's own trainer, sampler and
checkpoints (``trident tinker serve``). ``server`` is the HTTP app and ``wire`` its codec;
``service`` holds the state behind the HTTP layer; ``journal``, ``scheduler`` and ``snapshots``
make every training request run exactly once, in seq order, across crashes; ``models`` runs each
request on a model's trainer; ``sampling`` serves samples from the rollout servers and pushes the
weights to them; ``serve`` starts it all (``trident tinker serve``). It sits beside ``trident.pipeline`` in the import layers."""
