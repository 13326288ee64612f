"""LoRA adapters (issue 26): PEFT adapters read and checked against the model (adapter.py), the low-rank half of a
LoRA layer over a batch that mixes adapters (ops.py and its kernels; layer.py, model.py wire it into the model),
the modules file re-read while the engine runs (modules_file.py), and where run-time loads may read from
(paths.py, --lora-root)."""
