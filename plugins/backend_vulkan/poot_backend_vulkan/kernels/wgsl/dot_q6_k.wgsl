// Q6_K unit_dot over a 210-byte super-block (offsets as fmt_q6_k.wgsl). Unit u is positions 8n..8n+7 (n = u % 4)
// of half (u % 8) / 4 in all four groups of 32: 8 bytes of each of the two ql runs and of qh, so neighbouring
// threads read neighbouring bytes. Super-blocks are only 2-byte aligned: words come through word_at.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 210u;
    let half = (u % 8u) / 4u;
    let l0 = 8u * (u % 4u);
    let ql = base + half * 64u;
    let qh = base + 128u + half * 32u;
    let xb = (u / 8u) * 64u + half * 32u;  // x as vec4: group g of this half starts at xb + 8g
    var acc = vec4<f32>(0.0);  // per group
    for (var j = 0u; j < 2u; j++) {
        let pos = l0 + 4u * j;
        let h = word_at(qh + pos);
        let a = word_at(ql + pos);
        let b = word_at(ql + 32u + pos);
        let xi = xb + pos / 4u;
        acc.x += dot(nibbles(a, 0u, 15u) + 16.0 * nibbles(h, 0u, 3u) - 32.0, x[xi]);
        acc.y += dot(nibbles(b, 0u, 15u) + 16.0 * nibbles(h, 2u, 3u) - 32.0, x[xi + 8u]);
        acc.z += dot(nibbles(a, 4u, 15u) + 16.0 * nibbles(h, 4u, 3u) - 32.0, x[xi + 16u]);
        acc.w += dot(nibbles(b, 4u, 15u) + 16.0 * nibbles(h, 6u, 3u) - 32.0, x[xi + 24u]);
    }
    let sc = base + 192u + half * 8u + l0 / 16u;  // group g's scale for these positions at sc + 2g
    let scales = vec4<f32>(i8_at(sc), i8_at(sc + 2u), i8_at(sc + 4u), i8_at(sc + 6u));
    return half_at(base + 208u) * dot(scales, acc);
}
