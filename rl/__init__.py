"""The RL library: one Sample type through rollout, reward and loss."""
