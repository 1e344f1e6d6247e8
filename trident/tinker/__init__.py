"""The training service: the Tinker API over trident's trainer, weights and rollout fleet
(``trident tinker serve``). It sits beside ``trident.pipeline`` in the import layers."""
