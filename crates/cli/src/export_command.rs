//! `sparrow export`: a checkpoint as a serving export (`--format serving`,
//! what `serve`, `predict --model` and Python read) or as an ONNX graph
//! (`--format onnx`, for ONNX Runtime and Triton).

use std::path::PathBuf;

use sparrow_trainer::onnx_export::MAX_INLINE_BYTES;

use crate::args;

#[derive(clap::Args)]
pub struct ExportArgs {
    /// A checkpoint (or its directory of versions: the newest).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The export's directory (must not exist yet).
    #[arg(long)]
    out: PathBuf,
    /// The vectors' type: f32, f16 or bf16 (half the bytes; the dense
    /// weights stay f32). A table trained with `embedding.dtype` f16 or
    /// bf16 exports in its own type without loss.
    #[arg(long, value_enum, default_value_t = args::Dtype::F32)]
    dtype: args::Dtype,
    /// `serving` (for `sparrow serve`, `predict --model`, Python), or
    /// `onnx`: OUT/model.onnx for ONNX Runtime and Triton, its inputs
    /// those of `sparrow serve`.
    #[arg(long, value_enum, default_value_t = args::ExportFormat::Serving)]
    format: args::ExportFormat,
    /// `onnx`: data files whose sparse columns hold the raw IDs the graph
    /// maps to rows (default: the job's data.train and data.test).
    #[arg(long, value_name = "FILE")]
    vocabulary: Vec<PathBuf>,
    /// `onnx`: past this many bytes of rows the graph takes each field's
    /// pooled vector as input instead, and the rows go to OUT/rows.
    #[arg(long, default_value_t = 512 << 20)]
    max_table_bytes: u64,
    /// `onnx`: past this many bytes (protobuf's limit, 2 GiB less a byte,
    /// which ONNX Runtime enforces) the graph's tables go to
    /// OUT/model.onnx.data beside it, as ONNX external data.
    #[arg(long, default_value_t = MAX_INLINE_BYTES, value_parser = clap::value_parser!(u64).range(1..=MAX_INLINE_BYTES))]
    max_inline_bytes: u64,
}

pub fn run(a: ExportArgs) -> anyhow::Result<()> {
    match a.format {
        args::ExportFormat::Onnx => crate::print_json(&sparrow_trainer::onnx_export::export_onnx(
            &a.checkpoint,
            &a.out,
            &a.vocabulary,
            a.max_table_bytes,
            a.max_inline_bytes,
        )?),
        args::ExportFormat::Serving => {
            let dtype = match a.dtype {
                args::Dtype::F32 => sparrow_trainer::export::VectorType::F32,
                args::Dtype::F16 => sparrow_trainer::export::VectorType::F16,
                args::Dtype::Bf16 => sparrow_trainer::export::VectorType::Bf16,
            };
            crate::print_json(&sparrow_trainer::run::export_checkpoint(&a.checkpoint, &a.out, dtype)?)
        }
    }
}
