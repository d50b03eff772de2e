// Q6_K unit_dot: group g of half h of a 210-byte super-block (offsets as fmt_q6_k.wgsl); super-blocks are only
// 2-byte aligned, so words come through word_at. Values 0..15 of the unit take scale s, 16..31 scale s + 1.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 210u;
    let half = (u % 8u) / 4u;
    let g = u % 4u;
    let ql = base + half * 64u + (g & 1u) * 32u;
    let qh = base + 128u + half * 32u;
    let nibble_shift = (g / 2u) * 4u;
    let scales = base + 192u + half * 8u + 2u * g;
    var part = vec2<f32>(0.0);
    for (var j = 0u; j < 8u; j++) {
        let q = nibbles(word_at(ql + 4u * j), nibble_shift, 15u) + 16.0 * nibbles(word_at(qh + 4u * j), 2u * g, 3u);
        part[j / 4u] += dot(q - 32.0, x[u * 8u + j]);
    }
    return half_at(base + 208u) * (i8_at(scales) * part.x + i8_at(scales + 1u) * part.y);
}
