%% @doc Routing-by-key benchmark: three standalone pool nodes serve one
%% service key, 64 callers on this node ask by key; the choice among the
%% pools (actor_pool_route: the lighter of two by asks in flight, weighted
%% by how fast each pool has been answering; set-aside and probe after a
%% timeout) beside random choice, measured in the same run. The random
%% anchor is what a call by key did before: the pools listed under the key
%% (`actor_receptionist:lookup/1'), one at random per ask, asked by pid.
%%
%% The bench node runs the actor_pool application (its receptionist; its
%% own pool node is not used). Three `actor_pool_node' processes are
%% started by hand, `--connect' to it, each with an echo pool of 2 workers
%% registered under "route-bench" (`--pool route_echo:echo:2:key=...'), as
%% users run pool nodes on other hosts; on each, two more pools of the test
%% plugin (c_src/test/plugin_crash.c) whose every message first waits
%% BENCH_ROUTE_DELAY_US [1000] us, 2 workers each: under
%% "route-bench-equal" all three alike, under "route-bench-slow" the first
%% node's ten times longer. Every caller asks a 100-byte binary with the
%% default timeout (5 s, `actor_pool:ask/2'), again and again, and checks
%% each reply.
%% <ul>
%% <li>healthy: rounds of BENCH_ROUTE_ROUND_MS [2000] ms, by key and at
%%     random alternating (BENCH_ROUTE_ROUNDS [3] of each); asks per second
%%     (the median round), p99, and the CPU per ask of this BEAM and of the
%%     pool nodes in each round. Target: by key >= 0.95x random;</li>
%% <li>one node frozen: a round of 2 s, then SIGSTOP on the first pool node
%%     for BENCH_ROUTE_FREEZE_MS [2000] ms, then SIGCONT and 2 s more; once
%%     by key, once at random. Asks per second while frozen as a share of
%%     the 1.5 s before it (the first 0.5 s of the round left out), the
%%     longest ask of the round, and how long after SIGCONT the thawed
%%     node was sent an ask by key again (actor_pool:key_stats/1, polled
%%     every 5 ms), and (no target) how many callers were waiting on the
%%     frozen node when it thawed (its asks in flight by key). Targets:
%%     >= 60% of before; longest ask <= the timeout plus 10% (5.5 s); sent
%%     asks again within 1 s;</li>
%% <li>one node slower: rounds of BENCH_ROUTE_ROUND_MS on the equal pools
%%     and on the slow ones, by key and at random; p99 of the asks that
%%     began after the round's first 0.5 s. Target: by key with one node
%%     ten times slower <= 2x by key with three equal nodes.</li>
%% </ul>
%% Knobs (environment, defaults in brackets): BENCH_ROUTE_CALLERS [64],
%% BENCH_ROUTE_ROUND_MS [2000], BENCH_ROUTE_ROUNDS [3], BENCH_ROUTE_FREEZE_MS
%% [2000], BENCH_ROUTE_DELAY_US [1000], BENCH_ROUTE_TIMEOUT_S (the whole
%% bench [300]), BENCH_STRICT=1 (exit 2 when a target is missed).
%%
%% At the end the pool nodes are let run (SIGCONT) and killed by OS pid,
%% the application is stopped, and the bench checks that every name it
%% brought up left epmd and every OS process is gone. Exit status: 0; 1
%% when something failed; 2 for a missed target under BENCH_STRICT=1.
-module(ap_route_bench).

-import(ap_bench_util, [env_int/2, wait_until/3, median/1, fmt/1]).

-export([main/0]).

-define(ECHO, <<"route-bench">>).
-define(EQUAL, <<"route-bench-equal">>).
-define(SLOW, <<"route-bench-slow">>).
-define(PAYLOAD, <<0:800>>).
-define(TIMEOUT_MS, 5000).
-define(WAIT_MS, 30000).
%% Rounds leave this much out at their start (callers starting, weights
%% settling); the freeze round measures "before" over the 1.5 s after it.
-define(SETTLE_MS, 500).
-define(BEFORE_MS, 2000).
-define(AFTER_MS, 2000).
%% Completions are counted per 10 ms.
-define(BUCKET_MS, 10).

-spec main() -> no_return().
main() ->
    ap_bench_util:main("route", "BENCH_ROUTE_TIMEOUT_S", 300, fun run/0,
                       [{"stopping the pool nodes", fun stop_nodes/0},
                        {"stopping the application", fun stop_app/0}]).

fail(Fmt, Args) -> throw({bench_failed, Fmt, Args}).

run() ->
    NC = env_int("BENCH_ROUTE_CALLERS", 64),
    RoundMs = env_int("BENCH_ROUTE_ROUND_MS", 2000),
    Rounds = env_int("BENCH_ROUTE_ROUNDS", 3),
    FreezeMs = env_int("BENCH_ROUTE_FREEZE_MS", 2000),
    DelayUs = env_int("BENCH_ROUTE_DELAY_US", 1000),
    NC >= 1 andalso RoundMs > ?SETTLE_MS andalso Rounds >= 1 andalso FreezeMs >= 100
        andalso DelayUs >= 1 orelse
        fail("BENCH_ROUTE_* out of range (callers >= 1, round > ~p ms, rounds >= 1, "
             "freeze >= 100 ms, delay >= 1 us)", [?SETTLE_MS]),
    is_alive() orelse fail("the bench node is not distributed (run it with -sname)", []),
    T0 = erlang:monotonic_time(millisecond),
    Load0 = loadavg(),
    ok = logger:set_primary_config(level, warning),
    start_app(),
    Nodes = start_nodes(3),
    {plugin, _} = Crash = {plugin, ap_support:test_bin("plugin_crash.so")},
    Echo = key(?ECHO),
    Equal = key(?EQUAL),
    Slow = key(?SLOW),
    [SlowNode | _] = [N || {N, _} <- Nodes],
    [begin
         start_pool(route_equal, Crash, DelayUs, N, ?EQUAL),
         start_pool(route_slow, Crash, case N of SlowNode -> 10 * DelayUs; _ -> DelayUs end,
                    N, ?SLOW)
     end || {N, _} <- Nodes],
    Listed = fun(K) -> wait_until(fun() -> length(actor_receptionist:lookup(K)) =:= 3 end,
                                  ?WAIT_MS, {three_pools_under, K}) end,
    [Listed(K) || K <- [Echo, Equal, Slow]],
    %% The lanes to the pool nodes (a stats request by ring sets one up),
    %% and a few asks of each kind.
    [#{} = actor_pool:stats(P) || K <- [Echo, Equal, Slow], P <- actor_receptionist:lookup(K)],
    [ok = check(ask(Kind, K)) || K <- [Echo, Equal, Slow], Kind <- [key, random],
                                 _ <- lists:seq(1, 20)],
    io:format("~n== routing-by-key benchmark (io ~p; 3 pool nodes, ~p callers, rounds of ~p ms; "
              "~p CPUs on the host, load average ~s)~n",
              [io(), NC, RoundMs, erlang:system_info(logical_processors_online), Load0]),

    %% Healthy: rates by key and at random, alternating.
    OsPids = [os:getpid() | [integer_to_list(P) || {_, P} <- Nodes]],
    Healthy = lists:append(
                [[{Kind, cpu_round(OsPids, fun() -> round_(Kind, Echo, NC, RoundMs) end)}
                  || Kind <- case I rem 2 of 0 -> [key, random]; 1 -> [random, key] end]
                 || I <- lists:seq(0, Rounds - 1)]),
    [io:format("  healthy ~-6s ~10s asks/s  p99 ~8s us  CPU per ask: this BEAM ~5.1f us, "
               "pool nodes ~5.1f us~n",
               [K, fmt(maps:get(rate, R)), fmt(maps:get(p99, R) / 1000), maps:get(beam_us, R),
                maps:get(nodes_us, R)]) || {K, R} <- Healthy],
    Med = fun(L, Kind, F) -> median([maps:get(F, R) || {K, R} <- L, K =:= Kind]) end,

    %% One node frozen.
    Freeze = [{Kind, freeze_round(Kind, Echo, NC, FreezeMs, Nodes)} || Kind <- [key, random]],
    [io:format("  frozen  ~-6s before ~10s asks/s  while frozen ~10s asks/s  longest ~s ms  "
               "sent asks again after ~s ms~n",
               [K, fmt(B), fmt(F), fmt(L), fmt(Take)])
     || {K, #{before := B, frozen := F, longest_ms := L, take_ms := Take}} <- Freeze],

    %% One node slower.
    SlowRounds = lists:append(
                   [[{{Kind, Which}, round_(Kind, K, NC, RoundMs)}
                     || {Which, K} <- [{equal, Equal}, {slow, Slow}], Kind <- [key, random]]
                    || _ <- lists:seq(1, max(1, Rounds - 1))]),
    [io:format("  delay   ~-6s ~-5s ~10s asks/s  p99 ~8s us~n",
               [K, W, fmt(maps:get(rate, R)), fmt(maps:get(p99, R) / 1000)])
     || {{K, W}, R} <- SlowRounds],
    P99 = fun(KW) -> median([maps:get(p99, R) || {KW1, R} <- SlowRounds, KW1 =:= KW]) / 1.0e6 end,

    #{key := FK, random := FR} = maps:from_list(Freeze),
    Share = fun(#{before := B, frozen := F}) -> 100 * F / max(1.0e-9, B) end,
    Rows =
        [{"asks by key, 3 healthy nodes (asks/s)", Med(Healthy, key, rate),
          [{"random choice (asks/s)", Med(Healthy, random, rate)}],
          {ge, Med(Healthy, random, rate), 0.95, ">= 0.95x random"}},
         {"ask by key p99 (us), 3 healthy nodes", Med(Healthy, key, p99) / 1000,
          [{"random choice p99", Med(Healthy, random, p99) / 1000}], none},
         {"asks per second while 1 of 3 frozen, % of before", Share(FK),
          [{"random choice, % of before", Share(FR)}], {ge_abs, 60, ">= 60%"}},
         {"longest ask, freeze round (ms)", maps:get(longest_ms, FK),
          [{"random choice", maps:get(longest_ms, FR)}],
          {le, ?TIMEOUT_MS, 1.1, "<= timeout + 10%"}},
         {"thawed node sent asks again after (ms)", maps:get(take_ms, FK), [],
          {lt_abs, 1000, "< 1 s"}},
         {"callers on the frozen node at thaw", maps:get(waiting, FK), [], none},
         {"ask by key p99 (ms), 1 node 10x slower", P99({key, slow}),
          [{"by key p99, 3 equal nodes", P99({key, equal})},
           {"random choice p99, 1 slower", P99({random, slow})},
           {"random choice p99, 3 equal", P99({random, equal})}],
          {le, P99({key, equal}), 2, "<= 2x 3 equal nodes"}}],
    io:format("~n"),
    Missed = ap_bench_util:print(Rows),
    io:format("load average at the end ~s; routing bench took ~.1f s~n",
              [loadavg(), (erlang:monotonic_time(millisecond) - T0) / 1000]),
    Missed.

key(Id) -> actor_receptionist:service_key(Id).

io() ->
    case catch actor_cnode:info(actor_pool_node_owner) of
        #{io := Io} -> Io;
        _ -> os:getenv("ACTOR_POOL_IO", "auto")
    end.

%% ===================================================================
%% The asks
%% ===================================================================

%% by key: actor_pool's choice; random: one of the pools listed, by pid.
ask(key, K) ->
    actor_pool:ask(K, ?PAYLOAD);
ask(random, K) ->
    case actor_receptionist:lookup(K) of
        [] -> {error, no_pool};
        Pids -> actor_pool:ask(lists:nth(rand:uniform(length(Pids)), Pids), ?PAYLOAD)
    end.

check({ok, ?PAYLOAD}) -> ok;
check(Other) -> {bad_reply, Other}.

%% NC callers asking K for DurMs (Kind: key or random), every reply
%% checked. Extra runs beside them (the freeze round's signals) with the
%% round's start, and its result is returned as `extra'. #{rate (asks per
%% second after the first ?SETTLE_MS), p99 (ns, asks begun after it),
%% longest_ms, buckets (completions per ?BUCKET_MS from the start),
%% start (monotonic ms)}.
round_(Kind, K, NC, DurMs) ->
    round_(Kind, K, NC, DurMs, none).

round_(Kind, K, NC, DurMs, Extra) ->
    Buckets = counters:new(DurMs div ?BUCKET_MS + 2 + ?TIMEOUT_MS div ?BUCKET_MS,
                           [write_concurrency]),
    Start = erlang:monotonic_time(millisecond) + 100,
    End = Start + DurMs,
    Self = self(),
    Callers = [spawn_monitor(fun() -> caller(Self, Kind, K, Start, End, Buckets) end)
               || _ <- lists:seq(1, NC)],
    ExtraResult = case Extra of
                      none -> none;
                      F -> F(Start)
                  end,
    {Lats, Longest} = collect(Callers, End + 2 * ?TIMEOUT_MS, [], 0),
    Sorted = lists:sort(Lats),
    Len = length(Sorted),
    Len > 0 orelse fail("no ask of the ~p round (~p) began after its first ~p ms",
                        [Kind, K, ?SETTLE_MS]),
    Done = lists:sum([counters:get(Buckets, I)
                      || I <- lists:seq(?SETTLE_MS div ?BUCKET_MS + 1, DurMs div ?BUCKET_MS)]),
    #{rate => Done / ((DurMs - ?SETTLE_MS) / 1000),
      p99 => lists:nth(max(1, ceil(Len * 0.99)), Sorted),
      longest_ms => Longest / 1.0e6, buckets => Buckets, start => Start, extra => ExtraResult}.

%% A round with the CPU time this BEAM ([Beam | _] = OsPids) and the pool
%% nodes took over it, per ask done in it (/proc/PID/stat, 10 ms ticks: a
%% round is seconds of CPU).
cpu_round(OsPids, Round) ->
    C0 = [proc_cpu_us(P) || P <- OsPids],
    R = Round(),
    [B | N] = lists:zipwith(fun(X, Y) -> Y - X end, C0, [proc_cpu_us(P) || P <- OsPids]),
    #{buckets := Buckets} = R,
    #{size := Size} = counters:info(Buckets),
    Asks = max(1, lists:sum([counters:get(Buckets, I) || I <- lists:seq(1, Size)])),
    R#{beam_us => B / Asks, nodes_us => lists:sum(N) / Asks}.

proc_cpu_us(OsPid) ->
    {ok, Stat} = file:read_file("/proc/" ++ OsPid ++ "/stat"),
    %% The fields after the command's closing parenthesis: utime, stime
    %% are the 12th and 13th of them.
    [_, Rest] = binary:split(Stat, <<") ">>),
    Fields = binary:split(Rest, <<" ">>, [global]),
    (binary_to_integer(lists:nth(12, Fields)) + binary_to_integer(lists:nth(13, Fields))) * 10000.

caller(Parent, Kind, K, Start, End, Buckets) ->
    receive after max(0, Start - erlang:monotonic_time(millisecond)) -> ok end,
    caller_loop(Parent, Kind, K, Start, End, Buckets, [], 0).

caller_loop(Parent, Kind, K, Start, End, Buckets, Lats, Longest) ->
    T0 = erlang:monotonic_time(),
    case erlang:convert_time_unit(T0, native, millisecond) of
        Now when Now >= End ->
            exit({done, Lats, Longest});
        Now ->
            case ask(Kind, K) of
                {ok, ?PAYLOAD} -> ok;
                Other -> exit({bad_reply, Other})
            end,
            T1 = erlang:monotonic_time(),
            Ns = erlang:convert_time_unit(T1 - T0, native, nanosecond),
            Ms = erlang:convert_time_unit(T1, native, millisecond),
            counters:add(Buckets, (Ms - Start) div ?BUCKET_MS + 1, 1),
            Lats1 = case Now - Start >= ?SETTLE_MS of
                        true -> [Ns | Lats];
                        false -> Lats
                    end,
            caller_loop(Parent, Kind, K, Start, End, Buckets, Lats1, max(Longest, Ns))
    end.

collect([], _Deadline, Lats, Longest) ->
    {lists:append(Lats), Longest};
collect(Ms, Deadline, Lats, Longest) ->
    receive
        {'DOWN', Ref, process, Pid, {done, L, Lg}} ->
            collect(lists:delete({Pid, Ref}, Ms), Deadline, [L | Lats], max(Longest, Lg));
        {'DOWN', Ref, process, Pid, Why} ->
            [exit(P, kill) || {P, _} <- lists:delete({Pid, Ref}, Ms)],
            fail("a caller failed: ~0p", [Why])
    after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
            [exit(P, kill) || {P, _} <- Ms],
            fail("~p callers not done ~p ms after their round", [length(Ms), 2 * ?TIMEOUT_MS])
    end.

%% A round of ?BEFORE_MS + FreezeMs + ?AFTER_MS during which the first
%% pool node is stopped (SIGSTOP) from ?BEFORE_MS for FreezeMs. #{before,
%% frozen (asks per second), longest_ms, take_ms (by key: from SIGCONT to
%% the first ask by key sent to the thawed node; random: undefined)}.
freeze_round(Kind, K, NC, FreezeMs, [{Node, OsPid} | _]) ->
    Thawed = fun() -> [P || P <- actor_receptionist:lookup(K), node(P) =:= Node] end,
    Stats = fun() ->
                    case Thawed() of
                        [P] -> hd([S || #{pool := P1} = S <- actor_pool:key_stats(K), P1 =:= P]);
                        _ -> fail("~p no longer lists a pool on ~p", [K, Node])
                    end
            end,
    Sent = fun() -> maps:get(asks, Stats()) end,
    Signals = fun(Start) ->
                      sleep_until(Start + ?BEFORE_MS),
                      TStop = erlang:monotonic_time(millisecond),
                      signal(OsPid, "STOP"),
                      sleep_until(TStop + FreezeMs),
                      #{asks := Asks0, in_flight := Waiting} = Stats(),
                      TCont = erlang:monotonic_time(millisecond),
                      signal(OsPid, "CONT"),
                      Take = case Kind of
                                 key ->
                                     case ap_support:poll(Sent, fun(A) -> A > Asks0 end,
                                                          ?AFTER_MS, 5) of
                                         {ok, _} -> erlang:monotonic_time(millisecond) - TCont;
                                         {timeout, _} -> undefined
                                     end;
                                 random ->
                                     undefined
                             end,
                      {TStop, TCont, Take, case Kind of key -> Waiting; random -> undefined end}
              end,
    R = round_(Kind, K, NC, ?BEFORE_MS + FreezeMs + ?AFTER_MS, Signals),
    #{buckets := B, start := Start, extra := {TStop, TCont, Take, Waiting},
      longest_ms := Longest} = R,
    Rate = fun(From, To) ->
                   I0 = (From - Start) div ?BUCKET_MS + 1,
                   I1 = (To - Start) div ?BUCKET_MS,
                   lists:sum([counters:get(B, I) || I <- lists:seq(I0, I1)])
                       / ((I1 - I0 + 1) * ?BUCKET_MS / 1000)
           end,
    #{before => Rate(Start + ?SETTLE_MS, TStop), frozen => Rate(TStop, TCont),
      longest_ms => Longest, take_ms => Take, waiting => Waiting}.

sleep_until(T) ->
    receive after max(0, T - erlang:monotonic_time(millisecond)) -> ok end.

signal(OsPid, Sig) ->
    [] = os:cmd("kill -" ++ Sig ++ " " ++ integer_to_list(OsPid)),
    ok.

%% ===================================================================
%% The application, the pool nodes
%% ===================================================================

start_app() ->
    ok = ap_bench_util:start_app().

%% N pool nodes, each with an echo pool of 2 workers under ?ECHO, connected
%% to this node: [{Node, OsPid}].
start_nodes(N) ->
    Dir = filename:join(os:getenv("TMPDIR", "/tmp"), "ap_route_bench_" ++ os:getpid()),
    ok = filelib:ensure_dir(filename:join(Dir, "x")),
    ok = file:change_mode(Dir, 8#700),
    Cookie = filename:join(Dir, "cookie"),
    ok = file:write_file(Cookie, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(Cookie, 8#600),
    put(route_dir, Dir),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Exe = filename:join(ap_support:priv_dir(), "actor_pool_node"),
    Nodes = [begin
                 Alive = "ap_route_bench_" ++ os:getpid() ++ "_" ++ integer_to_list(I),
                 Node = list_to_atom(Alive ++ "@" ++ Host),
                 Port = open_port({spawn_executable, Exe},
                                  [{args, ["--name", atom_to_list(Node), "--cookie-file", Cookie,
                                           "--connect", atom_to_list(node()),
                                           "--pool", "route_echo:echo:2:key=" ++
                                               binary_to_list(?ECHO)]},
                                   exit_status, binary, stderr_to_stdout, use_stdio]),
                 {os_pid, OsPid} = erlang:port_info(Port, os_pid),
                 put({route_node, Node}, {Port, OsPid, Alive}),
                 {Node, OsPid}
             end || I <- lists:seq(1, N)],
    [wait_until(fun() -> lists:member(Node, nodes(hidden)) end, ?WAIT_MS, {connected, Node})
     || {Node, _} <- Nodes],
    Nodes.

start_pool(Name, {plugin, Path}, DelayUs, Node, Id) ->
    case actor_pool:start_pool(Name, {plugin, Path, {delay_us, DelayUs}},
                               #{node => Node, workers => 2, service_key => Id}) of
        {ok, _} -> ok;
        Other -> fail("start_pool(~p) on ~p: ~p", [Name, Node, Other])
    end.

stop_nodes() ->
    Nodes = [{N, V} || {{route_node, N}, V} <- get()],
    [begin
         erase({route_node, N}),
         _ = ap_support:os_pid_alive(OsPid) andalso signal(OsPid, "CONT"),
         _ = ap_support:os_pid_alive(OsPid) andalso signal(OsPid, "KILL"),
         catch port_close(Port)
     end || {N, {Port, OsPid, _}} <- Nodes],
    ok = ap_bench_util:gone([A || {_, {_, _, A}} <- Nodes], [P || {_, {_, P, _}} <- Nodes],
                            ?WAIT_MS),
    case erase(route_dir) of
        undefined -> ok;
        Dir -> _ = file:del_dir_r(Dir), ok
    end.

stop_app() ->
    ap_bench_util:stop_app(?WAIT_MS).

loadavg() ->
    case file:read_file("/proc/loadavg") of
        {ok, B} -> lists:join(" ", lists:sublist(string:lexemes(B, " "), 3));
        _ -> "?"
    end.
