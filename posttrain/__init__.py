"""Post-training stage drivers: sft (and its data), rl-reasoning, rl-agentic, reward-model,
rl-general and distill. Each builds its step on the RL library (rl/: the trainer, the update, the
algorithms by name, rewards, rollouts, gates) and the floors below it (chat/, quant/, domains/)."""
