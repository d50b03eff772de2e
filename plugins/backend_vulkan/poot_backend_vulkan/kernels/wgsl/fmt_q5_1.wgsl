// GGUF Q5_1: 24-byte blocks, f16 scale, f16 minimum, 32 high bits, 16 bytes of low nibbles (value = d * q + m,
// q of 5 bits as in Q5_0).
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 32u) + u) * 24u;
    let d = half_at(base);
    let m = half_at(base + 2u);
    let qh = byte_at(base + 4u) | (byte_at(base + 5u) << 8u) | (byte_at(base + 6u) << 16u) | (byte_at(base + 7u) << 24u);
    for (var j = 0u; j < 16u; j++) {
        let q = byte_at(base + 8u + j);
        (*vals)[j] = d * f32((q & 15u) | (((qh >> j) & 1u) << 4u)) + m;
        (*vals)[j + 16u] = d * f32((q >> 4u) | (((qh >> (j + 16u)) & 1u) << 4u)) + m;
    }
}
