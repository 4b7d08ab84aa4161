"""bench/sass.py: loops and instructions in the SASS of a built Triton kernel."""

from __future__ import annotations

from conftest import load_bench

sass = load_bench("sass")

# cuobjdump's shape: an address, then the instruction; a loop from 0x0030 to a branch back at 0x0070.
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/              @!P0 BRA 0x90 ;                             /* 0x0000000000308947 */
        /*0030*/                   LDG.E R2, desc[UR4][R4.64] ;           /* 0x0000000404027981 */
        /*0040*/                   FMUL R3, R2, R6 ;                      /* 0x0000000602037220 */
        /*0050*/                   FMUL R3, R3, R7 ;                      /* 0x0000000703037220 */
        /*0060*/                   STG.E desc[UR4][R4.64], R3 ;           /* 0x0000000304007986 */
        /*0070*/               @P1 BRA 0x30 ;                             /* 0xffffffb000007947 */
        /*0080*/                   EXIT ;                                 /* 0x000000000000794d */
        /*0090*/                   BRA 0x90;                              /* 0xfffffff000007947 */
"""


def test_a_loop_is_the_code_from_a_backward_branch_to_its_target() -> None:
    # (the branch to itself at 0x90, after a kernel's EXIT, is no loop over data)
    assert sass.loop_instructions(SASS) == [{"instructions": 5, "opcodes": {"FMUL": 2, "LDG": 1, "STG": 1, "BRA": 1}}]


def test_kernel_sources_are_read_off_the_wrapper_code() -> None:
    wrapper = "k = async_compile.triton('triton_red_fused_0', '''\nimport triton\n@triton.jit\ndef f(): pass\n''', " \
              "device_str='cuda')\n"
    assert sass.kernel_sources(wrapper) == {"triton_red_fused_0": "\nimport triton\n@triton.jit\ndef f(): pass\n"}
