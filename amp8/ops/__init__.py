"""The only callers of torch's scaled GEMMs: FP8 GEMMs with tensorwise, rowwise and
block scales (``gemm``), Blackwell's microscaled ones (``block_scaled``) and the grouped
GEMMs of mixture-of-experts experts (``grouped_gemm``), each checking the CUDA operand
contract on every device."""
