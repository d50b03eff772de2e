// Q8_0 unit_dot: 34-byte blocks, f16 d then 32 int8.
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 32u) + u) * 34u;
    let d = half_at(base);
    var acc = 0.0;
    for (var j = 0u; j < 8u; j++) {
        acc += dot(signed_bytes(word_at(base + 2u + 4u * j)), x[u * 8u + j]);
    }
    return d * acc;
}
