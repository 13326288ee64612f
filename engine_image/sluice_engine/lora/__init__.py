"""LoRA adapters (issue 26): PEFT adapters read and checked against the model (adapter.py), and the low-rank
half of a LoRA layer over a batch that mixes adapters (ops.py). Not wired into the model or the API yet."""
