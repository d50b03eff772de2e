"""poot-family-llama: dense decoder families for poot."""
