// GGUF Q5_K: 176-byte super-blocks of 256 values: f16 d, f16 dmin, 12 bytes of (scale, min) pairs
// (kscale.wgsl), 32 bytes of high bits (bit u of byte l for value l of sub-block u), 128 bytes of nibbles laid
// out as Q4_K's. Unit u is one sub-block: d * scale * q - dmin * min.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 256u) + u / 8u) * 176u;
    let sub = u % 8u;
    let sm = q4k_scale_min(base + 4u, sub);
    let scale = half_at(base) * sm.x;
    let offset = half_at(base + 2u) * sm.y;
    let qs = base + 48u + (sub / 2u) * 32u;
    let shift = (sub & 1u) * 4u;
    for (var l = 0u; l < 32u; l++) {
        let high = (byte_at(base + 16u + l) >> sub) & 1u;
        (*vals)[l] = scale * f32(((byte_at(qs + l) >> shift) & 15u) | (high << 4u)) - offset;
    }
}
