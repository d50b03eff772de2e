"""poot-family-hybrid: decoders whose recurrent layers (short convolutions, Mamba2's selective scan, Qwen3-Next's
gated delta rule) carry fixed-size state beside attention's KV."""
