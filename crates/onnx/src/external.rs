//! Writing a model: inline while it fits a protobuf message (2 GiB less a
//! byte, which ONNX Runtime's parser enforces), else with its large tensors
//! as ONNX external data: their bytes in `model.onnx.data` beside the
//! model, each tensor naming its `location`, `offset` and `length` (what
//! `onnx.save_model(..., save_as_external_data=True)` writes and ONNX
//! Runtime loads). What still does not fit (a vocabulary's strings, which
//! live in an operator's attributes) is refused.

use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

use crate::OnnxError;
use crate::proto::{ModelProto, StringStringEntryProto, TensorProto, tensor_proto::DataLocation};

/// The most bytes a protobuf message may take.
pub const MAX_INLINE_BYTES: u64 = (1 << 31) - 1;
/// The model's file, and its tensors' when they go beside it.
pub const MODEL_FILE: &str = "model.onnx";
pub const EXTERNAL_DATA_FILE: &str = "model.onnx.data";
/// Tensors this small stay inline (ONNX's own default threshold).
const EXTERNAL_THRESHOLD: usize = 1024;
/// Each tensor's bytes start at a multiple of this (a page: ONNX Runtime
/// can map them in place).
const ALIGN: u64 = 4096;

/// What [`write`] wrote.
#[derive(Clone, Debug)]
pub struct Written {
    pub model: PathBuf,
    pub model_bytes: u64,
    /// `Some`: the external data file and its bytes.
    pub external: Option<(PathBuf, u64)>,
}

/// `model` into `dir` (which exists), inline while it takes at most
/// `inline_limit` bytes.
pub fn write(mut model: ModelProto, dir: &Path, inline_limit: u64) -> Result<Written, OnnxError> {
    let path = dir.join(MODEL_FILE);
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source: std::io::Error| OnnxError::Io { path: p.clone(), source }
    };
    let mut external = None;
    if model.encoded_len() as u64 > inline_limit {
        let data = dir.join(EXTERNAL_DATA_FILE);
        let file = std::fs::File::create(&data).map_err(io(&data))?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        let mut at = 0u64;
        for tensor in model.graph.iter_mut().flat_map(|g| g.initializer.iter_mut()) {
            if let Some(bytes) = take_data(tensor) {
                let pad = at.next_multiple_of(ALIGN) - at;
                out.write_all(&vec![0u8; pad as usize]).map_err(io(&data))?;
                at += pad;
                out.write_all(&bytes).map_err(io(&data))?;
                point_to(tensor, at, bytes.len() as u64);
                at += bytes.len() as u64;
            }
        }
        let file = out.into_inner().map_err(|e| OnnxError::Io { path: data.clone(), source: e.into_error() })?;
        file.sync_all().map_err(io(&data))?;
        external = Some((data, at));
    }
    let bytes = model.encoded_len() as u64;
    if bytes > inline_limit {
        return Err(OnnxError::TooLarge { bytes, limit: inline_limit });
    }
    std::fs::write(&path, model.encode_to_vec()).map_err(io(&path))?;
    Ok(Written { model: path, model_bytes: bytes, external })
}

/// A large float or int64 tensor's values as little-endian bytes, taken
/// out of it; `None`: it stays inline.
fn take_data(tensor: &mut TensorProto) -> Option<Vec<u8>> {
    if tensor.float_data.len() * 4 >= EXTERNAL_THRESHOLD {
        let values = std::mem::take(&mut tensor.float_data);
        return Some(values.iter().flat_map(|v| v.to_le_bytes()).collect());
    }
    if tensor.int64_data.len() * 8 >= EXTERNAL_THRESHOLD {
        let values = std::mem::take(&mut tensor.int64_data);
        return Some(values.iter().flat_map(|v| v.to_le_bytes()).collect());
    }
    None
}

fn point_to(tensor: &mut TensorProto, offset: u64, length: u64) {
    let entry = |key: &str, value: String| StringStringEntryProto { key: Some(key.into()), value: Some(value) };
    tensor.data_location = Some(DataLocation::External as i32);
    tensor.external_data = vec![
        entry("location", EXTERNAL_DATA_FILE.into()),
        entry("offset", offset.to_string()),
        entry("length", length.to_string()),
    ];
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::GraphProto;

    fn model(floats: usize) -> ModelProto {
        let tensor = |name: &str, n: usize| TensorProto {
            name: Some(name.into()),
            dims: vec![n as i64],
            data_type: Some(crate::graph::FLOAT),
            float_data: (0..n).map(|i| i as f32).collect(),
            ..Default::default()
        };
        ModelProto {
            graph: Some(GraphProto {
                initializer: vec![tensor("big", floats), tensor("small", 3), tensor("big2", floats)],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Under the limit the model is one file; over it, the large tensors'
    /// bytes go beside it at page-aligned offsets, each tensor naming its
    /// place, the small ones inline.
    #[test]
    fn past_the_limit_large_tensors_go_beside_the_model() {
        let tmp = tempfile::tempdir().expect("tmp");
        let inline = write(model(1000), tmp.path(), MAX_INLINE_BYTES).expect("inline");
        assert!(inline.external.is_none() && !tmp.path().join(EXTERNAL_DATA_FILE).exists());

        let dir = tmp.path().join("small-limit");
        std::fs::create_dir(&dir).expect("dir");
        let written = write(model(1000), &dir, 1000).expect("external");
        let (data, bytes) = written.external.expect("external data");
        assert_eq!(bytes, 4096 + 4000);
        let raw = std::fs::read(&data).expect("data");
        let back = ModelProto::decode(std::fs::read(&written.model).expect("model").as_slice()).expect("decode");
        let init = &back.graph.expect("graph").initializer;
        let place = |t: &TensorProto| -> Vec<String> {
            t.external_data.iter().map(|e| e.value.clone().unwrap_or_default()).collect()
        };
        assert_eq!(place(&init[0]), ["model.onnx.data", "0", "4000"]);
        assert_eq!(place(&init[2]), ["model.onnx.data", "4096", "4000"]);
        assert!(init[1].external_data.is_empty() && init[1].float_data == [0.0, 1.0, 2.0]);
        let value = |at: usize| f32::from_le_bytes(raw[at..at + 4].try_into().expect("4"));
        assert_eq!((value(4), value(4096 + 4 * 999)), (1.0, 999.0));

        let e = write(model(1000), tmp.path(), 10).expect_err("too large");
        assert!(e.to_string().contains("more than the 10 a model file may hold"), "{e}");
    }
}
