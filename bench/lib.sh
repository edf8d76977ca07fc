# Shared by the bench/ scripts that run a peer in turn with spmdx, ROUNDS times.
# median [DIGITS]: the median of the numbers on stdin (whitespace-separated; empty ones
# skipped), an even count's two middle values averaged and printed with DIGITS decimals
# (default 3); "n/a" when there are none.
median() {
  tr ' ' '\n' | grep -v '^$' | sort -g | awk -v digits="${1:-3}" '{ v[NR] = $1 } END {
    if (NR == 0) print "n/a"; else if (NR % 2) print v[(NR + 1) / 2]; else printf "%.*f\n", digits, (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}
