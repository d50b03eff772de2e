"""poot-family-hybrid: decoders whose recurrent layers (short convolutions, Mamba2's selective scan) carry
fixed-size state beside attention's KV."""
