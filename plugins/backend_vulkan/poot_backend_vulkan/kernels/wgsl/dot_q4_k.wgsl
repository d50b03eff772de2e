// Q4_K unit_dot over a 144-byte super-block (offsets as fmt_q4_k.wgsl). Unit u is the u % 8'th 16 bytes of its
// super-block's 128 nibble bytes, so neighbouring threads read neighbouring 16-byte pieces: piece 2c + h holds
// values 16h..16h+15 of sub-block 2c (low nibbles) and of sub-block 2c + 1 (high nibbles).
// Sum: kscale.wgsl kquant_unit_sum.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 144u;
    let piece = u % 8u;
    let c = piece / 2u;
    let scales = kquant_scales(base, c);
    let qs = (base + 16u + piece * 16u) >> 2u;
    let x0 = (u / 8u) * 64u + c * 16u + (piece % 2u) * 4u;  // x as vec4: sub-block s starts at 8s
    var d0 = 0.0;
    var d1 = 0.0;
    var s0 = vec4<f32>(0.0);
    var s1 = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        let w = wt[qs + j];
        let a = x[x0 + j];
        let b = x[x0 + 8u + j];
        d0 += dot(nibbles(w, 0u, 15u), a);
        d1 += dot(nibbles(w, 4u, 15u), b);
        s0 += a;
        s1 += b;
    }
    return kquant_unit_sum(scales, d0, d1, s0, s1);
}
