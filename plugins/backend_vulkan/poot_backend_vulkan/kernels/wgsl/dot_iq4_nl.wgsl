// IQ4_NL unit_dot: 18-byte blocks (f16 d, 16 bytes of level indices; low nibbles values 0..15, high 16..31).
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 32u) + u) * 18u;
    var acc = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let w = word_at(base + 2u + 4u * j);
        acc += dot(iq4_levels(w, 0u), x[u * 8u + j]) + dot(iq4_levels(w, 4u), x[u * 8u + 4u + j]);
    }
    return half_at(base) * acc;
}
