// Q3_K unit_dot: sub-block u % 8 of a 110-byte super-block (layout as fmt_q3_k.wgsl), words through word_at
// (super-blocks are 2-byte aligned): q = low 2 bits - 4, plus 4 where bit `sub` of the mask byte is set.
fn q3k_scale(base: u32, s: u32) -> f32 {
    let low = (byte_at(base + 96u + s % 8u) >> (4u * (s / 8u))) & 15u;
    let high = (byte_at(base + 104u + s % 4u) >> (2u * (s / 4u))) & 3u;
    return f32(i32(low | (high << 4u)) - 32);
}

fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 110u;
    let sub = u % 8u;
    let qs = base + 32u + (sub / 4u) * 32u;
    let shift = 2u * (sub % 4u);
    var dq = vec2<f32>(0.0);
    for (var j = 0u; j < 8u; j++) {
        let q = nibbles(word_at(qs + 4u * j), shift, 3u) - 4.0 + 4.0 * nibbles(word_at(base + 4u * j), sub, 1u);
        dq[j / 4u] += dot(q, x[u * 8u + j]);
    }
    return half_at(base + 108u) * (q3k_scale(base, 2u * sub) * dq.x + q3k_scale(base, 2u * sub + 1u) * dq.y);
}
