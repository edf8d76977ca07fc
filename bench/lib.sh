# Shared by the bench/ scripts that run a peer in turn with spmdx, ROUNDS times.
# median [DIGITS]: the median of the numbers on stdin (whitespace-separated; empty ones
# skipped), an even count's two middle values averaged and printed with DIGITS decimals
# (default 3); "n/a" when there are none.
median() {
  tr ' ' '\n' | { grep -v '^$' || true; } | sort -g | awk -v digits="${1:-3}" '{ v[NR] = $1 } END {
    if (NR == 0) print "n/a"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.*f\n", digits, (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
# machine: one line naming what a timing was measured on (ratios depend on it): the CPU model,
# its vector extensions that matter to the kernels (SSE4.2 .. AVX-512, AVX512-BF16, AMX), the
# threads this process may use of the machine's logical CPUs, the load average when the bench
# started (other work on the cores skews every time printed after it), and the libraries the
# GEMMs run on: LibTorch's version, oneDNN's and the BLAS PyTorch's float32 mm uses (from
# torch.__config__, when .venv has torch), spmdx's float32 linears on oneDNN
# (training.cpu_matmul = "auto" where LibTorch has it) and its bfloat16 GEMMs native (oneDNN with
# the CPU's bf16 dot products) or upcast to float32 GEMMs, as exec::half_gemm decides from the
# same flags (SPMDX_HALF_GEMM overrides it).
machine() {
  local model flags threads gemm bf16 libs
  model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
  flags=$(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1 | tr ' ' '\n' |
    grep -E '^(sse4_2|avx|avx2|fma|f16c|avx_vnni|avx512.*|amx.*)$' | tr '\n' ' ' | sed 's/ $//')
  threads="$(nproc) of $(getconf _NPROCESSORS_ONLN) logical CPUs"
  if [[ " $flags " == *" avx512_bf16 "* || " $flags " == *" amx_bf16 "* ]]; then bf16="bfloat16 native (oneDNN, the CPU's bf16 dot products)"
  else bf16="bfloat16 upcast to float32 GEMMs (no avx512_bf16 or amx_bf16)"; fi
  case "${SPMDX_HALF_GEMM:-}" in native|upcast) bf16="bfloat16 $SPMDX_HALF_GEMM (SPMDX_HALF_GEMM)" ;; esac
  local repo_root python
  repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  python="$repo_root/.venv/bin/python"
  libs="LibTorch unknown (no .venv)"
  if [ -x "$python" ]; then
    libs=$("$python" -c '
import re, torch
c = torch.__config__.show()
def find(p):
    m = re.search(p, c)
    return m.group(1) if m else "?"
blas = "MKL " + find(r"Math Kernel Library Version ([0-9.]+)") if "Math Kernel Library" in c else "BLAS " + find(r"BLAS_INFO=([^,]+)")
print("LibTorch %s, oneDNN %s, PyTorch float32 mm on %s" % (torch.__version__, find(r"MKL-DNN v([0-9.]+)") if torch.backends.mkldnn.is_available() else "none", blas))
' 2>/dev/null || echo "LibTorch unknown (torch did not import)")
  fi
  gemm="spmdx float32 linears on oneDNN where LibTorch has it (training.cpu_matmul), $bf16; $libs"
  echo "machine: ${model:-unknown CPU}; ISA: ${flags:-none of sse4_2/avx/avx2/fma/avx512/amx}; threads: $threads; load average at start: $(cut -d' ' -f1-3 /proc/loadavg); GEMMs: $gemm"
}
