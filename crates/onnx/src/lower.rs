//! The inputs and the dense network as ONNX nodes: the same function as
//! `DenseModel::forward_with` for each kind `NetSpec` describes.

use sparrow_model::spec::{DenseLayer, NetSpec};

use crate::graph::{Dim, FLOAT, Graph, STRING, int, ints, strings};

/// The dense columns, one float `[N]` input each, as one `[N, num_dense]`
/// tensor: a NaN (a missing value) reads 0, then log(1 + max(x, 0)) if
/// `log1p`. `None` without dense columns.
pub fn dense_inputs(g: &mut Graph, names: &[String], log1p: bool) -> Option<String> {
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
    if !log1p {
        return Some(x);
    }
    let one = g.float_init("one", &[], vec![1.0]);
    let x = g.node("Max", &[&x, &zero], vec![]);
    let x = g.node("Add", &[&x, &one], vec![]);
    Some(g.node("Log", &[&x], vec![]))
}

/// A sparse column's raw IDs (string `[N]`) as their rows `[N, width]`:
/// `LabelEncoder` maps each ID to its index (an unknown one to the last),
/// `Gather` reads the rows.
pub fn embedded_field(
    g: &mut Graph,
    name: &str,
    ids: &[String],
    vectors: &[f32],
    unknown: &[f32],
    width: usize,
) -> String {
    g.input(name, STRING, &[Dim::Rows]);
    let n = ids.len() as i64;
    let index = g.ml_node(
        "LabelEncoder",
        &[name],
        vec![strings("keys_strings", ids), ints("values_int64s", (0..n).collect()), int("default_int64", n)],
    );
    let mut rows = Vec::with_capacity(vectors.len() + width);
    rows.extend_from_slice(vectors);
    rows.extend_from_slice(unknown);
    let table = g.float_init(&format!("{name}_rows"), &[n + 1, width as i64], rows);
    g.node("Gather", &[&table, &index], vec![int("axis", 0)])
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
    let y = g.node("Add", &[&y, &b], vec![]);
    if l.relu { g.node("Relu", &[&y], vec![]) } else { y }
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
pub fn network(g: &mut Graph, spec: &NetSpec, fields: &[String], dense: Option<&str>, width: usize) -> String {
    match spec {
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
    }
}
