// f16: 8 values per word, widened with unpack2x16float (no shader-f16 needed).
const PER_WORD: u32 = 8u;

fn word_dot(w: vec4<u32>, i: u32) -> f32 {
    let lo = vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
    let hi = vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
    return dot(lo, x[2u * i]) + dot(hi, x[2u * i + 1u]);
}
