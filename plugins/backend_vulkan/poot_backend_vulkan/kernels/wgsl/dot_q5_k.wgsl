// Q5_K unit_dot over a 176-byte super-block (offsets as fmt_q5_k.wgsl), units as dot_q4_k.wgsl's: the u % 8'th
// 16 bytes of the nibbles (sub-blocks 2c and 2c + 1, values 16h..16h+15) with high bits 2c and 2c + 1 of the
// same 16 positions of the 32 high-bit bytes.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 176u;
    let piece = u % 8u;
    let c = piece / 2u;
    let scales = kquant_scales(base, c);
    let h = piece % 2u;
    let qs = (base + 48u + piece * 16u) >> 2u;
    let qh = (base + 16u + h * 16u) >> 2u;
    let x0 = (u / 8u) * 64u + c * 16u + h * 4u;
    var d0 = 0.0;
    var d1 = 0.0;
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        let w = wt[qs + j];
        let hb = wt[qh + j];
        let a = x[x0 + j];
        let b = x[x0 + 8u + j];
        d0 += dot(nibbles(w, 0u, 15u) + 16.0 * nibbles(hb, 2u * c, 1u), a);
        d1 += dot(nibbles(w, 4u, 15u) + 16.0 * nibbles(hb, 2u * c + 1u, 1u), b);
        s0 += a;
        s1 += b;
    }
    return kquant_unit_sum(scales, d0, d1, s0, s1);
}
