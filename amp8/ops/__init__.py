"""The only callers of torch's scaled GEMMs: FP8 GEMMs with tensorwise, rowwise and
block scales (``gemm``) and Blackwell's microscaled ones (``block_scaled``), each
checking the CUDA operand contract on every device."""
