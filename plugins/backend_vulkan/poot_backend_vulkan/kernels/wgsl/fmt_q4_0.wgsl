// GGUF Q4_0: 18-byte blocks, f16 scale then 16 bytes; low nibbles are values 0..15, high nibbles 16..31.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 32u) + u) * 18u;
    let d = half_at(base);
    for (var j = 0u; j < 16u; j++) {
        let q = byte_at(base + 2u + j);
        (*vals)[j] = d * (f32(q & 15u) - 8.0);
        (*vals)[j + 16u] = d * (f32(q >> 4u) - 8.0);
    }
}
