// Workgroup sum of one f32 per thread (64 threads); every thread gets the total.
var<workgroup> scratch: array<f32, 64>;

fn workgroup_sum(value: f32, lid: u32) -> f32 {
    workgroupBarrier();
    scratch[lid] = value;
    workgroupBarrier();
    for (var stride = 32u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            scratch[lid] += scratch[lid + stride];
        }
        workgroupBarrier();
    }
    return scratch[0];
}
