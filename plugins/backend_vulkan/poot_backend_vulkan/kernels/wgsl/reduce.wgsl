// Workgroup sum of one f32 per thread; every thread gets the total. THREADS (the workgroup's size, a power of
// two) is the including shader's.
var<workgroup> scratch: array<f32, THREADS>;

fn workgroup_sum(value: f32, lid: u32) -> f32 {
    workgroupBarrier();
    scratch[lid] = value;
    workgroupBarrier();
    for (var stride = THREADS / 2u; stride > 0u; stride >>= 1u) {
        if (lid < stride) {
            scratch[lid] += scratch[lid + stride];
        }
        workgroupBarrier();
    }
    return scratch[0];
}
