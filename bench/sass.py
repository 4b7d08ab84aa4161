"""The machine code (SASS) of Inductor's Triton kernels, built without a GPU.

Triton's wheel ships NVIDIA's assembler (``ptxas``) and disassembler (``cuobjdump``), so a
kernel that ``bench/triton_code.py`` captures as Inductor writes it can be built for an
sm_90 target on a machine without a GPU, and its instructions counted. What a kernel
bound by its arithmetic costs is the instructions it issues per element: the loop over a
row's elements is the code between a backward branch and its target, and each of its
iterations handles ``R0_BLOCK * XBLOCK / (32 * num_warps)`` elements per thread. That
counts what the source does not show: a float division's expansion (a reciprocal
estimate and its corrections), the NaN checks of torch's ``maximum``, conversions the
compiler folds away, and values it moves out of the loop.
"""

from __future__ import annotations

import ast
import collections
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

_KERNEL_SOURCE = re.compile(r"async_compile\.triton\('(\w+)', '''(.*?)''', device_str", re.S)
_HEURISTICS = re.compile(r"@triton_heuristics\.\w+\(.*?\n\)\n", re.S)
_SIGNATURE = re.compile(r"'signature': (\{[^}]*\})")
_ATTRIBUTES = re.compile(r"'configs': \[(\{.*?\})\]")
_CONSTANTS = re.compile(r"'constants': (\{[^}]*\})")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")

LOOP_BLOCKS = {"XBLOCK": 1, "R0_BLOCK": 1024}  # a row's loop: 1024 elements an iteration
LOOP_WARPS = 8  # 256 threads: 4 elements a thread an iteration


def kernel_sources(wrapper_code: str) -> dict[str, str]:
    """Each Triton kernel's module source in one compiled graph's wrapper code, by name."""
    return {name: source for name, source in _KERNEL_SOURCE.findall(wrapper_code)}


def build_sass(name: str, source: str, blocks: dict[str, int], num_warps: int, arch: int = 90) -> str:
    """The SASS of kernel ``name`` (its module ``source`` as Inductor writes it) built for
    sm_``arch`` with the constexprs ``blocks``: compiled by Triton (its driver must report
    that target: ``triton_code.gpu_codegen``), disassembled by ``cuobjdump``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = ast.literal_eval(_SIGNATURE.search(source).group(1))  # dict literals Inductor wrote
    attributes = _ATTRIBUTES.search(source)
    attrs = ast.literal_eval(attributes.group(1)) if attributes else {}
    code = _HEURISTICS.sub("", source).replace("triton_helpers.set_driver_to_cpu()", "")
    with tempfile.TemporaryDirectory() as folder:
        module = Path(folder) / "kernel.py"  # (kernel names outgrow a file name)
        module.write_text(code)  # Triton reads a kernel's source from its file
        namespace: dict[str, Any] = {"__file__": str(module)}
        exec(compile(code, str(module), "exec"), namespace)  # noqa: S102
        constants = {**ast.literal_eval(_CONSTANTS.search(source).group(1)), **blocks}  # static sizes, blocks
        constexprs = {(index,): constants[arg] for index, arg in enumerate(signature) if signature[arg] == "constexpr"}
        kernel = triton.compile(ASTSource(namespace[name], signature, constexprs, attrs),
                                target=GPUTarget("cuda", arch, 32),
                                options={"num_warps": num_warps, "enable_fp_fusion": False})
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return subprocess.run([str(cuobjdump), "-sass", str(cubin)], check=True, capture_output=True,
                              text=True).stdout


def loop_instructions(sass: str) -> list[dict[str, Any]]:
    """Each loop of a kernel's SASS (a branch back to an earlier address): its instructions
    and the count of each opcode."""
    instructions = [(int(address, 16), text) for address, text in _INSTRUCTION.findall(sass)]
    loops = []
    for address, text in instructions:
        target = _BRANCH_TARGET.search(text)
        if target and int(target.group(1), 16) < address:
            body = [t for a, t in instructions if int(target.group(1), 16) <= a <= address]
            opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append({"instructions": len(body), "opcodes": dict(opcodes.most_common())})
    return loops


def per_element(name: str, source: str) -> dict[str, Any] | None:
    """SASS instructions per element of a looped reduction's row (``LOOP_BLOCKS``,
    ``LOOP_WARPS``), with the opcodes of its loop; None for a kernel without a loop."""
    loops = loop_instructions(build_sass(name, source, LOOP_BLOCKS, LOOP_WARPS))
    if not loops:
        return None
    loop = max(loops, key=lambda entry: entry["instructions"])
    elements = LOOP_BLOCKS["R0_BLOCK"] * LOOP_BLOCKS["XBLOCK"] // (32 * LOOP_WARPS)
    return {"instructions": loop["instructions"] / elements, "loop_instructions": loop["instructions"],
            "elements_per_thread": elements, "opcodes": loop["opcodes"]}
