// bf16: 8 values per word; a bf16 is the top half of an f32, the even value in each u32's low half.
const PER_WORD: u32 = 8u;

fn word_dot(w: vec4<u32>, i: u32) -> f32 {
    let even = bitcast<vec4<f32>>(w << vec4<u32>(16u));
    let odd = bitcast<vec4<f32>>(w & vec4<u32>(0xffff0000u));
    let a = x[2u * i];
    let b = x[2u * i + 1u];
    return dot(even, vec4<f32>(a.x, a.z, b.x, b.z)) + dot(odd, vec4<f32>(a.y, a.w, b.y, b.w));
}
