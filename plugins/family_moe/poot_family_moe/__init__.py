"""poot-family-moe: mixture-of-experts and latent-attention decoder families for poot."""
