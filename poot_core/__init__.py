"""poot: load LLM checkpoints and run them on the device the machine has."""
