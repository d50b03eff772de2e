// GGUF Q6_K: 210-byte super-blocks of 256 values: 128 bytes of low nibbles (ql), 64 bytes of high
// 2-bit pairs (qh), 16 int8 scales, f16 d. Each half of 128 values uses 64 ql and 32 qh bytes;
// within a half, group g (0..3) of 32 values takes ql[l + 32*(g&1)] (high nibble when g >= 2)
// and bits 2g..2g+1 of qh[l]. Unit u is one group of 32.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 256u) + u / 8u) * 210u;
    let half = (u % 8u) / 4u;
    let g = u % 4u;
    let d = half_at(base + 208u);
    let ql = base + half * 64u + (g & 1u) * 32u;
    let qh = base + 128u + half * 32u;
    let nibble_shift = (g / 2u) * 4u;
    let scales = base + 192u + half * 8u + 2u * g;
    for (var l = 0u; l < 32u; l++) {
        let low = (byte_at(ql + l) >> nibble_shift) & 15u;
        let high = (byte_at(qh + l) >> (2u * g)) & 3u;
        let q = f32(i32(low | (high << 4u)) - 32);
        (*vals)[l] = d * i8_at(scales + l / 16u) * q;
    }
}
