//! Generates the ONNX protobuf types from the vendored `onnx.proto` with the
//! vendored `protoc`: no system protobuf needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    config.compile_protos(&["proto/onnx.proto"], &["proto"])?;
    Ok(())
}
