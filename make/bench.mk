# Benchmarks (BENCHMARKS.md). Included by the Makefile; not part of `make test`.
#
#   make bench                   every benchmark in its quick mode (each < 10 minutes on 2 cores)
#   make bench BENCH_ARGS=       the full runs (more batches, seeds and repeats)
#   make bench-step | bench-sim | bench-overhead | bench-stream | bench-learning |
#   bench-scaleout | bench-soak | bench-front | bench-episodes | bench-http-hop    one of them
#   make bench-render            rewrite BENCHMARKS.md's tables from bench/results/*.json
#
# Results go to bench/results/*.json and *.png. Performance figures are ratios measured
# side by side in one run; on a shared machine, rerun before comparing across runs.
BENCH_ARGS ?= --quick

.PHONY: bench bench-step bench-sim bench-overhead bench-stream bench-learning \
	bench-scaleout bench-soak bench-front bench-episodes bench-http-hop bench-render

bench: bench-step bench-sim bench-overhead bench-stream bench-learning bench-scaleout \
	bench-soak bench-front bench-episodes bench-http-hop

bench-step: venv
	$(BIN)/python -m bench.step_time $(BENCH_ARGS)

bench-sim: venv
	$(BIN)/python -m bench.adaptive_sim $(BENCH_ARGS)

bench-overhead: venv
	$(BIN)/python -m bench.overhead $(BENCH_ARGS)

bench-stream: venv
	$(BIN)/python -m bench.stream $(BENCH_ARGS)

bench-learning: venv
	$(BIN)/python -m bench.learning $(BENCH_ARGS)

bench-scaleout: venv
	$(BIN)/python -m bench.scaleout $(BENCH_ARGS)

bench-render: venv
	$(BIN)/python -m bench.render

bench-soak: venv
	$(BIN)/python -m bench.soak $(BENCH_ARGS)

bench-front: venv
	$(BIN)/python -m bench.front $(BENCH_ARGS)

bench-episodes: venv
	$(BIN)/python -m bench.episodes $(BENCH_ARGS)

# The HTTP hop against the in-process vLLM backend: both run in .venv-vllm.
bench-http-hop: venv venv-vllm
	$(BIN)/python -m bench.http_hop $(BENCH_ARGS)
