// Rotary embedding in place on x[tokens, heads, head_dim]: pair i is (step * i, step * i + gap), so
// neox "rotate half" is step 1, gap rot_dim / 2 and the interleaved form (llama.cpp's layout of
// permuted q/k) is step 2, gap 1. Only the first
// rot_dim values of each head rotate (partial rotary); inv_freq holds rot_dim / 2 inverse frequencies,
// already scaled on the host (llama3, linear, yarn); factor scales cos and sin (YaRN's attention factor,
// 1 otherwise). positions[t] is token t's absolute position.
struct Params {
    tokens: u32,
    heads: u32,
    head_dim: u32,
    rot_dim: u32,
    step: u32,
    gap: u32,
    factor: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> positions: array<u32>;
@group(0) @binding(3) var<storage, read> inv_freq: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let half = p.rot_dim / 2u;
    let index = gid.y * groups.x * 64u + gid.x;
    if (index >= p.tokens * p.heads * half) {
        return;
    }
    let i = index % half;
    let th = index / half;  // token * heads + head
    let t = th / p.heads;
    let angle = f32(positions[t]) * inv_freq[i];
    let c = cos(angle) * p.factor;
    let s = sin(angle) * p.factor;
    let a = th * p.head_dim + p.step * i;
    let x1 = x[a];
    let x2 = x[a + p.gap];
    x[a] = x1 * c - x2 * s;
    x[a + p.gap] = x2 * c + x1 * s;
}
