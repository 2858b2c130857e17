"""The GLM chat template and its XML tool-call format: one conversation format for SFT, RL
rollouts, rewards and the reward model (template.py)."""
