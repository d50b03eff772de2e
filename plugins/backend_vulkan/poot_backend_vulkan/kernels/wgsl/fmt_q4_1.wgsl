// GGUF Q4_1: 20-byte blocks, f16 scale, f16 minimum, 16 bytes of nibbles (value = d * q + m).
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 32u) + u) * 20u;
    let d = half_at(base);
    let m = half_at(base + 2u);
    for (var j = 0u; j < 16u; j++) {
        let q = byte_at(base + 4u + j);
        (*vals)[j] = d * f32(q & 15u) + m;
        (*vals)[j + 16u] = d * f32(q >> 4u) + m;
    }
}
