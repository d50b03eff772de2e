// Activation functions shared by the elementwise and MoE shaders.
// tanh through exp, with the argument clamped: tanh(15) is 1 in f32 and exp stays finite
fn safe_tanh(v: f32) -> f32 {
    let e = exp(2.0 * clamp(v, -15.0, 15.0));
    return (e - 1.0) / (e + 1.0);
}

fn silu(v: f32) -> f32 {
    return v / (1.0 + exp(-v));
}

fn gelu_tanh(v: f32) -> f32 {
    return 0.5 * v * (1.0 + safe_tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
}
