"""The controller: drivers that wire rollout, reward, trainer and weight sync together."""
