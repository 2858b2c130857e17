"""The task domains SFT teaches and RL verifies: the Task type (task.py), synthetic addition
(arithmetic.py), GSM8K (gsm8k.py), the calculator and docs tools with their corpus (tools.py) and
the RL prompt pools (pools.py)."""
