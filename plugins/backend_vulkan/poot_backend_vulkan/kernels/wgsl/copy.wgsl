// dst[dst_offset + i] = src[src_offset + i] for i < count (KV-cache writes).
struct Params {
    count: u32,
    src_offset: u32,
    dst_offset: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let i = gid.y * groups.x * 64u + gid.x;
    if (i < p.count) {
        dst[p.dst_offset + i] = src[p.src_offset + i];
    }
}
