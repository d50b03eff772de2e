// GGUF Q2_K: 84-byte super-blocks of 256 values: 16 scale bytes (low nibble scale, high nibble min, one per 16
// values), 64 bytes of 2-bit values, f16 d, f16 dmin. Unit u (half u / 4, shift 2 * (u % 4)) takes value l from
// byte l of its half's 32: d * scale * q - dmin * min.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 256u) + u / 8u) * 84u;
    let sub = u % 8u;
    let d = half_at(base + 80u);
    let dmin = half_at(base + 82u);
    let qs = base + 16u + (sub / 4u) * 32u;
    let shift = 2u * (sub % 4u);
    for (var l = 0u; l < 32u; l++) {
        let sc = byte_at(base + 2u * sub + l / 16u);
        (*vals)[l] = d * f32(sc & 15u) * f32((byte_at(qs + l) >> shift) & 3u) - dmin * f32(sc >> 4u);
    }
}
