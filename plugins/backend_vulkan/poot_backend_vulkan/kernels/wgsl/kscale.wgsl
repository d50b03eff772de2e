// The packed 6-bit (scale, min) pairs of Q4_K and Q5_K: 12 bytes at `sc` for 8 sub-blocks of 32 values.
fn q4k_scale_min(sc: u32, j: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(byte_at(sc + j) & 63u), f32(byte_at(sc + j + 4u) & 63u));
    }
    let s = (byte_at(sc + j + 4u) & 15u) | ((byte_at(sc + j - 4u) >> 6u) << 4u);
    let m = (byte_at(sc + j + 4u) >> 4u) | ((byte_at(sc + j) >> 6u) << 4u);
    return vec2<f32>(f32(s), f32(m));
}

// A Q4_K / Q5_K unit's scales (dot_q4_k.wgsl, dot_q5_k.wgsl): the super-block at byte `base` (d and dmin, then the
// packed scales), its sub-blocks 2c and 2c + 1; read before the unit's codes so that every load is in flight.
struct KScales {
    dm: vec2<f32>,
    sm0: vec2<f32>,
    sm1: vec2<f32>,
}

fn kquant_scales(base: u32, c: u32) -> KScales {
    return KScales(unpack2x16float(wt[base >> 2u]), q4k_scale_min(base + 4u, 2u * c),
                   q4k_scale_min(base + 4u, 2u * c + 1u));
}

// The unit's sum from its two sub-blocks' quantized dots d0 = q0.x0, d1 = q1.x1 and sums of x s0, s1:
// d * (scale0 * d0 + scale1 * d1) - dmin * (min0 * sum(s0) + min1 * sum(s1)).
fn kquant_unit_sum(k: KScales, d0: f32, d1: f32, s0: vec4<f32>, s1: vec4<f32>) -> f32 {
    let m = k.dm.y * (k.sm0.y * (s0.x + s0.y + s0.z + s0.w) + k.sm1.y * (s1.x + s1.y + s1.z + s1.w));
    return k.dm.x * (k.sm0.x * d0 + k.sm1.x * d1) - m;
}
