// out[i] = combine(a[i], b[i]); combine() comes from the including variant (gated activations, add);
// activations.wgsl is included before it.
struct Params {
    count: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.y * groups.x * 64u + gid.x;
    if (i < p.count) {
        out[i] = combine(a[i], b[i]);
    }
}
