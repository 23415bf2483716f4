"""zerotuner's benchmarks: `python -m bench` (or `make bench`) measures what users pay for.

Harness overhead against a bare DeepSpeed loop, time to the first step by phase, NVMe swap
throughput against the raw disk, planner accuracy, 1 vs 2 rank scaling, and the planner's
paper estimate for the seed's GPU headline. Results go to bench/results/<date>.{json,md}.
Benchmarks are not tests: nothing here asserts a time.
"""
