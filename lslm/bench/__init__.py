"""Side-by-side benchmarks: each prints a table and writes JSON (+ PNG where there is a plot)."""
