// Q4_0 unit_dot: 18-byte blocks (f16 d, 16 bytes); byte j's low nibble is value j, its high nibble value j + 16.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 32u) + u) * 18u;
    let d = half_at(base);
    var acc = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let w = word_at(base + 2u + 4u * j);
        acc += dot(nibbles(w, 0u, 15u) - 8.0, x[u * 8u + j]) + dot(nibbles(w, 4u, 15u) - 8.0, x[u * 8u + 4u + j]);
    }
    return d * acc;
}
