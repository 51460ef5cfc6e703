# actor_pool: top-level entry points. The C side has its own c_src/Makefile,
# which rebar3 runs before compiling the Erlang sources (see rebar.config).

REBAR ?= rebar3
EPMD  ?= epmd

.PHONY: all compile deps epmd test eunit eunit-dist eunit-asan eunit-asan-dp dep-test elixir-test dialyzer demo bench bench-run \
        fuzz soak clean docs bench-report bench-scale bench-scale-report bench-sim

all: compile

compile:
	$(REBAR) compile

deps:
	bash scripts/install-deps

# `rebar3 eunit --sname` needs a running epmd; rebar3 does not start one.
epmd:
	@$(EPMD) -daemon

# Everything: C unit tests and a short fuzz run (under ASan+UBSan), EUnit
# against real C nodes with each I/O backend, actor_pool as a rebar3
# dependency of another project and as a mix dependency (examples/elixir_app,
# ExUnit), dialyzer, and the API reference (edoc, no warnings).
test: deps
	$(MAKE) -C c_src test
	$(REBAR) compile
	$(MAKE) eunit
	$(MAKE) dep-test
	$(MAKE) elixir-test
	$(MAKE) dialyzer
	$(MAKE) docs

# The suites' executables and plugins live in c_src/build/ (never priv/):
# c_src/Makefile's test-bins and the ASan dp_client.
eunit: epmd
	$(MAKE) -C c_src test-bins build/dp_client
	ACTOR_POOL_IO=uring $(REBAR) eunit --sname ap_eunit_uring_$$$$
	ACTOR_POOL_IO=epoll $(REBAR) eunit --sname ap_eunit_epoll_$$$$
	$(MAKE) eunit-dist
	$(MAKE) eunit-asan

# The pool suites once more with every call of the test BEAM to a pool node
# by distribution, the path of every caller on another host
# (ACTOR_POOL_TEST_FAST_PATH=false: the application setting fast_path false,
# test/ap_test_util.erl; a run that opened a ring fails). Not here: the
# suites that run both transports already, and those about the rings
# themselves. One I/O backend: what differs is the BEAM's side.
DIST_EUNIT_MODULES = actor_pool_tests,actor_pool_isolation_tests,actor_pool_isolation_abuse_tests,actor_pool_service_key_tests,actor_pool_child_spec_tests,actor_pool_sandbox_tests
eunit-dist: epmd
	$(MAKE) -C c_src test-bins build/dp_client
	ACTOR_POOL_TEST_FAST_PATH=false ACTOR_POOL_IO=uring $(REBAR) eunit --module=$(DIST_EUNIT_MODULES) \
	  --sname ap_eunit_dist_$$$$

# The pool and receptionist suites (the cluster one too: its peers inherit
# the variables) and the C-node abuse suite once more against ASan+UBSan
# builds of their C nodes; any sanitizer report (written under ASAN_LOG_DIR) fails the
# run (scripts/sanitizer-reports: it waits for late writers and names each report).
ASAN_LOG_DIR = _build/asan-logs
ASAN_EUNIT_MODULES = actor_pool_tests,actor_pool_bad_reply_tests,actor_cnode_tests,actor_pool_ring_tests,actor_pool_ring_node_tests,actor_receptionist_tests,actor_receptionist_cluster_tests,actor_security_term_tests,actor_cnode_handshake_tests,actor_cnode_handshake_flood_tests,actor_cnode_abuse_tests,actor_cnode_oversize_tests,actor_pool_oversize_tests,actor_cnode_parent_tests,actor_pool_isolation_tests,actor_pool_isolation_abuse_tests,actor_pool_sandbox_tests,actor_pool_child_spec_tests,actor_pool_stall_tests,actor_pool_drops_tests,actor_pool_histogram_tests,actor_pool_key_route_tests,actor_pool_env_tests
eunit-asan: epmd
	$(MAKE) -C c_src test-bins build/actor_pool_node_asan build/actor_receptionist_node_asan \
	  build/actor_echo_node_asan build/dp_client
	rm -rf $(ASAN_LOG_DIR) && mkdir -p $(ASAN_LOG_DIR)
	@# Sandboxed worker processes write their reports as uid 65534 (root runs).
	chmod 1777 $(ASAN_LOG_DIR)
	@rc=0; ACTOR_POOL_NODE_EXE=$(CURDIR)/c_src/build/actor_pool_node_asan \
	  ACTOR_RECEPTIONIST_NODE_EXE=$(CURDIR)/c_src/build/actor_receptionist_node_asan \
	  ACTOR_POOL_ECHO_EXE=$(CURDIR)/c_src/build/actor_echo_node_asan \
	  ASAN_OPTIONS=detect_leaks=0:log_path=$(CURDIR)/$(ASAN_LOG_DIR)/asan \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(CURDIR)/$(ASAN_LOG_DIR)/ubsan \
	  $(REBAR) eunit --module=$(ASAN_EUNIT_MODULES) --sname ap_eunit_asan_$$$$ || rc=$$?; \
	  scripts/sanitizer-reports $(ASAN_LOG_DIR) "the C nodes" && exit $$rc
	$(MAKE) eunit-asan-dp

# The data plane NIF under ASan+UBSan: a sanitized actor_dp.so inside the
# test BEAM itself (libasan preloaded, ACTOR_DP_NIF naming the build, and
# +Mea min so that enif_alloc is malloc, which ASan watches), its suite
# against the real peers (the pool node's ASan build too); a crash or any
# sanitizer report fails the run.
ASAN_DP_LOG_DIR = _build/asan-dp-logs
eunit-asan-dp: epmd
	$(MAKE) -C c_src test-bins build/actor_dp_asan.so build/actor_pool_node_asan
	$(REBAR) compile
	rm -rf $(ASAN_DP_LOG_DIR) && mkdir -p $(ASAN_DP_LOG_DIR)
	@rc=0; ACTOR_DP_NIF=$(CURDIR)/c_src/build/actor_dp_asan.so \
	  ACTOR_POOL_NODE_EXE=$(CURDIR)/c_src/build/actor_pool_node_asan LD_PRELOAD=$$($(CC) -print-file-name=libasan.so) \
	  ERL_FLAGS="+Mea min $$ERL_FLAGS" ASAN_OPTIONS=detect_leaks=0:log_path=$(CURDIR)/$(ASAN_DP_LOG_DIR)/asan \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(CURDIR)/$(ASAN_DP_LOG_DIR)/ubsan \
	  $(REBAR) eunit --module=actor_dp_tests,actor_pool_ring_tests --sname ap_eunit_asan_dp_$$$$ || rc=$$?; \
	  scripts/sanitizer-reports $(ASAN_DP_LOG_DIR) "the data plane NIF" && exit $$rc

# README's "Getting it", as written: its rebar3 and mix git lines against a
# local bare clone, a _checkouts/ copy of the package's files (the .app.src's
# `files'), and a release of the rebar3 project.
dep-test: epmd
	bash test/dep_project/run

# examples/elixir_app: actor_pool as a mix dependency (path, manager: :rebar3),
# built offline with the system rebar3, and its ExUnit suite.
elixir-test: epmd
	cd examples/elixir_app && MIX_REBAR3=$$(command -v rebar3) MIX_ENV=test mix test

dialyzer:
	$(REBAR) dialyzer

# API reference (edoc) into doc/; any edoc warning fails it.
docs: compile
	@out=$$($(REBAR) edoc 2>&1); rc=$$?; echo "$$out"; \
	  if [ $$rc -ne 0 ] || echo "$$out" | grep -qi "warning"; then \
	    echo "make docs: edoc failed or warned (above)"; exit 1; fi; \
	  echo "make docs: API reference in doc/index.html"

# Starts the application (and its pool C node), validates JSON documents on a
# pool, echoes through another, prints results and stats, stops it all.
demo: deps compile
	escript scripts/demo.erl

bench: deps compile
	$(MAKE) -C . bench-run

# Charts of the last make bench (_build/bench/results.csv) into docs/bench/,
# one SVG per benchmark and I/O backend (gnuplot).
bench-report:
	bench/report docs/bench

# Not part of make bench: the receptionist on real BEAM peers of this host at
# N = BENCH_SCALE_NODES (default "3 5 10 20"; a size that does not fit in the
# free memory is skipped, and said so), beside pg on the same peers:
# convergence p50/p99 of a registration, gossip bytes per change and per idle
# member and second, CPU per change per node, removal of a member holding 10K
# registrations. A table per N and _build/bench/scale.csv; about a minute on
# 2 vCPUs at the defaults. Knobs: bench/ap_scale_bench.erl.
bench-scale: deps compile
	bench/run scale

# The gossip simulator's large runs (support/ap_gossip_sim.erl): the
# scenarios of ap_gossip_sim:scenarios/1 at 100, 300 and 1000 simulated
# members (BENCH_SIM_NODES), printed and written to _build/bench/sim.csv for
# make bench-scale-report. The 1000-member runs take minutes each.
bench-sim: compile
	mkdir -p _build/bench/sim-ebin
	erlc -o _build/bench/sim-ebin support/ap_gossip_sim.erl
	echo "date=$$(date -u '+%Y-%m-%d %H:%M UTC')" > _build/bench/sim.meta
	erl -noshell -pa _build/default/lib/actor_pool/ebin -pa _build/bench/sim-ebin -eval 'ap_gossip_sim:main()'

# Curves vs N of the last make bench-scale (_build/bench/scale.csv) into
# docs/scaling/, one SVG per measure (gnuplot).
bench-scale-report:
	bench/scale_report docs/scaling

bench-run:
	@if [ -x bench/run ]; then bench/run; \
	 else echo "make bench: bench/run is not there yet"; fi

fuzz: deps
	$(MAKE) -C c_src fuzz

# Not part of `make test`: three BEAM peers and a standalone pool node under
# a steady load while a seeded chaos process injects faults; prints a table
# and fails on a lost registration, tell or answer, a wrong, raising or late
# answer, a tell pool's counters going back unexplained, memory growth or a
# leak. SOAK_S seconds (default 600), SOAK_SEED to repeat a run,
# SOAK_INJECT to see a rule fail. See docs/operations.md, "The soak".
SOAK_S ?= 600
soak: deps
	SOAK_S=$(SOAK_S) bash soak/run

clean:
	$(MAKE) -C c_src clean
	rm -rf _build rebar3.crashdump erl_crash.dump
