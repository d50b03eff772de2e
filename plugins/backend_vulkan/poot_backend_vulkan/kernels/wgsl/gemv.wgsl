// y[row_offset + r] = sum_k W[first_row + r, k] * x[k]: one token, dense rows read as 16-byte words.
// A workgroup of 256 threads takes 4 rows, 64 threads a row; thread `lane` reads words lane, lane+64, ...
// so each step of the 64 threads is 1 KiB of one row, contiguous. Four words are loaded before any is
// used (independent loads in flight). The 64 partial sums of a row are added with subgroupAdd where the
// device has subgroups of at most 64 lanes (SUBGROUP lines), else by a tree in workgroup memory (TREE).
// WARP (subgroups of exactly 32, NVIDIA): 8 rows of 32 threads, each row one subgroup, summed by one
// subgroupAdd with no workgroup memory and no barrier; linear.py rewrites ROWS and LANES for it.
// The SPLIT variant writes a concatenation's rows to up to three outputs (rows from split1 on to y2, from
// split2 on to y3), so q/k/v or gate/up come out of one dispatch in their own buffers.
// SPLITK: the row's words are cut into p.splits ranges of p.span words, one per workgroup z; each writes its
// partial sum to y[z * p.total + n] and gemv_combine.wgsl adds them (bias and SPLIT outputs go there then).
// GATED (a gate/up concatenation, gate rows before up rows from p.split1 on): a workgroup's row slots pair gate
// row r (even slot) with up row split1 + r (odd slot), and y[r] = gate_act(gate) * up is written (gate_act from
// the including variant); the products themselves are never stored.
// The weight binding (1) and row_sum(row, first, end) come from gemv_words.wgsl (dense rows as 16-byte words,
// with `gemv_<fmt>.wgsl`'s PER_WORD and word_dot) or gemv_units.wgsl (GGUF blocks, one 32-value unit a step,
// PER_WORD = 32 and the layout's dot_<fmt>.wgsl unit_dot); a `word` below is then one such unit.
struct Params {
    rows: u32,
    cols: u32,
    row_offset: u32,
    first_row: u32,
    split1: u32,
    split2: u32,
    span: u32,
    total: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
//BIAS @group(0) @binding(4) var<storage, read> bias: array<f32>;
//SPLIT @group(0) @binding(4) var<storage, read_write> y2: array<f32>;
//SPLIT @group(0) @binding(5) var<storage, read_write> y3: array<f32>;

const ROWS: u32 = 4u;
const LANES: u32 = 64u;
var<workgroup> partial: array<f32, 256>;
//GATED var<workgroup> pair: array<f32, ROWS>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
//SUBGROUP @builtin(subgroup_size) sg_size: u32,
//SUBGROUP @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let lane = lid % LANES;  // (WARP: equal to the subgroup invocation id)
    let slot = lid / LANES;
    var row = (wid.y * groups.x + wid.x) * ROWS + slot;
    //GATED let out_row = (wid.y * groups.x + wid.x) * (ROWS / 2u) + slot / 2u;
    //GATED row = out_row + (slot % 2u) * p.split1;
    let words = p.cols / PER_WORD;
    var acc = 0.0;
    if (row < p.rows) {
        let end = min(words, (wid.z + 1u) * p.span);
        acc = row_sum(p.first_row + row, wid.z * p.span + lane, end);
    }
//TREE partial[lid] = acc;
//TREE workgroupBarrier();
//TREE for (var stride = 32u; stride > 0u; stride >>= 1u) {
//TREE     if (lane < stride) {
//TREE         partial[lid] += partial[lid + stride];
//TREE     }
//TREE     workgroupBarrier();
//TREE }
//TREE let total = partial[slot * LANES];
//WARP let total = subgroupAdd(acc);
//SUBGROUP let summed = subgroupAdd(acc);
//SUBGROUP if (sg_lane == 0u) {
//SUBGROUP     partial[lid / sg_size] = summed;
//SUBGROUP }
//SUBGROUP workgroupBarrier();
//SUBGROUP let per_row = LANES / sg_size;
//SUBGROUP var total = 0.0;
//SUBGROUP for (var j = 0u; j < per_row; j++) {
//SUBGROUP     total += partial[slot * per_row + j];
//SUBGROUP }
    //GATED if (lane == 0u) {
    //GATED     pair[slot] = total;
    //GATED }
    //GATED workgroupBarrier();
    if (lane == 0u && row < p.rows) {
        var value = total;
        var n = p.row_offset + row;
        //GATED if (slot % 2u == 1u) {
        //GATED     return;
        //GATED }
        //GATED value = gate_act(total) * pair[slot + 1u];
        //GATED n = out_row;
        //SPLITK n += wid.z * p.total;
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
}
