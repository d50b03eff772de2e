// Q4_K unit_dot: sub-block `sub` of a 144-byte super-block (offsets as fmt_q4_k.wgsl); 32 nibble bytes read as 8
// aligned words: scale * sum(q * x) - offset * sum(x).
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 144u;
    let sub = u % 8u;
    let dm = unpack2x16float(wt[base >> 2u]);
    let sm = q4k_scale_min(base + 4u, sub);
    let qs = (base + 16u + (sub / 2u) * 32u) >> 2u;
    let shift = (sub & 1u) * 4u;
    var acc = 0.0;
    var xs = vec4<f32>(0.0);
    for (var j = 0u; j < 8u; j++) {
        let xv = x[u * 8u + j];
        acc += dot(nibbles(wt[qs + j], shift, 15u), xv);
        xs += xv;
    }
    return dm.x * sm.x * acc - dm.y * sm.y * (xs.x + xs.y + xs.z + xs.w);
}
