//! What the matrix products (fp32 `mlp::sgemm`, bf16 `bf16::gemm_bf16`)
//! take: a row-major operand, used as stored or transposed.

/// A row-major matrix operand, used as stored or transposed.
#[derive(Clone, Copy)]
pub struct Operand<'a> {
    pub data: &'a [f32],
    pub transposed: bool,
}

impl<'a> Operand<'a> {
    pub fn plain(data: &'a [f32]) -> Self {
        Operand { data, transposed: false }
    }
    pub fn t(data: &'a [f32]) -> Self {
        Operand { data, transposed: true }
    }
}
