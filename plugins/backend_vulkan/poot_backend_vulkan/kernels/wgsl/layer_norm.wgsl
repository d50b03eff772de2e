// out = (x - mean) / sqrt(var + eps) * w (+ b in the BIAS variant), one workgroup per row.
struct Params {
    cols: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
//BIAS @group(0) @binding(4) var<storage, read> b: array<f32>;

const THREADS: u32 = 64u;

@compute @workgroup_size(THREADS)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * p.cols;
    var total = 0.0;
    for (var k = lid; k < p.cols; k += THREADS) {
        total += x[base + k];
    }
    let mean = workgroup_sum(total, lid) / f32(p.cols);
    var squares = 0.0;
    for (var k = lid; k < p.cols; k += THREADS) {
        let c = x[base + k] - mean;
        squares += c * c;
    }
    let inv = inverseSqrt(workgroup_sum(squares, lid) / f32(p.cols) + p.eps);
    for (var k = lid; k < p.cols; k += THREADS) {
        var v = (x[base + k] - mean) * inv * w[k];
        //BIAS v += b[k];
        out[base + k] = v;
    }
}
