// GGUF Q5_0: 22-byte blocks, f16 scale, 32 high bits (u32), 16 bytes of low nibbles; value j takes low nibble
// j % 16 (high half for j >= 16) and bit j of the high bits: d * (q - 16).
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 32u) + u) * 22u;
    let d = half_at(base);
    let qh = byte_at(base + 2u) | (byte_at(base + 3u) << 8u) | (byte_at(base + 4u) << 16u) | (byte_at(base + 5u) << 24u);
    for (var j = 0u; j < 16u; j++) {
        let q = byte_at(base + 6u + j);
        (*vals)[j] = d * (f32((q & 15u) | (((qh >> j) & 1u) << 4u)) - 16.0);
        (*vals)[j + 16u] = d * (f32((q >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u)) - 16.0);
    }
}
