// Q5_K unit_dot: sub-block `sub` of a 176-byte super-block (offsets as fmt_q5_k.wgsl): nibbles as Q4_K's plus
// bit `sub` of high byte l; every word aligned.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 176u;
    let sub = u % 8u;
    let dm = unpack2x16float(wt[base >> 2u]);
    let sm = q4k_scale_min(base + 4u, sub);
    let qh = (base + 16u) >> 2u;
    let qs = (base + 48u + (sub / 2u) * 32u) >> 2u;
    let shift = (sub & 1u) * 4u;
    var acc = 0.0;
    var xs = vec4<f32>(0.0);
    for (var j = 0u; j < 8u; j++) {
        let xv = x[u * 8u + j];
        let q = nibbles(wt[qs + j], shift, 15u) + 16.0 * nibbles(wt[qh + j], sub, 1u);
        acc += dot(q, xv);
        xs += xv;
    }
    return dm.x * sm.x * acc - dm.y * sm.y * (xs.x + xs.y + xs.z + xs.w);
}
