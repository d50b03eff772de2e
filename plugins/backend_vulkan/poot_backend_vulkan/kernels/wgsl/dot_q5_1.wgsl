// Q5_1 unit_dot: 24-byte blocks (f16 d, f16 m, 32 high bits, 16 bytes of low nibbles), every word aligned;
// value = d * q + m with q of 5 bits as in Q5_0.
fn unit_dot(row: u32, u: u32) -> f32 {
    let at4 = (row * (p.cols / 32u) + u) * 6u;  // the block's first word
    let dm = unpack2x16float(wt[at4]);
    let qh = vec4<u32>(wt[at4 + 1u]);
    var acc = 0.0;
    var xs = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        let w = wt[at4 + 2u + j];
        let at = vec4<u32>(4u * j) + vec4<u32>(0u, 1u, 2u, 3u);
        let lo = nibbles(w, 0u, 15u) + 16.0 * vec4<f32>((qh >> at) & vec4<u32>(1u));
        let hi = nibbles(w, 4u, 15u) + 16.0 * vec4<f32>((qh >> (at + vec4<u32>(16u))) & vec4<u32>(1u));
        let a = x[u * 8u + j];
        let b = x[u * 8u + 4u + j];
        acc += dot(lo, a) + dot(hi, b);
        xs += a + b;
    }
    return dm.x * acc + dm.y * (xs.x + xs.y + xs.z + xs.w);
}
