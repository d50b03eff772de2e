// Adds the split-K partial sums of gemv.wgsl (SPLITK): y[n] = sum_s partial[s * p.total + n] (+ bias[n]), rows
// from split1 on to y2 and from split2 on to y3 (SPLIT), as gemv.wgsl itself writes them without splits.
// GATED: rows from split1 on are the up rows of the gate rows before them; y[n] = gate_act(gate) * up for n < split1.
struct Params {
    total: u32,
    splits: u32,
    split1: u32,
    split2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> partial: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
//BIAS @group(0) @binding(3) var<storage, read> bias: array<f32>;
//SPLIT @group(0) @binding(3) var<storage, read_write> y2: array<f32>;
//SPLIT @group(0) @binding(4) var<storage, read_write> y3: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    let n = gid.y * groups.x * 64u + gid.x;
    if (n >= p.total) {
        return;
    }
    var value = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        value += partial[s * p.total + n];
    }
    //GATED if (n >= p.split1) {
    //GATED     return;
    //GATED }
    //GATED var up = 0.0;
    //GATED for (var s = 0u; s < p.splits; s++) {
    //GATED     up += partial[s * p.total + p.split1 + n];
    //GATED }
    //GATED value = gate_act(value) * up;
    //BIAS value += bias[n];
    //SPLIT if (n >= p.split2) {
    //SPLIT     y3[n - p.split2] = value;
    //SPLIT     return;
    //SPLIT }
    //SPLIT if (n >= p.split1) {
    //SPLIT     y2[n - p.split1] = value;
    //SPLIT     return;
    //SPLIT }
    y[n] = value;
}
