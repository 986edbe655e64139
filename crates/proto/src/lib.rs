//! Generated gRPC types and services of Sparrow's wire protocol
//! (`proto/sparrow.proto`). The only crate that sees protobuf types; the
//! cluster crate converts at its edge.

#[allow(clippy::all, clippy::unwrap_used, missing_docs)]
pub mod v1 {
    tonic::include_proto!("sparrow.v1");
}
