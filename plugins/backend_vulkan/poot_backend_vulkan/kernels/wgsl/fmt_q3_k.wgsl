// GGUF Q3_K: 110-byte super-blocks of 256 values: 32 bytes of high-bit masks, 64 bytes of 2-bit values (laid out
// as Q2_K's), 12 bytes of 6-bit scales (one per 16 values; low nibbles in bytes 0..7, high pairs in 8..11), f16 d.
// Value l of unit u: q = low bits - 4 unless bit u of mask byte l is set; d * (scale - 32) * q.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 256u) + u / 8u) * 110u;
    let sub = u % 8u;
    let d = half_at(base + 108u);
    let qs = base + 32u + (sub / 4u) * 32u;
    let shift = 2u * (sub % 4u);
    for (var l = 0u; l < 32u; l++) {
        let s = 2u * sub + l / 16u;
        let low = (byte_at(base + 96u + s % 8u) >> (4u * (s / 8u))) & 15u;
        let high = (byte_at(base + 104u + s % 4u) >> (2u * (s / 4u))) & 3u;
        let scale = f32(i32(low | (high << 4u)) - 32);
        let q = i32((byte_at(qs + l) >> shift) & 3u) - select(4, 0, ((byte_at(base + l) >> sub) & 1u) == 1u);
        (*vals)[l] = d * scale * f32(q);
    }
}
