//! The inputs and the dense network as ONNX nodes: the same function as
//! `DenseModel::forward_with` for each kind `NetSpec` describes.

use sparrow_model::spec::{ActivationSpec, DenseLayer, LevelSpec, NetSpec, Op};

use crate::graph::{Dim, FLOAT, Graph, INT64, STRING, float, int, ints, string, strings};
use crate::{OnnxError, SparseInput};

/// The dense columns, one float `[N]` input each, as one `[N, num_dense]`
/// tensor: a NaN (a missing value) reads 0, then log(1 + max(x, 0)) if
/// `log1p`, or (x − mean) · (1 / std) by column with `standardize`'s
/// (mean, 1 / std) pairs. `None` without dense columns.
pub fn dense_inputs(
    g: &mut Graph,
    names: &[String],
    log1p: bool,
    standardize: Option<&[(f32, f32)]>,
) -> Option<String> {
    if names.is_empty() {
        return None;
    }
    let axis = g.int64_init("axis1", &[1], vec![1]);
    let columns: Vec<String> = names
        .iter()
        .map(|name| {
            g.input(name, FLOAT, &[Dim::Rows]);
            g.node("Unsqueeze", &[name, &axis], vec![])
        })
        .collect();
    let x = concat(g, &columns);
    let zero = g.float_init("zero", &[], vec![0.0]);
    let missing = g.node("IsNaN", &[&x], vec![]);
    let x = g.node("Where", &[&missing, &zero, &x], vec![]);
    if let Some(stats) = standardize {
        let width = [stats.len() as i64];
        let mean = g.float_init("dense_mean", &width, stats.iter().map(|s| s.0).collect());
        let inverse = g.float_init("dense_inverse_std", &width, stats.iter().map(|s| s.1).collect());
        let centred = g.node("Sub", &[&x, &mean], vec![]);
        return Some(g.node("Mul", &[&centred, &inverse], vec![]));
    }
    if !log1p {
        return Some(x);
    }
    let one = g.float_init("one", &[], vec![1.0]);
    let x = g.node("Max", &[&x, &zero], vec![]);
    let x = g.node("Add", &[&x, &one], vec![]);
    Some(g.node("Log", &[&x], vec![]))
}

/// A table in the graph: its IDs (a `LabelEncoder` per input that reads
/// it) and its rows (one initializer, shared).
pub struct Table {
    ids: Vec<String>,
    rows: String,
}

/// A field's pooled vector `[N, width]` and, for a list, its items
/// `[N, M, width]` with their weights `[N, M]` (0 for padding and IDs
/// dropped), which attention reads.
pub struct Field {
    pub pooled: String,
    pub items: Option<(String, String)>,
}

/// The rows of `ids` (and, last, the row of an ID not listed) as one
/// initializer.
pub fn table(g: &mut Graph, name: &str, ids: &[String], vectors: &[f32], unknown: &[f32], width: usize) -> Table {
    let mut rows = Vec::with_capacity(vectors.len() + width);
    rows.extend_from_slice(vectors);
    rows.extend_from_slice(unknown);
    let rows = g.float_init(&format!("{name}_rows"), &[ids.len() as i64 + 1, width as i64], rows);
    Table { ids: ids.to_vec(), rows }
}

/// `ids` (strings of any shape) as their rows: `LabelEncoder` maps each to
/// its index (an unknown one to the last), `Gather` reads the rows.
fn rows_of(g: &mut Graph, ids: &str, table: &Table) -> String {
    let n = table.ids.len() as i64;
    let index = g.ml_node(
        "LabelEncoder",
        &[ids],
        vec![strings("keys_strings", &table.ids), ints("values_int64s", (0..n).collect()), int("default_int64", n)],
    );
    g.node("Gather", &[&table.rows, &index], vec![int("axis", 0)])
}

/// A sparse input (string `[N]`) as its field's vector: one ID a cell, or
/// a list split by its separator and pooled (sum, or `mean`); a sequence
/// keeps its newest `max_len` IDs.
pub fn embedded_field(g: &mut Graph, s: &SparseInput, table: &Table, mean: bool) -> Field {
    if let Some(boundaries) = &s.buckets {
        let ids = bucket_ids(g, &s.name, boundaries);
        return Field { pooled: rows_of(g, &ids, table), items: None };
    }
    g.input(&s.name, STRING, &[Dim::Rows]);
    let Some(separator) = &s.separator else {
        return Field { pooled: rows_of(g, &s.name, table), items: None };
    };
    let split = g.node_outputs("StringSplit", &[&s.name], vec![string("delimiter", separator)], 2);
    let pieces = &split[0]; // [N, M], padded with ""
    let empty = g.string_init("empty", "");
    let is_empty = g.node("Equal", &[pieces, &empty], vec![]);
    let mut keep = g.node("Not", &[&is_empty], vec![]);
    if let Some(max_len) = s.max_len {
        // The newest `max_len`: those with at most `max_len` IDs at or after them.
        let count = g.node("Cast", &[&keep], vec![int("to", i64::from(INT64))]);
        let axis = g.int64_init("axis", &[], vec![1]);
        let after = g.node("CumSum", &[&count, &axis], vec![int("reverse", 1)]);
        let limit = g.int64_init("max_len", &[], vec![max_len as i64]);
        let recent = g.node("LessOrEqual", &[&after, &limit], vec![]);
        keep = g.node("And", &[&keep, &recent], vec![]);
    }
    let weights = g.node("Cast", &[&keep], vec![int("to", i64::from(FLOAT))]);
    let items = rows_of(g, pieces, table); // [N, M, width]
    let axis2 = g.int64_init("axis2", &[1], vec![2]);
    let w = g.node("Unsqueeze", &[&weights, &axis2], vec![]);
    let weighted = g.node("Mul", &[&items, &w], vec![]);
    let axis1 = g.int64_init("axis1", &[1], vec![1]);
    let mut pooled = g.node("ReduceSum", &[&weighted, &axis1], vec![int("keepdims", 0)]);
    if mean {
        let count = g.node("ReduceSum", &[&weights, &axis1], vec![int("keepdims", 1)]);
        let one = g.float_init("one", &[], vec![1.0]);
        let count = g.node("Max", &[&count, &one], vec![]);
        pooled = g.node("Div", &[&pooled, &count], vec![]);
    }
    Field { pooled, items: Some((items, weights)) }
}

/// A bucketized field's float input `[N]` as the IDs the readers give it:
/// the number of boundaries at or below each value, as text; NaN (a
/// missing value) the empty ID.
fn bucket_ids(g: &mut Graph, name: &str, boundaries: &[f64]) -> String {
    g.input(name, FLOAT, &[Dim::Rows]);
    let axis = g.int64_init("axis1", &[1], vec![1]);
    let column = g.node("Unsqueeze", &[name, &axis], vec![]);
    let bounds = boundaries.iter().map(|&b| b as f32).collect::<Vec<_>>();
    let bounds = g.float_init(&format!("{name}_boundaries"), &[boundaries.len() as i64], bounds);
    let at_or_below = g.node("GreaterOrEqual", &[&column, &bounds], vec![]);
    let counted = g.node("Cast", &[&at_or_below], vec![int("to", i64::from(INT64))]);
    let bucket = g.node("ReduceSum", &[&counted, &axis], vec![int("keepdims", 0)]);
    let text = g.node("Cast", &[&bucket], vec![int("to", i64::from(STRING))]);
    let missing = g.node("IsNaN", &[name], vec![]);
    let empty = g.string_init("empty", "");
    g.node("Where", &[&missing, &empty, &text], vec![])
}

fn concat(g: &mut Graph, parts: &[String]) -> String {
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    g.node("Concat", &refs, vec![int("axis", 1)])
}

/// Columns `start..end` of a `[N, width]` tensor.
fn columns(g: &mut Graph, v: &str, start: usize, end: usize) -> String {
    let s = g.int64_init("start", &[1], vec![start as i64]);
    let e = g.int64_init("end", &[1], vec![end as i64]);
    let a = g.int64_init("axis1", &[1], vec![1]);
    g.node("Slice", &[v, &s, &e, &a], vec![])
}

fn sum(g: &mut Graph, parts: &[String]) -> String {
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    g.node("Sum", &refs, vec![])
}

fn layer(g: &mut Graph, x: &str, l: &DenseLayer) -> String {
    let w = g.float_init("w", &[l.fan_in as i64, l.fan_out as i64], l.weight.clone());
    let b = g.float_init("b", &[l.fan_out as i64], l.bias.clone());
    let y = g.node("MatMul", &[x, &w], vec![]);
    let mut y = g.node("Add", &[&y, &b], vec![]);
    if let Some(n) = &l.norm {
        let gamma = g.float_init("gamma", &[l.fan_out as i64], n.gamma.clone());
        let beta = g.float_init("beta", &[l.fan_out as i64], n.beta.clone());
        y = match &n.running {
            None => g.node("LayerNormalization", &[&y, &gamma, &beta], vec![int("axis", -1), float("epsilon", n.eps)]),
            Some(r) => {
                let xhat = by_running_statistics(g, &y, (&r.mean, &r.var), n.eps);
                let scaled = g.node("Mul", &[&xhat, &gamma], vec![]);
                g.node("Add", &[&scaled, &beta], vec![])
            }
        };
    }
    match &l.activation {
        Some(a) => activation(g, &y, l.fan_out, a),
        None => y,
    }
}

/// (z − mean)·(1/√(var + eps)) over the last axis (any rank: DIN's unit
/// runs on `[N, items, 4·d]`), the factor computed as the training code
/// computes it, so the same bits.
fn by_running_statistics(g: &mut Graph, z: &str, (mean, var): (&[f32], &[f32]), eps: f32) -> String {
    let columns = [mean.len() as i64];
    let mean = g.float_init("running_mean", &columns, mean.to_vec());
    let inv = g.float_init("running_inv_std", &columns, var.iter().map(|v| 1.0 / (v + eps).sqrt()).collect());
    let centred = g.node("Sub", &[z, &mean], vec![]);
    g.node("Mul", &[&centred, &inv], vec![])
}

/// `model.activation` on `z` (`[…, fan_out]`).
fn activation(g: &mut Graph, z: &str, fan_out: usize, a: &ActivationSpec) -> String {
    let columns = [fan_out as i64];
    match a {
        ActivationSpec::Relu => g.node("Relu", &[z], vec![]),
        ActivationSpec::Prelu { slope } => {
            let slope = g.float_init("slope", &[1], vec![*slope]);
            g.node("PRelu", &[z, &slope], vec![])
        }
        ActivationSpec::Gelu => g.node("Gelu", &[z], vec![string("approximate", "none")]),
        ActivationSpec::Silu => {
            let p = g.node("Sigmoid", &[z], vec![]);
            g.node("Mul", &[z, &p], vec![])
        }
        ActivationSpec::Dice { alpha, mean, var, eps } => {
            // ẑ by the running statistics (a batch norm of scale 1, shift 0),
            // then z·(α + (1 − α)·σ(ẑ)).
            let zhat = by_running_statistics(g, z, (mean, var), *eps);
            let p = g.node("Sigmoid", &[&zhat], vec![]);
            let alpha_init = g.float_init("dice_alpha", &columns, alpha.clone());
            let rest = g.float_init("dice_one_minus_alpha", &columns, alpha.iter().map(|a| 1.0 - a).collect());
            let scaled = g.node("Mul", &[&p, &rest], vec![]);
            let gate = g.node("Add", &[&scaled, &alpha_init], vec![]);
            g.node("Mul", &[z, &gate], vec![])
        }
    }
}

fn mlp(g: &mut Graph, x: &str, layers: &[DenseLayer]) -> String {
    layers.iter().fold(x.to_string(), |h, l| layer(g, &h, l))
}

/// ½ Σ_d [(Σ_f v_fd)² − Σ_f v_fd²], `[N, 1]`.
fn fm_second_order(g: &mut Graph, vectors: &[String]) -> String {
    let s = sum(g, vectors);
    let s2 = g.node("Mul", &[&s, &s], vec![]);
    let squares: Vec<String> = vectors.iter().map(|v| g.node("Mul", &[v, v], vec![])).collect();
    let q = sum(g, &squares);
    let diff = g.node("Sub", &[&s2, &q], vec![]);
    let axis = g.int64_init("axis1", &[1], vec![1]);
    let r = g.node("ReduceSum", &[&diff, &axis], vec![int("keepdims", 1)]);
    let half = g.float_init("half", &[], vec![0.5]);
    g.node("Mul", &[&r, &half], vec![])
}

/// Σ_f column 0 (+ FM's second order over columns 1..) + dense·w + bias.
fn first_order(
    g: &mut Graph,
    fields: &[String],
    width: usize,
    second_order: bool,
    dense_layer: Option<&DenseLayer>,
    dense: Option<&str>,
    bias: f32,
) -> String {
    let firsts: Vec<String> = fields.iter().map(|v| columns(g, v, 0, 1)).collect();
    let mut t = if firsts.is_empty() { g.float_init("no_fields", &[1], vec![0.0]) } else { sum(g, &firsts) };
    if second_order && !fields.is_empty() {
        let vectors: Vec<String> = fields.iter().map(|v| columns(g, v, 1, width)).collect();
        let fm = fm_second_order(g, &vectors);
        t = g.node("Add", &[&t, &fm], vec![]);
    }
    if let (Some(l), Some(x)) = (dense_layer, dense) {
        let y = layer(g, x, l);
        t = g.node("Add", &[&t, &y], vec![]);
    }
    let b = g.float_init("bias", &[1], vec![bias]);
    g.node("Add", &[&t, &b], vec![])
}

/// The fields' vectors then the dense values, `[N, F·d + num_dense]`.
fn flat(g: &mut Graph, vectors: &[String], dense: Option<&str>) -> String {
    let mut parts = vectors.to_vec();
    parts.extend(dense.map(String::from));
    concat(g, &parts)
}

/// The logits `[N, 1]` from each field's vector `[N, width]` and the dense
/// values `[N, num_dense]`.
pub fn network(
    g: &mut Graph,
    spec: &NetSpec,
    inputs: &[Field],
    dense: Option<&str>,
    width: usize,
) -> Result<String, OnnxError> {
    let fields: Vec<String> = inputs.iter().map(|f| f.pooled.clone()).collect();
    let fields = &fields[..];
    Ok(match spec {
        NetSpec::FirstOrder { second_order, dense: l, bias } => {
            first_order(g, fields, width, *second_order, l.as_ref(), dense, *bias)
        }
        NetSpec::Mlp { layers } => {
            let x = flat(g, fields, dense);
            mlp(g, &x, layers)
        }
        NetSpec::WideDeep { second_order, dense: l, bias, deep } => {
            let wide = first_order(g, fields, width, *second_order, l.as_ref(), dense, *bias);
            let vectors: Vec<String> = fields.iter().map(|v| columns(g, v, 1, width)).collect();
            let x = flat(g, &vectors, dense);
            let deep = mlp(g, &x, deep);
            g.node("Add", &[&wide, &deep], vec![])
        }
        NetSpec::Dlrm { bottom, top } => {
            let b = match (bottom, dense) {
                (Some(layers), Some(x)) => Some(mlp(g, x, layers)),
                _ => None,
            };
            let axis = g.int64_init("axis1", &[1], vec![1]);
            let rows: Vec<String> = b.iter().chain(fields).map(|v| g.node("Unsqueeze", &[v, &axis], vec![])).collect();
            let n = rows.len();
            let t = concat(g, &rows); // [N, n, d]
            let tt = g.node("Transpose", &[&t], vec![ints("perm", vec![0, 2, 1])]);
            let dots = g.node("MatMul", &[&t, &tt], vec![]); // [N, n, n]
            let shape = g.int64_init("dots_shape", &[2], vec![-1, (n * n) as i64]);
            let dots = g.node("Reshape", &[&dots, &shape], vec![]);
            let pairs: Vec<i64> = (0..n).flat_map(|i| ((i + 1)..n).map(move |j| (i * n + j) as i64)).collect();
            let pairs = g.int64_init("pairs", &[pairs.len() as i64], pairs);
            let inter = g.node("Gather", &[&dots, &pairs], vec![int("axis", 1)]);
            let top_in = match b {
                Some(b) => concat(g, &[b, inter]),
                None => inter,
            };
            mlp(g, &top_in, top)
        }
        NetSpec::MultiTask { esmm: true, towers, .. } => {
            let x = flat(g, fields, dense);
            let (a, b) = match &towers[..] {
                [ctr, cvr] => (mlp(g, &x, ctr), mlp(g, &x, cvr)),
                _ => unreachable!("ESMM has a CTR and a CVR tower"),
            };
            // logit(σ(a)·σ(b)) = −logsumexp(−a, −b, −a−b)
            let na = g.node("Neg", &[&a], vec![]);
            let nb = g.node("Neg", &[&b], vec![]);
            let nab = g.node("Sub", &[&na, &b], vec![]);
            let z = concat(g, &[na, nb, nab]);
            let axis1 = g.int64_init("axis1", &[1], vec![1]);
            let lse = g.node("ReduceLogSumExp", &[&z, &axis1], vec![int("keepdims", 1)]);
            let ctcvr = g.node("Neg", &[&lse], vec![]);
            concat(g, &[a, ctcvr])
        }
        NetSpec::MultiTask { levels, towers, .. } => {
            let x = flat(g, fields, dense);
            let tasks = towers.len();
            let (mut inputs, mut shared_in) = (vec![x.clone(); tasks], x);
            for level in levels {
                (inputs, shared_in) = experts_level(g, level, &inputs, &shared_in);
            }
            let outs: Vec<String> = towers.iter().zip(&inputs).map(|(t, x)| mlp(g, x, t)).collect();
            concat(g, &outs)
        }
        NetSpec::Dcn { cross, deep } => {
            let x0 = flat(g, fields, dense);
            let mut x = x0.clone();
            for l in cross {
                let gate = layer(g, &x, l);
                let gated = g.node("Mul", &[&x0, &gate], vec![]);
                x = g.node("Add", &[&gated, &x], vec![]);
            }
            mlp(g, &x, deep)
        }
        NetSpec::Ops(list) => ops(g, list, fields, dense)?,
        NetSpec::Din { pairs, units, mlp: top } => {
            let mut slots = fields.to_vec();
            for (&(slot, query), unit) in pairs.iter().zip(units) {
                let (items, weights) = inputs[slot].items.as_ref().ok_or(OnnxError::AttentionNeedsRows)?;
                slots[slot] = attend(g, &fields[query], items, weights, unit);
            }
            let x = flat(g, &slots, dense);
            mlp(g, &x, top)
        }
    })
}

/// A kind written as generic operations ([`Op`]): each op's value in turn.
fn ops(g: &mut Graph, ops: &[Op], fields: &[String], dense: Option<&str>) -> Result<String, OnnxError> {
    let mut values: Vec<String> = Vec::with_capacity(ops.len());
    for op in ops {
        let value = match op {
            Op::SumFields { start, end } | Op::SumFieldSquares { start, end } => {
                let mut parts: Vec<String> = fields.iter().map(|v| columns(g, v, *start, *end)).collect();
                if matches!(op, Op::SumFieldSquares { .. }) {
                    parts = parts.iter().map(|v| g.node("Mul", &[v, v], vec![])).collect();
                }
                if parts.is_empty() {
                    return Err(OnnxError::Ops { what: "a sum over no fields" });
                }
                sum(g, &parts)
            }
            Op::Fields { start, end } => {
                let parts: Vec<String> = fields.iter().map(|v| columns(g, v, *start, *end)).collect();
                concat(g, &parts)
            }
            Op::DenseValues => dense.ok_or(OnnxError::Ops { what: "dense values in a model without them" })?.into(),
            Op::Add(a, b) | Op::Sub(a, b) | Op::Mul(a, b) => {
                let name = match op {
                    Op::Add(..) => "Add",
                    Op::Sub(..) => "Sub",
                    _ => "Mul",
                };
                let (a, b) = (operand(&values, *a)?, operand(&values, *b)?);
                g.node(name, &[&a, &b], vec![])
            }
            Op::Scale(a, c) | Op::Offset(a, c) => {
                let a = operand(&values, *a)?;
                let c = g.float_init("constant", &[], vec![*c]);
                g.node(if matches!(op, Op::Scale(..)) { "Mul" } else { "Add" }, &[&a, &c], vec![])
            }
            Op::Concat(parts) => {
                let parts = parts.iter().map(|&i| operand(&values, i)).collect::<Result<Vec<_>, _>>()?;
                concat(g, &parts)
            }
            Op::Layers(a, layers) => {
                let a = operand(&values, *a)?;
                mlp(g, &a, layers)
            }
        };
        values.push(value);
    }
    values.pop().ok_or(OnnxError::Ops { what: "no operations" })
}

/// An earlier op's value (a later one's is a malformed spec).
fn operand(values: &[String], i: usize) -> Result<String, OnnxError> {
    values.get(i).cloned().ok_or(OnnxError::Ops { what: "an operand that is not an earlier op" })
}

/// DIN's pooling of one sequence: Σ_k unit([q, k, q − k, q ⊙ k])·k over the
/// kept items k (`weights` 1; padding 0), `[N, width]`.
fn attend(g: &mut Graph, query: &str, items: &str, weights: &str, unit: &[DenseLayer]) -> String {
    let axis1 = g.int64_init("axis1", &[1], vec![1]);
    let axis2 = g.int64_init("axis2", &[1], vec![2]);
    let q = g.node("Unsqueeze", &[query, &axis1], vec![]); // [N, 1, d]
    let shape = g.node("Shape", &[items], vec![]);
    let q = g.node("Expand", &[&q, &shape], vec![]); // [N, M, d]
    let diff = g.node("Sub", &[&q, items], vec![]);
    let prod = g.node("Mul", &[&q, items], vec![]);
    let features = g.node("Concat", &[&q, items, &diff, &prod], vec![int("axis", 2)]);
    let score = mlp(g, &features, unit); // [N, M, 1]
    let w = g.node("Unsqueeze", &[weights, &axis2], vec![]);
    let score = g.node("Mul", &[&score, &w], vec![]);
    let weighted = g.node("Mul", &[items, &score], vec![]);
    g.node("ReduceSum", &[&weighted, &axis1], vec![int("keepdims", 0)])
}

/// One level of MMoE/PLE: each task's mix, and the next shared input.
fn experts_level(g: &mut Graph, level: &LevelSpec, inputs: &[String], shared_in: &str) -> (Vec<String>, String) {
    let shared: Vec<String> = level.shared.iter().map(|e| mlp(g, shared_in, e)).collect();
    let own: Vec<Vec<String>> =
        level.own.iter().zip(inputs).map(|(es, x)| es.iter().map(|e| mlp(g, x, e)).collect()).collect();
    let mut next = Vec::with_capacity(inputs.len());
    for (t, gate) in level.gates.iter().enumerate() {
        let mut pool: Vec<String> = own.get(t).cloned().unwrap_or_default();
        pool.extend(shared.iter().cloned());
        let weights = layer(g, &inputs[t], gate);
        next.push(mix(g, &weights, &pool));
    }
    let shared_next = match &level.shared_gate {
        Some(gate) => {
            let mut pool = shared.clone();
            pool.extend(own.iter().flatten().cloned());
            let weights = layer(g, shared_in, gate);
            mix(g, &weights, &pool)
        }
        None => shared_in.to_string(),
    };
    (next, shared_next)
}

/// Σ_k softmax(gate)_k · expert_k: `gate` `[N, K]`, each expert `[N, H]`.
fn mix(g: &mut Graph, gate: &str, experts: &[String]) -> String {
    let w = g.node("Softmax", &[gate], vec![int("axis", 1)]);
    let axis1 = g.int64_init("axis1", &[1], vec![1]);
    let axis2 = g.int64_init("axis2", &[1], vec![2]);
    let stacked: Vec<String> = experts.iter().map(|e| g.node("Unsqueeze", &[e, &axis1], vec![])).collect();
    let stacked = concat(g, &stacked); // [N, K, H]
    let w = g.node("Unsqueeze", &[&w, &axis2], vec![]); // [N, K, 1]
    let weighted = g.node("Mul", &[&stacked, &w], vec![]);
    g.node("ReduceSum", &[&weighted, &axis1], vec![int("keepdims", 0)])
}

/// A served output from the logits `[N, L]`: a binary task's σ of its
/// logit (`[N]`), or a multiclass task's softmax (`[N, K]`).
pub fn head(g: &mut Graph, logits: &str, out: &crate::ServedOutput) -> String {
    let x = columns(g, logits, out.offset, out.offset + out.per_row);
    if out.multiclass {
        g.node_named(&out.name, "Softmax", &[&x], vec![int("axis", 1)])
    } else {
        let p = g.node("Sigmoid", &[&x], vec![]);
        let flat = g.int64_init("rows_shape", &[1], vec![-1]);
        g.node_named(&out.name, "Reshape", &[&p, &flat], vec![])
    }
}
