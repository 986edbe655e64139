//! A small builder of ONNX graphs: unique names, initializers, nodes,
//! typed inputs and outputs.

use crate::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto,
    ValueInfoProto, attribute_proto::AttributeType, tensor_shape_proto, type_proto,
};

pub const FLOAT: i32 = 1;
pub const INT64: i32 = 7;
pub const STRING: i32 = 8;

/// IR version 9 and opset 20 (ONNX 1.15, for `StringSplit`): what ONNX
/// Runtime 1.17 and later, and Triton's ONNX Runtime backend built on it
/// (Triton 24.01 and later), load.
const IR_VERSION: i64 = 9;
const OPSET: i64 = 20;
/// `ai.onnx.ml` 2: LabelEncoder with string keys and int64 values.
const ML_OPSET: i64 = 2;
pub const ML_DOMAIN: &str = "ai.onnx.ml";

/// A dimension of an input or output: the batch's rows, or a fixed size.
#[derive(Clone, Copy)]
pub enum Dim {
    Rows,
    Fixed(i64),
}

#[derive(Default)]
pub struct Graph {
    name: String,
    nodes: Vec<NodeProto>,
    initializers: Vec<TensorProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    next: usize,
}

pub fn ints(name: &str, values: Vec<i64>) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        ints: values,
        r#type: Some(AttributeType::Ints as i32),
        ..Default::default()
    }
}

pub fn int(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        i: Some(value),
        r#type: Some(AttributeType::Int as i32),
        ..Default::default()
    }
}

pub fn float(name: &str, value: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        f: Some(value),
        r#type: Some(AttributeType::Float as i32),
        ..Default::default()
    }
}

pub fn string(name: &str, value: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        s: Some(value.as_bytes().to_vec()),
        r#type: Some(AttributeType::String as i32),
        ..Default::default()
    }
}

pub fn strings(name: &str, values: &[String]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        strings: values.iter().map(|s| s.as_bytes().to_vec()).collect(),
        r#type: Some(AttributeType::Strings as i32),
        ..Default::default()
    }
}

fn value_info(name: &str, elem_type: i32, dims: &[Dim]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| tensor_shape_proto::Dimension {
            value: Some(match d {
                Dim::Rows => tensor_shape_proto::dimension::Value::DimParam("N".into()),
                Dim::Fixed(n) => tensor_shape_proto::dimension::Value::DimValue(*n),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(elem_type),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl Graph {
    pub fn new(name: &str) -> Graph {
        Graph { name: name.into(), ..Default::default() }
    }

    fn fresh(&mut self, hint: &str) -> String {
        self.next += 1;
        format!("{hint}_{}", self.next)
    }

    pub fn input(&mut self, name: &str, elem_type: i32, dims: &[Dim]) {
        self.inputs.push(value_info(name, elem_type, dims));
    }

    pub fn output(&mut self, name: &str, elem_type: i32, dims: &[Dim]) {
        self.outputs.push(value_info(name, elem_type, dims));
    }

    /// `tensor` as an initializer, named afresh.
    fn initializer(&mut self, hint: &str, tensor: TensorProto) -> String {
        let name = self.fresh(hint);
        self.initializers.push(TensorProto { name: Some(name.clone()), ..tensor });
        name
    }

    pub fn float_init(&mut self, hint: &str, dims: &[i64], data: Vec<f32>) -> String {
        let t = TensorProto { dims: dims.to_vec(), data_type: Some(FLOAT), float_data: data, ..Default::default() };
        self.initializer(hint, t)
    }

    /// A string scalar.
    pub fn string_init(&mut self, hint: &str, value: &str) -> String {
        let t =
            TensorProto { data_type: Some(STRING), string_data: vec![value.as_bytes().to_vec()], ..Default::default() };
        self.initializer(hint, t)
    }

    pub fn int64_init(&mut self, hint: &str, dims: &[i64], data: Vec<i64>) -> String {
        let t = TensorProto { dims: dims.to_vec(), data_type: Some(INT64), int64_data: data, ..Default::default() };
        self.initializer(hint, t)
    }

    /// A node of the default domain with one output, named afresh.
    pub fn node(&mut self, op: &str, inputs: &[&str], attributes: Vec<AttributeProto>) -> String {
        let out = self.fresh(&op.to_lowercase());
        self.push(std::slice::from_ref(&out), "", op, inputs, attributes);
        out
    }

    /// A node of the default domain with `n` outputs, named afresh.
    pub fn node_outputs(
        &mut self,
        op: &str,
        inputs: &[&str],
        attributes: Vec<AttributeProto>,
        n: usize,
    ) -> Vec<String> {
        let outs: Vec<String> = (0..n).map(|_| self.fresh(&op.to_lowercase())).collect();
        self.push(&outs, "", op, inputs, attributes);
        outs
    }

    /// A node whose one output has the given name (a graph output).
    pub fn node_named(&mut self, out: &str, op: &str, inputs: &[&str], attributes: Vec<AttributeProto>) -> String {
        self.push(&[out.to_string()], "", op, inputs, attributes);
        out.into()
    }

    /// A node of `ai.onnx.ml`.
    pub fn ml_node(&mut self, op: &str, inputs: &[&str], attributes: Vec<AttributeProto>) -> String {
        let out = self.fresh(&op.to_lowercase());
        self.push(std::slice::from_ref(&out), ML_DOMAIN, op, inputs, attributes);
        out
    }

    fn push(&mut self, outs: &[String], domain: &str, op: &str, inputs: &[&str], attribute: Vec<AttributeProto>) {
        self.nodes.push(NodeProto {
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outs.to_vec(),
            name: outs.first().cloned(),
            op_type: Some(op.into()),
            domain: (!domain.is_empty()).then(|| domain.into()),
            attribute,
            ..Default::default()
        });
    }

    pub fn finish(self, doc: &str) -> ModelProto {
        let opset = |domain: &str, version| OperatorSetIdProto { domain: Some(domain.into()), version: Some(version) };
        ModelProto {
            ir_version: Some(IR_VERSION),
            opset_import: vec![opset("", OPSET), opset(ML_DOMAIN, ML_OPSET)],
            producer_name: Some("sparrow".into()),
            producer_version: Some(env!("CARGO_PKG_VERSION").into()),
            doc_string: Some(doc.into()),
            graph: Some(GraphProto {
                name: Some(self.name),
                node: self.nodes,
                initializer: self.initializers,
                input: self.inputs,
                output: self.outputs,
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}
