// The packed 6-bit (scale, min) pairs of Q4_K and Q5_K: 12 bytes at `sc` for 8 sub-blocks of 32 values.
fn q4k_scale_min(sc: u32, j: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(byte_at(sc + j) & 63u), f32(byte_at(sc + j + 4u) & 63u));
    }
    let s = (byte_at(sc + j + 4u) & 15u) | ((byte_at(sc + j - 4u) >> 6u) << 4u);
    let m = (byte_at(sc + j + 4u) >> 4u) | ((byte_at(sc + j) >> 6u) << 4u);
    return vec2<f32>(f32(s), f32(m));
}
