// IQ4_XS unit_dot: sub-block u % 8 of a 136-byte super-block (scale as fmt_iq4_xs.wgsl), its 16 aligned bytes
// of level indices read as 4 words.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 256u) + u / 8u) * 136u;
    let sub = u % 8u;
    let head = wt[base >> 2u];
    let high = (head >> (16u + 2u * sub)) & 3u;
    let low = (wt[(base >> 2u) + 1u] >> (4u * sub)) & 15u;
    let qs = (base + 8u + sub * 16u) >> 2u;
    var acc = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let w = wt[qs + j];
        acc += dot(iq4_levels(w, 0u), x[u * 8u + j]) + dot(iq4_levels(w, 4u), x[u * 8u + 4u + j]);
    }
    return unpack2x16float(head).x * f32(i32(low | (high << 4u)) - 32) * acc;
}
