// GGUF IQ4_XS: 136-byte super-blocks of 256 values: f16 d, 16 bits of high scale pairs, 4 bytes of low scale
// nibbles, 128 bytes of nibbles indexing IQ4_LEVELS (iq4_values.wgsl). Unit u is one sub-block of 32 with the
// 6-bit scale (low nibble u of the low bytes, bits 2u..2u+1 of the high word) - 32; its 16 bytes hold values
// 0..15 in low nibbles and 16..31 in high nibbles.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 256u) + u / 8u) * 136u;
    let sub = u % 8u;
    let high = ((byte_at(base + 2u) | (byte_at(base + 3u) << 8u)) >> (2u * sub)) & 3u;
    let low = (byte_at(base + 4u + sub / 2u) >> (4u * (sub & 1u))) & 15u;
    let dl = half_at(base) * f32(i32(low | (high << 4u)) - 32);
    let qs = base + 8u + sub * 16u;
    for (var j = 0u; j < 16u; j++) {
        let q = byte_at(qs + j);
        (*vals)[j] = dl * IQ4_LEVELS[q & 15u];
        (*vals)[j + 16u] = dl * IQ4_LEVELS[q >> 4u];
    }
}
