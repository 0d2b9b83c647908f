"""Side-by-side benchmarks on one runner (:mod:`lslm.harness.bench_runner`): each prints a table and writes
``.txt`` (exactly what it printed), ``.json`` and ``.png`` together (:class:`lslm.harness.Report`)."""
