"""poot-family-vision: vision-language families for poot (Idefics3 / SmolVLM, Gemma 3)."""
