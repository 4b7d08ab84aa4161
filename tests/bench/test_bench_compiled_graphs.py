"""bench/compiled_graphs.py: kernels and bytes read off inductor's generated code."""

from __future__ import annotations

import pytest
import torch

from conftest import load_bench

compiled_graphs = load_bench("compiled_graphs")


def _generated_source(nests: int, calls: int, extern: int) -> str:
    """Inductor-style source: a C++ kernel of ``nests`` loop nests called ``calls`` times on
    its float32 argument (s0 x 4 elements) and a buffer it allocates, ``extern`` GEMMs and
    one fallback operation."""
    loops = "\n".join("        for(int64_t x0=static_cast<int64_t>(0L); x0<ks0; x0+=16) {}" for _ in range(nests))
    return (f"cpp_fused_add_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''\n{loops}\n''')\n"
            "class Runner:\n    def call(self, args):\n        arg0_1, arg1_1 = args\n        args.clear()\n"
            "        s0 = arg0_1\n        buf0 = empty_strided_cpu((s0, 4), (4, 1), torch.float32)\n"
            "        buf1 = buf0; del buf0  # reuse\n"
            + "        cpp_fused_add_0(arg1_1, buf1)\n" * calls + "        extern_kernels.mm(a, b, out=c)\n" * extern
            + "        buf2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)\n")


@pytest.mark.parametrize("nests, calls, extern", [(1, 1, 0), (2, 3, 1), (4, 2, 2)])
def test_compiled_graphs_kernels_of_generated_code(nests: int, calls: int, extern: int) -> None:
    """A generated C++ kernel counts one GPU kernel per outermost loop nest, per call; each
    extern kernel and fallback operation one."""
    assert compiled_graphs.kernel_launches(_generated_source(nests, calls, extern)) == nests * calls + extern + 1


@pytest.mark.parametrize("rows, calls", [(3, 1), (10, 2)])
def test_compiled_graphs_kernel_bytes_of_generated_code(rows: int, calls: int) -> None:
    """Each generated kernel call moves its arguments: an input and a buffer sized from the
    call's symbolic size (reused under another name)."""
    x = torch.zeros(rows, 4)
    source = _generated_source(1, calls, 0)
    assert compiled_graphs.kernel_bytes(source, [rows, x]) == calls * 2 * x.nbytes
