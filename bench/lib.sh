# Shared by the bench/ scripts that run a peer in turn with spmdx, ROUNDS times.
# median [DIGITS]: the median of the numbers on stdin (whitespace-separated; empty ones
# skipped), an even count's two middle values averaged and printed with DIGITS decimals
# (default 3); "n/a" when there are none.
median() {
  tr ' ' '\n' | { grep -v '^$' || true; } | sort -g | awk -v digits="${1:-3}" '{ v[NR] = $1 } END {
    if (NR == 0) print "n/a"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.*f\n", digits, (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
# machine: one line naming what a timing was measured on (ratios depend on it): the CPU model,
# its vector extensions that matter to the kernels (SSE4.2 .. AVX-512, AMX), the threads this
# process may use of the machine's logical CPUs, and the load average when the bench started
# (other work on the cores skews every time printed after it).
machine() {
  local model flags threads
  model=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1)
  flags=$(sed -n 's/^flags[[:space:]]*: //p' /proc/cpuinfo 2>/dev/null | head -1 | tr ' ' '\n' |
    grep -E '^(sse4_2|avx|avx2|fma|f16c|avx_vnni|avx512.*|amx.*)$' | tr '\n' ' ' | sed 's/ $//')
  threads="$(nproc) of $(getconf _NPROCESSORS_ONLN) logical CPUs"
  echo "machine: ${model:-unknown CPU}; ISA: ${flags:-none of sse4_2/avx/avx2/fma/avx512/amx}; threads: $threads; load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
}
