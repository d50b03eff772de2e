// Q5_0 unit_dot: 22-byte blocks (f16 d, 32 high bits, 16 bytes of low nibbles), words through word_at; value j
// is nibble j % 16 (high nibbles from 16) with bit j of the high bits: d * (q - 16).
fn unit_dot(row: u32, u: u32) -> f32 {
    let base = (row * (p.cols / 32u) + u) * 22u;
    let qh = vec4<u32>(word_at(base + 2u));
    var acc = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let w = word_at(base + 6u + 4u * j);
        let at = vec4<u32>(4u * j) + vec4<u32>(0u, 1u, 2u, 3u);
        let lo = nibbles(w, 0u, 15u) + 16.0 * vec4<f32>((qh >> at) & vec4<u32>(1u)) - 16.0;
        let hi = nibbles(w, 4u, 15u) + 16.0 * vec4<f32>((qh >> (at + vec4<u32>(16u))) & vec4<u32>(1u)) - 16.0;
        acc += dot(lo, x[u * 8u + j]) + dot(hi, x[u * 8u + 4u + j]);
    }
    return half_at(base) * acc;
}
