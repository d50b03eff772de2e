// f32: 4 values per word.
const PER_WORD: u32 = 4u;

fn word_dot(w: vec4<u32>, i: u32) -> f32 {
    return dot(bitcast<vec4<f32>>(w), x[i]);
}
