// unit_dot through the format's decode_unit (the 32 values in a private array, then the dot with x).
fn unit_dot(row: u32, u: u32) -> f32 {
    var vals: array<f32, 32>;
    decode_unit(row, u, &vals);
    var acc = 0.0;
    for (var j = 0u; j < 8u; j++) {
        acc += dot(vec4<f32>(vals[4u * j], vals[4u * j + 1u], vals[4u * j + 2u], vals[4u * j + 3u]), x[u * 8u + j]);
    }
    return acc;
}
