%% @doc Helpers shared by the EUnit suites (test/), the benchmarks (bench/),
%% the demo (scripts/demo.erl) and the soak (soak/): whether an OS process
%% still runs, which names the local epmd holds, and polling with a
%% deadline instead of sleeping.
%%
%% Not part of the library: it lives outside src/ so that it is neither
%% shipped nor loaded by an application that depends on actor_pool. Each
%% user puts it on its own code path: rebar3's test profile compiles
%% support/ (rebar.config, extra_src_dirs), bench/run and soak/run compile
%% it beside their modules, and the demo compiles it in memory.
-module(ap_support).

-export([os_pid_alive/1, epmd_names/0]).
-export([poll/3, poll/4, wait_until/2]).
-export([priv_dir/0, root/0, test_bin/1]).

%% How often poll/3 and wait_until/2 probe.
-define(INTERVAL_MS, 10).

%% ===================================================================
%% OS processes and epmd
%% ===================================================================

%% Whether OS process OsPid still runs: it exists and is not a zombie,
%% read from /proc/PID/stat (Linux). A zombie has exited and waits only for
%% its parent to reap it: it holds no socket, no epmd name and no memory,
%% so for "has it stopped?" it counts as gone.
-spec os_pid_alive(non_neg_integer()) -> boolean().
os_pid_alive(OsPid) ->
    %% The library's own check (its owners use it to see a C node gone).
    actor_cnode_os:alive(OsPid).

%% The node names registered with the local epmd; none when epmd does not
%% answer (not running counts as holding no name).
-spec epmd_names() -> [string()].
epmd_names() ->
    case net_adm:names() of
        {ok, Names} -> [Name || {Name, _Port} <- Names];
        {error, _} -> []
    end.

%% ===================================================================
%% Where things are built
%% ===================================================================

%% The application's priv directory, also when it is not in a lib directory
%% (the library's own lookup).
-spec priv_dir() -> file:filename().
priv_dir() ->
    actor_pool_priv:dir().

%% The checkout: priv/'s parent (rebar3 links _build/*/lib/actor_pool/priv
%% to it).
-spec root() -> file:filename().
root() ->
    Priv = priv_dir(),
    Real = case file:read_link_all(Priv) of
               {ok, Target} -> filename:absname(Target, filename:dirname(Priv));
               {error, _} -> Priv
           end,
    filename:absname(filename:dirname(Real)).

%% A test executable or plugin (the echo node, actor_rawpeer,
%% actor_dp_peer, plugin_*.so) by file name: c_src/Makefile's test-bins
%% builds them into c_src/build/testbin, outside priv/ so that no release
%% ships them; found beside priv/, else under the working directory (the
%% suites, benches and soak run in the checkout).
-spec test_bin(string()) -> file:filename().
test_bin(Name) ->
    Rel = filename:join(["c_src", "build", "testbin", Name]),
    Beside = filename:join(root(), Rel),
    Path = case filelib:is_regular(Beside) of
               true -> Beside;
               false -> filename:absname(Rel)
           end,
    case filelib:is_regular(Path) of
        true -> Path;
        false -> error({no_test_bin, Path, "make -C c_src test-bins"})
    end.

%% ===================================================================
%% Polling with a deadline
%% ===================================================================

%% poll/4 every 10 ms.
-spec poll(fun(() -> T), fun((T) -> boolean()), non_neg_integer()) -> {ok, T} | {timeout, T}.
poll(Probe, Done, TimeoutMs) ->
    poll(Probe, Done, TimeoutMs, ?INTERVAL_MS).

%% Calls Probe every IntervalMs until Done holds for its value, for at most
%% TimeoutMs: {ok, Value} with the value Done accepted, or {timeout, Last}
%% with the last one. Probe runs at least once. The caller decides what a
%% timeout means (a test fails, a bench reports, a property records it).
-spec poll(fun(() -> T), fun((T) -> boolean()), non_neg_integer(), pos_integer()) ->
          {ok, T} | {timeout, T}.
poll(Probe, Done, TimeoutMs, IntervalMs) ->
    poll_(Probe, Done, erlang:monotonic_time(millisecond) + TimeoutMs, IntervalMs).

poll_(Probe, Done, Deadline, IntervalMs) ->
    V = Probe(),
    case Done(V) of
        true -> {ok, V};
        false ->
            case erlang:monotonic_time(millisecond) >= Deadline of
                true -> {timeout, V};
                false ->
                    receive after IntervalMs -> ok end,
                    poll_(Probe, Done, Deadline, IntervalMs)
            end
    end.

%% Polls Fun (every 10 ms) until it returns true; raises
%% {condition_not_met_within_ms, TimeoutMs} after TimeoutMs.
-spec wait_until(fun(() -> boolean()), non_neg_integer()) -> ok.
wait_until(Fun, TimeoutMs) ->
    case poll(Fun, fun(B) -> B end, TimeoutMs) of
        {ok, true} -> ok;
        {timeout, false} -> error({condition_not_met_within_ms, TimeoutMs})
    end.
