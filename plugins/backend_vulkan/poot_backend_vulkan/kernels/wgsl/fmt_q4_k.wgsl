// GGUF Q4_K: 144-byte super-blocks of 256 values: f16 d, f16 dmin, 12 bytes of packed 6-bit
// (scale, min) pairs for 8 sub-blocks of 32 (kscale.wgsl), then 128 bytes of nibbles. Unit u is one sub-block.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 256u) + u / 8u) * 144u;
    let sub = u % 8u;
    let d = half_at(base);
    let dmin = half_at(base + 2u);
    let sm = q4k_scale_min(base + 4u, sub);
    let scale = d * sm.x;
    let offset = dmin * sm.y;
    // sub-blocks 2j and 2j+1 share bytes 32j..32j+31: low nibbles then high nibbles
    let qs = base + 16u + (sub / 2u) * 32u;
    let shift = (sub & 1u) * 4u;
    for (var l = 0u; l < 32u; l++) {
        (*vals)[l] = scale * f32((byte_at(qs + l) >> shift) & 15u) - offset;
    }
}
