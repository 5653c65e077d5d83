# Benchmarks (BENCHMARKS.md). Included by the Makefile; not part of `make test`.
#
#   make bench                   every benchmark in its quick mode (each < 10 minutes on 2 cores)
#   make bench BENCH_ARGS=       the full runs (more batches, seeds and repeats)
#   make bench-step | bench-sim | bench-overhead | bench-stream | bench-learning |
#   bench-scaleout | bench-soak | bench-front | bench-episodes | bench-http-hop |
#   bench-judge | bench-restart | bench-sessions  one of them
#   make bench-render            rewrite the tables of BENCHMARKS.md and bench/notes/*.md
#                                from bench/results/*.json
#
# Results go to bench/results/*.json and *.png. Performance figures are ratios measured
# side by side in one run; on a shared machine, rerun before comparing across runs.
BENCH_ARGS ?= --quick

BENCHES := step sim overhead stream learning scaleout soak front episodes http-hop judge restart sessions

.PHONY: bench $(BENCHES:%=bench-%) bench-render

bench: $(BENCHES:%=bench-%)

# bench-NAME runs the module bench/NAME.py (dashes as underscores) but where named here.
BENCH_MODULE = $(subst -,_,$*)
bench-step: BENCH_MODULE = step_time
bench-sim: BENCH_MODULE = adaptive_sim

$(BENCHES:%=bench-%): bench-%: venv
	$(BIN)/python -m bench.$(BENCH_MODULE) $(BENCH_ARGS)

# The HTTP hop against the in-process vLLM backend: both run in .venv-vllm.
bench-http-hop: venv-vllm
# The judge bench's `vllm` judge is the toy under vllm serve, from .venv-vllm.
bench-judge: venv-vllm

bench-render: venv
	$(BIN)/python -m bench.render
