# actor_pool: top-level entry points. The C side has its own c_src/Makefile,
# which rebar3 runs before compiling the Erlang sources (see rebar.config).

REBAR ?= rebar3
EPMD  ?= epmd

.PHONY: all compile deps epmd test eunit dep-test dialyzer demo bench bench-run \
        fuzz clean

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
# dependency of another project, and dialyzer.
test: deps
	$(MAKE) -C c_src test
	$(REBAR) compile
	$(MAKE) eunit
	$(MAKE) dep-test
	$(MAKE) dialyzer

eunit: epmd
	ACTOR_POOL_IO=uring $(REBAR) eunit --sname ap_eunit_uring_$$$$
	ACTOR_POOL_IO=epoll $(REBAR) eunit --sname ap_eunit_epoll_$$$$

dep-test:
	bash test/dep_project/run

dialyzer:
	$(REBAR) dialyzer

# Starts the application and the echo C node, talks to it, stops it all.
demo: deps compile
	escript scripts/demo.erl

bench: deps compile
	$(MAKE) -C . bench-run

bench-run:
	@if [ -x bench/run ]; then bench/run; \
	 else echo "make bench: bench/run is not there yet"; fi

fuzz: deps
	$(MAKE) -C c_src fuzz

clean:
	$(MAKE) -C c_src clean
	rm -rf _build rebar3.crashdump erl_crash.dump
