// Q2_K unit_dot: sub-block u % 8 of an 84-byte super-block (layout as fmt_q2_k.wgsl): the 32 bytes of its half
// as 8 aligned words at its shift, values 0..15 under scale byte 2 * sub, 16..31 under 2 * sub + 1.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 84u;
    let sub = u % 8u;
    let qs = (base + 16u + (sub / 4u) * 32u) >> 2u;
    let shift = 2u * (sub % 4u);
    var dq = vec2<f32>(0.0);
    var xs = vec2<f32>(0.0);
    for (var j = 0u; j < 8u; j++) {
        let xv = x[u * 8u + j];
        dq[j / 4u] += dot(nibbles(wt[qs + j], shift, 3u), xv);
        xs[j / 4u] += xv.x + xv.y + xv.z + xv.w;
    }
    let sc = vec2<u32>(byte_at(base + 2u * sub), byte_at(base + 2u * sub + 1u));
    let dm = unpack2x16float(wt[(base + 80u) >> 2u]);
    return dm.x * dot(vec2<f32>(sc & vec2<u32>(15u)), dq) - dm.y * dot(vec2<f32>(sc >> vec2<u32>(4u)), xs);
}
