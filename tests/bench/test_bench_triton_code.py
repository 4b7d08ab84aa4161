"""bench/triton_code.py: the structure of the Triton kernels Inductor writes for amp8."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from conftest import load_bench

triton_code = load_bench("triton_code")

# The shape of Inductor's output code: a looped reduction over rows (the amax, then the
# quantization reading the row again), a persistent one, and a pointwise kernel.
WRAPPER = '''
cast_0 = async_compile.triton('triton_red_fused_amax_0', \'\'\'
@triton_heuristics.reduction(
    size_hints={'x': 8192, 'r0_': 2048},
)
@triton.jit
def triton_red_fused_amax_0(in_ptr0, out_ptr0, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        tmp0 = tl.load(in_ptr0 + (r0_1 + ks0*x0), r0_mask & xmask)
    tl.store(out_ptr0 + (x0), tmp3, xmask)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        tmp4 = tl.load(in_ptr0 + (r0_1 + ks0*x0), r0_mask & xmask)
        tl.store(out_ptr1 + (r0_1 + ks0*x0), tmp5, r0_mask & xmask)
\'\'\', device_str='cpu')
cast_1 = async_compile.triton('triton_per_fused_amin_1', \'\'\'
@triton_heuristics.persistent_reduction(
    size_hints={'x': 1, 'r0_': 8192},
)
@triton.jit
def triton_per_fused_amin_1(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (r0_0), r0_mask)
    tmp2 = (tmp1 / tmp0)
    tl.store(out_ptr0 + (tl.full([1], 0, tl.int32)), tmp2, None)
\'\'\', device_str='cpu')
cast_2 = async_compile.triton('triton_poi_fused_copy_2', \'\'\'
@triton_heuristics.pointwise(
    size_hints={'x': 16777216},
)
@triton.jit
def triton_poi_fused_copy_2(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (x0), xmask).to(tl.float32)
    tl.store(out_ptr0 + (x0), tmp0.to(tl.float16), xmask)
\'\'\', device_str='cpu')
'''


def test_kernel_summary_reads_kinds_loops_and_size_hints() -> None:
    kernels = triton_code.kernel_summary(WRAPPER)
    assert [(k["kind"], k["loops"], k["size_hint"], k["loads"], k["stores"], k["statements"], k["divisions"],
             k["conversions"]) for k in kernels] == [
        ("looped reduction", 2, 8192 * 2048, 2, 2, 2, 0, 0),
        ("persistent reduction", 0, 8192, 1, 1, 2, 1, 0),
        ("pointwise", 0, 16777216, 1, 1, 1, 0, 2),
    ]


# A looped reduction whose loop holds a row's reciprocal (loop-invariant: its operand is
# loaded once per row), a per-element division by it and the row's amax.
LOOP = '''
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
    tmp1 = tl.full([1, 1], 1.0, tl.float32)
    _tmp6 = tl.full([XBLOCK, R0_BLOCK], float("-inf"), tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_1 = r0_index
        tmp2 = tl.load(in_ptr1 + (r0_1 + ks0*x0), r0_mask & xmask).to(tl.float32)
        tmp3 = (tmp1 / tmp0)
        tmp4 = tmp2 * tmp3
        tmp5 = (tmp4 / tmp2)
        tmp7 = triton_helpers.maximum(_tmp6, tmp5.to(tl.float16).to(tl.float32))
        _tmp6 = tl.where(r0_mask & xmask, tmp7, _tmp6)
    tmp6 = triton_helpers.max2(_tmp6, 1)[:, None]
    tmp8 = (tmp6 / tmp0)
'''


def test_element_statements_are_those_that_read_the_rows_elements() -> None:
    statements = triton_code.element_statements(LOOP)
    # tmp2, tmp4, tmp5, tmp7: per element; tmp3 (the row's reciprocal), tmp6 (its amax) and tmp8 not
    assert statements == [
        "tl.load(in_ptr1 + (r0_1 + ks0*x0), r0_mask & xmask).to(tl.float32)", "tmp2 * tmp3", "(tmp4 / tmp2)",
        "triton_helpers.maximum(_tmp6, tmp5.to(tl.float16).to(tl.float32))",
        "tl.where(r0_mask & xmask, tmp7, _tmp6)",
    ]


@pytest.mark.parametrize("codes, passes", [
    ([WRAPPER], 3),  # the largest size hint (2**24 elements): the looped reduction's 2 loops + the pointwise kernel
    ([WRAPPER.split("cast_1")[0]], 2),  # the looped reduction alone
    ([], 0),
])
def test_case_summary_counts_the_passes_over_the_data(codes: list[str], passes: int) -> None:
    summary = triton_code.case_summary(codes)
    assert summary["data_passes"] == passes
    assert summary["kernels"] == len(summary["detail"])


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs triton to generate Triton code (pip install triton; no GPU needed)")
def test_triton_code_reads_the_optimizer_updates_kernels(tmp_path: Path) -> None:
    path = triton_code.main(["--no-casts", "--width", "256", "--out", str(tmp_path)])
    record = json.loads(path.read_text())
    by_level = {case["case"].split()[0]: case for case in record["cases"]}
    assert set(by_level) == {"O1", "O2", "O3"}
    for level, case in by_level.items():
        # One pass over the group's data at every level: every scale comes from a bound
        # (O3's FP8 weight's rows from its master's), so nothing a store needs waits on a
        # reduction over its row.
        assert case["dynamic"]["data_passes"] == 1, case
        # Per element, only Adam's two divisions and those of decodes by scales that are
        # not powers of two (the moments'): the weights' and gradients' scales are, and
        # decode by their reciprocals.
        update = max(case["dynamic"]["detail"], key=lambda kernel: kernel["element_statements"])
        assert update["element_divisions"] == {"O1": 2, "O2": 4, "O3": 4}[level], update
        # The GPU's code paths: stores clip by fmax and fmin, not clamp.
        assert "fmax_fmin" in update["name"], update["name"]
    # Built for sm_90: each level's update issues more instructions per element than the
    # one below it (FP8 moments at O2, an FP8 weight beside its master at O3).
    instructions = [max(kernel["sass"]["instructions"] for kernel in by_level[level]["dynamic"]["detail"]
                        if kernel.get("sass")) for level in ("O1", "O2", "O3")]
    assert 0 < instructions[0] < instructions[1] < instructions[2], instructions
    # Rows of 256 elements go to the step in sixteens (group_step.in_sixteens): each thread
    # loads its 4 elements of a buffer with one instruction (the gradient, moments, weight
    # and O3's master: 4 or 5 an iteration, beside a few loads of per-row values), where
    # one load an element made 20 to 24 in all.
    for level in ("O1", "O2", "O3"):
        update = max((kernel for kernel in by_level[level]["dynamic"]["detail"] if kernel.get("sass")),
                     key=lambda kernel: kernel["sass"]["instructions"])
        assert update["sass"]["opcodes"]["LDG"] < 12, (level, update["sass"]["opcodes"])
