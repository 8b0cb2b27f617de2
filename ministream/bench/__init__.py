"""Measuring: the benchmarks (bench, bench-serve, bench-step, bench-nodes), their baselines (the reference
server, llama.cpp), the machine's description, reports and charts."""
