"""Local clusters for the demo, the benchmarks and the tests: real weightwired processes on
this machine (loopback or network namespaces), rank processes driven over JSON lines, and
synthetic models with deterministic contents. Below `cli/` and `bench/`; imports neither."""
