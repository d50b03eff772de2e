// GGUF IQ4_NL: 18-byte blocks, f16 scale then 16 bytes of nibbles indexing IQ4_LEVELS (iq4_values.wgsl); low
// nibbles are values 0..15, high nibbles 16..31.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 32u) + u) * 18u;
    let d = half_at(base);
    for (var j = 0u; j < 16u; j++) {
        let q = byte_at(base + 2u + j);
        (*vals)[j] = d * IQ4_LEVELS[q & 15u];
        (*vals)[j + 16u] = d * IQ4_LEVELS[q >> 4u];
    }
}
