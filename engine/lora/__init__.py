"""LoRA adapters served on one base model: loading PEFT adapters, mixed-adapter batches, their identity."""
