"""Inductor's CPU code generator standing in for CUDA's in the tests that compile on the CPU."""

# The same graphs, lowered and fused by the same scheduler, with the CPU-only costs taken out:
# - no SIMD (cpp.simdlen=0, and tests/conftest.py's TORCHINDUCTOR_VEC_ISA_OK=0): scalar C++ loops.
#   Generating each kernel's vectorized variants and their tail loops took half of the compiling
#   tests' time (the keyed dropout hash, inlined at every site, makes kernels large); the CUDA code
#   generator has no such step;
# - CUDA's threshold for computing a pointwise value once into a buffer instead of inlining it into
#   each reader (30 operations; the CPU's own is 50): the dropout hash is inlined where CUDA would
#   not, and lowering it again at every read was a fifth of the compiling time;
# - compile_threads=1: no worker pool to start on a small machine.
CUDA_LIKE_CPU_KERNELS = {"cpp.simdlen": 0, "realize_opcount_threshold": 30, "compile_threads": 1}
