// GGUF Q8_0: 34-byte blocks of 32 values, f16 scale then 32 int8.
fn decode_unit(row: u32, u: u32, vals: ptr<function, array<f32, 32>>) {
    let base = (row * (p.cols / 32u) + u) * 34u;
    let d = half_at(base);
    for (var i = 0u; i < 32u; i++) {
        (*vals)[i] = d * i8_at(base + 2u + i);
    }
}
