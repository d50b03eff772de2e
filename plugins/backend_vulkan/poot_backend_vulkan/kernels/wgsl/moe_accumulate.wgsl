// out[t, i] (+)= w_t * y[t, i] over rows t of p.width values. w_t = weights[t * p.stride + p.column]; mode bits:
// 1 assign instead of add (the first expert), 2 take sigmoid(w_t) (a shared expert's gate), 4 w_t = 1.
struct Params {
    count: u32,
    width: u32,
    stride: u32,
    column: u32,
    mode: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> weights: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.y * groups.x * 64u + gid.x;
    if (i >= p.count) {
        return;
    }
    var w = 1.0;
    if ((p.mode & 4u) == 0u) {
        w = weights[(i / p.width) * p.stride + p.column];
        if ((p.mode & 2u) != 0u) {
            w = 1.0 / (1.0 + exp(-w));
        }
    }
    let v = w * y[i];
    if ((p.mode & 1u) != 0u) {
        out[i] = v;
    } else {
        out[i] = out[i] + v;
    }
}
