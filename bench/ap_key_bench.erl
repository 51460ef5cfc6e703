%% @doc Calls-by-key benchmark: asks by service key from 3 nodes to one
%% pool node, throughput and p99, beside the same asks by pid (the key's
%% lookup must cost under 5%).
%%
%% The bench node runs the actor_pool application (its pool C node and its
%% receptionist) and starts an echo pool of 2 workers registered under the
%% service key "key-bench" (`start_pool' option `service_key'). Two BEAM
%% peers on this host (the `peer' module) run the application without a
%% pool node (`{pool_node, false}', their own receptionist C node each);
%% the three nodes are connected pairwise, and the bench waits until
%% `actor_receptionist:lookup/1' of the key on every peer is `[Pool]'.
%% In one run:
%% <ul>
%% <li>rounds of asks from the 3 nodes at once: on each node
%%     BENCH_KEY_CALLERS [16] processes, each doing BENCH_KEY_ASKS [1500]
%%     sequential asks of a 100-byte binary, either by key
%%     (`actor_pool:ask({service_key, <<"key-bench">>}, Payload)': every ask
%%     resolves the key by the NIF lookup of the receptionist's snapshot,
%%     then asks the pool) or by pid (`actor_pool:ask(Pool, Payload)'). The
%%     peers run their callers through `erpc' calls of {@link callers/5}
%%     (this module, loaded from the bench dir on their code path). All
%%     callers start at one instant of the host's clock; a round's
%%     throughput is all asks of the 3 nodes over the time from that instant
%%     to the last caller's end, and its p50/p99 are those of every ask's
%%     latency (time around `actor_pool:ask/2' in the caller). Every reply
%%     is checked. The kinds alternate over BENCH_KEY_ROUNDS [12] rounds
%%     (key, pid, pid, key, key, pid, ...) so host noise hits both alike;
%%     each figure is the median of its kind's rounds. One short round of
%%     each kind warms up first (not counted);</li>
%% <li>the key resolution alone, on the bench node: BENCH_KEY_LOOKUPS
%%     [1000000] calls of `actor_receptionist:lookup(Key)' in a tight loop,
%%     ns per call, once after every pair of rounds (median), as a fraction
%%     of the by-pid ask latency p50 under the same load;</li>
%% <li>for scale (no target): BENCH_KEY_LONE_ASKS [5000] lone asks of each
%%     kind, one caller on the bench node, kinds in random order, p50.</li>
%% </ul>
%% Targets ("lookup cost < 5%"): throughput by key >= 0.95x by pid; p99 by
%% key <= 1.05x by pid; lookup ns / by-pid ask p50 < 0.05. Throughput and
%% p99 move from round to round by more than 5% on a shared host: below the
%% table, key vs pid is also given within each pair of adjacent rounds
%% (median and range), beside each kind's round-to-round spread ((max -
%% min) / median), and a note says so when a missed row is within that
%% spread (the row stays MISSED).
%%
%% The pool's `processed' must grow by exactly the asks made, and its
%% `overloaded', `errors', `crashes' and `dropped_tells' must stay 0.
%%
%% Knobs (environment, defaults in brackets): BENCH_KEY_CALLERS [16] (per
%% node), BENCH_KEY_ASKS [1500] (per caller and round), BENCH_KEY_ROUNDS
%% [12] (even), BENCH_KEY_LOOKUPS [1000000], BENCH_KEY_LONE_ASKS [5000],
%% BENCH_KEY_PEER_ARGS (extra `erl' arguments of the peers),
%% BENCH_KEY_TIMEOUT_S (the whole bench [180]; past it the bench halts with
%% status 1, and the peers, linked to it, go with it), BENCH_STRICT=1 (exit
%% 2 when a target is missed). ACTOR_POOL_IO (set by bench/run) reaches the
%% peers' C nodes through the environment.
%%
%% At the end the pool, the peers and the application are stopped, also on
%% failure, and the bench checks that every name it brought up (the peers,
%% their receptionist C nodes, this node's pool and receptionist C nodes)
%% left epmd and their OS processes are gone. Exit status: 0; 1 when
%% something failed (a timeout, a wrong reply, a peer that does not start
%% or does not go; the message says what); 2 for a missed target under
%% BENCH_STRICT=1.
-module(ap_key_bench).

-import(ap_bench_util, [env_int/2, wait_until/3]).

-export([main/0]).

%% Run on every node of the bench by erpc.
-export([callers/5]).

-define(ID, <<"key-bench">>).
-define(POOL_NAME, key_bench_echo).
-define(PAYLOAD, <<0:800>>).
%% Any single wait: a peer, the mesh, the listings, a stop.
-define(WAIT_MS, 30000).
%% One round of asks, all callers of all nodes.
-define(ROUND_MS, 60000).
%% Callers start this long after the round is set up (spawning, erpc).
-define(START_DELAY_US, 200000).
-define(LOSS_KEYS, [overloaded, errors, crashes, dropped_tells]).

-spec main() -> no_return().
main() ->
    ap_bench_util:main("key", "BENCH_KEY_TIMEOUT_S", 180, fun run/0,
                       [{"stopping the pool", fun stop_pool/0},
                        {"stopping the peers", fun stop_peers/0},
                        {"stopping the application", fun stop_app/0}]).

fail(Fmt, Args) -> throw({bench_failed, Fmt, Args}).

run() ->
    Cfg = #{callers => env_int("BENCH_KEY_CALLERS", 16),
            asks => env_int("BENCH_KEY_ASKS", 1500),
            rounds => env_int("BENCH_KEY_ROUNDS", 12),
            lookups => env_int("BENCH_KEY_LOOKUPS", 1000000),
            lone => env_int("BENCH_KEY_LONE_ASKS", 5000),
            peer_args => string:lexemes(os:getenv("BENCH_KEY_PEER_ARGS", ""), " ")},
    #{callers := NC, asks := NA, rounds := Rounds, lookups := NL, lone := Lone} = Cfg,
    Rounds >= 2 andalso Rounds rem 2 =:= 0 orelse
        fail("BENCH_KEY_ROUNDS (~p) must be even and at least 2", [Rounds]),
    NC >= 1 andalso NA >= 1 andalso NL >= 1 andalso Lone >= 1 orelse
        fail("BENCH_KEY_CALLERS, _ASKS, _LOOKUPS and _LONE_ASKS must be positive", []),
    is_alive() orelse fail("the bench node is not distributed (run it with -sname)", []),
    T0 = erlang:monotonic_time(millisecond),
    Load0 = loadavg(),
    %% The C nodes' start-up notices (and the application's stop report)
    %% would cut through the table.
    ok = logger:set_primary_config(level, warning),
    Pool = start_local(),
    Key = actor_receptionist:service_key(?ID),
    [Pool] =:= actor_receptionist:lookup(Key) orelse
        fail("lookup(~p) on the bench node is ~p right after start_pool, not [~p]",
             [Key, actor_receptionist:lookup(Key), Pool]),
    Peers = [start_member("ap_key_bench_" ++ os:getpid() ++ "_" ++ integer_to_list(I), Cfg)
             || I <- [1, 2]],
    Nodes = [node() | Peers],
    mesh(Nodes),
    [wait_until(fun() -> erpc:call(N, actor_receptionist, lookup, [Key]) =:= [Pool] end,
                ?WAIT_MS, {lookup_is_the_pool_on, N})
     || N <- Peers],
    P = ?PAYLOAD,
    [case erpc:call(N, actor_pool, ask, [T, P], ?WAIT_MS) of
         {ok, P} -> ok;
         Other -> fail("first ask of ~p from ~p: ~p", [T, N, Other])
     end || N <- Nodes, T <- [Key, Pool]],
    #{io := Io} = actor_cnode:info(actor_pool_node_owner),
    io:format("~n== key benchmark (io ~p; ~p nodes x ~p callers x ~p asks per round, "
              "~p rounds; ~p CPUs on the host, load average ~s)~n",
              [Io, length(Nodes), NC, NA, Rounds,
               erlang:system_info(logical_processors_online), Load0]),
    Stats0 = pool_counters(Pool),

    %% Warm-up: a short round of each kind.
    WarmN = max(1, NA div 5),
    _ = ask_round(Nodes, Key, NC, WarmN),
    _ = ask_round(Nodes, Pool, NC, WarmN),

    %% Pairs of rounds, first kind alternating; the lookup loop after each.
    Kinds = #{key => Key, pid => Pool},
    {Res, LookupNs} =
        lists:foldl(
          fun(Pair, {Acc, LAcc}) ->
                  Order = case Pair rem 2 of 0 -> [key, pid]; 1 -> [pid, key] end,
                  Acc1 = lists:foldl(
                           fun(K, A) ->
                                   R = ask_round(Nodes, maps:get(K, Kinds), NC, NA),
                                   io:format("  round ~2w ~-3s ~10s asks/s  p50 ~8s us  p99 ~8s us~n",
                                             [length(A) + 1, K, fmt(maps:get(rate, R)),
                                              fmt(maps:get(p50, R) / 1000),
                                              fmt(maps:get(p99, R) / 1000)]),
                                   [{K, R} | A]
                           end, Acc, Order),
                  {Acc1, [lookup_ns(Key, NL) | LAcc]}
          end, {[], []}, lists:seq(0, Rounds div 2 - 1)),
    LoneRes = lone(Lone, Key, Pool),
    Asked = 2 * length(Nodes) * NC * WarmN + Rounds * length(Nodes) * NC * NA + 2 * Lone,
    check_counters(Pool, Stats0, Asked),

    Med = fun(K, F) -> median([maps:get(F, R) || {K1, R} <- Res, K1 =:= K]) end,
    Spread = fun(K, F) -> spread([maps:get(F, R) || {K1, R} <- Res, K1 =:= K]) end,
    KeyRate = Med(key, rate),
    PidRate = Med(pid, rate),
    KeyP99 = Med(key, p99) / 1000,
    PidP99 = Med(pid, p99) / 1000,
    PidP50 = Med(pid, p50) / 1000,
    Lookup = median(LookupNs),
    Rows =
        [{"asks by key, 3 nodes (asks/s)", KeyRate,
          [{"asks by pid, 3 nodes", PidRate}],
          {ge, PidRate, 0.95, ">= 0.95x by pid"}},
         {"ask by key p50 (us)", Med(key, p50) / 1000,
          [{"ask by pid p50", PidP50}], none},
         {"ask by key p99 (us)", KeyP99,
          [{"ask by pid p99", PidP99}],
          {le, PidP99, 1.05, "<= 1.05x by pid"}},
         {"lookup/1 of the key alone (ns)", Lookup,
          [{"ask by pid p50 (ns)", PidP50 * 1000}],
          {lt, PidP50 * 1000, 0.05, "ratio < 0.05"}},
         {"lone ask by key p50 (us), 1 caller", maps:get(key, LoneRes),
          [{"lone ask by pid p50", maps:get(pid, LoneRes)}], none},
         {"lookup/1 alone / lone ask by pid p50", Lookup / (maps:get(pid, LoneRes) * 1000),
          [], none}],
    io:format("~n"),
    {Missed, Verdicts} = print(Rows),
    io:format("(lookup/1 ns per call, by run: ~s)~n",
              [lists:join(", ", [fmt(L) || L <- lists:reverse(LookupNs)])]),
    %% key/pid - 1 within each pair of adjacent rounds (less drift between
    %% the two than between the kinds' medians).
    Paired = fun(F) -> [pair_diff(F, Pair) || Pair <- pairs(lists:reverse(Res))] end,
    notes([{"throughput", KeyRate / PidRate - 1, Paired(rate), Spread(pid, rate),
            Spread(key, rate), lists:nth(1, Verdicts)},
           {"p99", KeyP99 / PidP99 - 1, Paired(p99), Spread(pid, p99), Spread(key, p99),
            lists:nth(3, Verdicts)}]),
    io:format("load average at the end ~s; key bench took ~.1f s~n",
              [loadavg(), (erlang:monotonic_time(millisecond) - T0) / 1000]),
    Missed.

%% ===================================================================
%% This node, the peers
%% ===================================================================

%% The application on this node (its pool and receptionist C nodes) and the
%% echo pool under the key.
start_local() ->
    ok = ap_bench_util:start_app(),
    case actor_pool:start_pool(?POOL_NAME, echo, #{workers => 2, service_key => ?ID}) of
        {ok, Pool} when is_pid(Pool) ->
            put(pool, Pool),
            Pool;
        Other ->
            fail("actor_pool:start_pool(~p, echo, ...): ~p", [?POOL_NAME, Other])
    end.

start_member(Name, Cfg) ->
    Paths = lists:usort([filename:absname(filename:dirname(code:which(M)))
                         || M <- [actor_pool, ?MODULE]]),
    Args = ["-setcookie", atom_to_list(erlang:get_cookie()),
            %% Their C nodes' start-up notices would cut through the table.
            "-kernel", "logger_level", "warning",
            %% Only the connections made here (and to the pool node).
            "-connect_all", "false"
            | lists:append([["-pa", P] || P <- Paths])] ++ maps:get(peer_args, Cfg),
    {Peer, Node} = case peer:start_link(#{name => Name, args => Args}) of
                       {ok, Pr, Nd} -> {Pr, Nd};
                       Err -> fail("peer ~s did not start: ~p", [Name, Err])
                   end,
    OsPid = list_to_integer(erpc:call(Node, os, getpid, [], ?WAIT_MS)),
    put({peer, Peer}, #{node => Node, names => [Name], os_pids => [OsPid]}),
    ok = erpc:call(Node, application, load, [actor_pool], ?WAIT_MS),
    [ok = erpc:call(Node, application, set_env, [actor_pool, K, V], ?WAIT_MS)
     || {K, V} <- [{pool_node, false}, {receptionist_shm_mb, 32}]],
    case erpc:call(Node, application, ensure_all_started, [actor_pool], ?WAIT_MS) of
        {ok, _} -> ok;
        Err2 -> fail("actor_pool did not start on ~p: ~p", [Node, Err2])
    end,
    #{node := RNode, os_pid := COsPid} =
        erpc:call(Node, actor_cnode, info, [actor_receptionist_owner], ?WAIT_MS),
    {module, ?MODULE} = erpc:call(Node, code, ensure_loaded, [?MODULE], ?WAIT_MS),
    put({peer, Peer}, #{node => Node, names => [Name, ap_bench_util:node_name(RNode)],
                        os_pids => [OsPid, COsPid]}),
    Node.

mesh(Nodes) ->
    [case erpc:call(A, net_kernel, connect_node, [B], ?WAIT_MS) of
         true -> ok;
         R -> fail("~p could not connect to ~p: ~p", [A, B, R])
     end || A <- Nodes, B <- Nodes, A < B],
    ok.

%% The pool, the peers, the application; every name must leave epmd and
%% every OS process must go. ok, or failed (after saying why).
stop_pool() ->
    case erase(pool) of
        undefined -> ok;
        Pool ->
            case actor_pool:stop_pool(Pool) of
                ok ->
                    [] =:= actor_receptionist:lookup(actor_receptionist:service_key(?ID)) orelse
                        fail("the key still lists ~p after stop_pool",
                             [actor_receptionist:lookup(actor_receptionist:service_key(?ID))]),
                    ok;
                Err -> fail("actor_pool:stop_pool(~p): ~p", [Pool, Err])
            end
    end.

stop_peers() ->
    ap_bench_util:stop_peers(?WAIT_MS).

stop_app() ->
    ap_bench_util:stop_app(?WAIT_MS).

%% ===================================================================
%% Rounds
%% ===================================================================

%% NC callers on every node, N asks each to Target (the key or the pid),
%% starting together. #{rate, p50, p99} (latencies in ns).
ask_round(Nodes, Target, NC, N) ->
    StartAt = os:system_time(microsecond) + ?START_DELAY_US,
    Results = erpc:multicall(Nodes, ?MODULE, callers, [Target, ?PAYLOAD, NC, N, StartAt],
                             ?ROUND_MS + 5000),
    {Lats, Ends} =
        lists:foldl(
          fun({Node, {ok, {ok, L, TEnd}}}, {LAcc, EAcc}) when is_list(L) ->
                  length(L) =:= NC * N orelse
                      fail("~p: ~p latencies, expected ~p", [Node, length(L), NC * N]),
                  {[L | LAcc], [TEnd | EAcc]};
             ({Node, {ok, {error, Why}}}, _) ->
                  fail("the callers on ~p (asking ~0p): ~0p", [Node, Target, Why]);
             ({Node, Other}, _) ->
                  fail("the callers on ~p (asking ~0p): ~0p", [Node, Target, Other])
          end, {[], []}, lists:zip(Nodes, Results)),
    Sorted = lists:sort(lists:append(Lats)),
    Len = length(Sorted),
    #{rate => Len / ((lists:max(Ends) - StartAt) / 1.0e6),
      p50 => pct(Sorted, Len, 50), p99 => pct(Sorted, Len, 99)}.

%% On every node: NC callers, each N asks of Payload to Target, from
%% StartAt (os:system_time(microsecond), the host's clock). {ok, Latencies
%% (ns, all callers), the last caller's end}, or {error, Why}.
-spec callers(term(), binary(), pos_integer(), pos_integer(), integer()) ->
          {ok, [integer()], integer()} | {error, term()}.
callers(Target, Payload, NC, N, StartAt) ->
    Ms = [spawn_monitor(fun() -> caller(Target, Payload, N, StartAt) end)
          || _ <- lists:seq(1, NC)],
    Deadline = erlang:monotonic_time(millisecond) + ?ROUND_MS,
    collect(Ms, Deadline, [], 0).

caller(Target, Payload, N, StartAt) ->
    Wait = (StartAt - os:system_time(microsecond)) div 1000,
    receive after max(0, Wait) -> ok end,
    Lats = ask_loop(Target, Payload, N, []),
    exit({done, Lats, os:system_time(microsecond)}).

ask_loop(_Target, _Payload, 0, Acc) ->
    Acc;
ask_loop(Target, Payload, N, Acc) ->
    T0 = erlang:monotonic_time(nanosecond),
    case actor_pool:ask(Target, Payload) of
        {ok, Payload} -> ok;
        Other -> exit({bad_reply, Other})
    end,
    T = erlang:monotonic_time(nanosecond) - T0,
    ask_loop(Target, Payload, N - 1, [T | Acc]).

collect([], _Deadline, Lats, End) ->
    {ok, lists:append(Lats), End};
collect(Ms, Deadline, Lats, End) ->
    receive
        {'DOWN', Ref, process, Pid, {done, L, T}} ->
            collect(lists:delete({Pid, Ref}, Ms), Deadline, [L | Lats], max(End, T));
        {'DOWN', Ref, process, Pid, Why} ->
            Rest = lists:delete({Pid, Ref}, Ms),
            [exit(P, kill) || {P, _} <- Rest],
            {error, {caller_failed, Why}}
    after max(0, Deadline - erlang:monotonic_time(millisecond)) ->
            [exit(P, kill) || {P, _} <- Ms],
            {error, {callers_not_done, length(Ms), {waited_ms, ?ROUND_MS}}}
    end.

%% ns per actor_receptionist:lookup(Key), N in a tight loop.
lookup_ns(Key, N) ->
    T0 = erlang:monotonic_time(nanosecond),
    ok = lookup_loop(N, Key),
    (erlang:monotonic_time(nanosecond) - T0) / N.

lookup_loop(0, _Key) -> ok;
lookup_loop(N, Key) ->
    [_] = actor_receptionist:lookup(Key),
    lookup_loop(N - 1, Key).

%% N lone asks of each kind from this process, kinds in a fresh random
%% order each time; #{key => p50 us, pid => p50 us}.
lone(N, Key, Pool) ->
    P = ?PAYLOAD,
    Kinds = [{key, Key}, {pid, Pool}],
    Acc = lists:foldl(
            fun(_, A) ->
                    Shuffled = [KT || {_, KT} <- lists:sort([{rand:uniform(), KT} || KT <- Kinds])],
                    lists:foldl(
                      fun({K, T}, A1) ->
                              T0 = erlang:monotonic_time(nanosecond),
                              case actor_pool:ask(T, P) of
                                  {ok, P} -> ok;
                                  Other -> fail("lone ask of ~p: ~p", [T, Other])
                              end,
                              D = erlang:monotonic_time(nanosecond) - T0,
                              maps:update_with(K, fun(L) -> [D | L] end, [D], A1)
                      end, A, Shuffled)
            end, #{}, lists:seq(1, N)),
    maps:map(fun(_, L) -> S = lists:sort(L), pct(S, length(S), 50) / 1000 end, Acc).

pool_counters(Pool) ->
    case actor_pool:stats(Pool) of
        #{processed := _} = S -> maps:with([processed | ?LOSS_KEYS], S);
        Other -> fail("actor_pool:stats(~p): ~p", [Pool, Other])
    end.

%% Since Before the pool processed exactly Asked asks and lost nothing.
check_counters(Pool, Before, Asked) ->
    After = pool_counters(Pool),
    Bad = [{K, maps:get(K, After) - maps:get(K, Before)}
           || K <- ?LOSS_KEYS, maps:get(K, After) =/= maps:get(K, Before)],
    Bad =:= [] orelse fail("the pool reports ~p (stats: ~p)", [Bad, After]),
    Done = maps:get(processed, After) - maps:get(processed, Before),
    Done =:= Asked orelse
        fail("the pool processed ~p asks, the bench made ~p", [Done, Asked]),
    ok.

%% ===================================================================
%% Report
%% ===================================================================

%% Rows: {Label, Value, [{AnchorLabel, AnchorValue}], Target}. {Missed,
%% [met | missed | none], one per row}.
print(Rows) ->
    io:format("~-38s ~10s  ~-22s ~10s ~7s  ~s~n",
              ["measure", "actor_pool", "anchor", "anchor val", "ratio", "target"]),
    io:format("~s~n", [lists:duplicate(118, $-)]),
    lists:foldl(fun({Label, V, Anchors, Target}, {Missed, Vs}) ->
                        {Verdict, M} = verdict(V, Target),
                        case Anchors of
                            [] ->
                                io:format("~-38s ~10s  ~-22s ~10s ~7s  ~s~n",
                                          [Label, fmt(V), "", "", "", text(Verdict, Target)]);
                            [{AL, AV} | _] ->
                                io:format("~-38s ~10s  ~-22s ~10s ~7s  ~s~n",
                                          [Label, fmt(V), AL, fmt(AV), ratio(V, AV),
                                           text(Verdict, Target)])
                        end,
                        ap_bench_csv:row("keys", Label, V, Anchors, text(Verdict, Target), Verdict),
                        {Missed + M, Vs ++ [Verdict]}
                end, {0, []}, Rows).

verdict(_V, none) -> {none, 0};
verdict(V, {ge, Base, Factor, _}) -> met(V >= Base * Factor);
verdict(V, {le, Base, Factor, _}) -> met(V =< Base * Factor);
verdict(V, {lt, Base, Factor, _}) -> met(V < Base * Factor).

met(true) -> {met, 0};
met(false) -> {missed, 1}.

text(none, _) -> "";
text(met, {_, _, _, Text}) -> Text ++ " met";
text(missed, {_, _, _, Text}) -> Text ++ " MISSED".

%% Diff: key/pid - 1; the spreads: (max - min) / median of each kind's
%% rounds.
notes(Rows) ->
    [begin
         io:format("~s: key vs pid ~s% (medians); by adjacent pair of rounds, median ~s% "
                   "(~s% .. ~s%); round-to-round spread by pid ~s%, by key ~s%~n",
                   [What, signed(100 * Diff), signed(100 * median(Paired)),
                    signed(100 * lists:min(Paired)), signed(100 * lists:max(Paired)),
                    fmt(100 * SPid), fmt(100 * SKey)]),
         Verdict =:= missed andalso abs(Diff) =< max(SPid, SKey) andalso
             io:format("note: the ~s row is MISSED by less than its kinds' own rounds spread "
                       "(~s%): within host noise, not a measured lookup cost~n",
                       [What, fmt(100 * max(SPid, SKey))])
     end || {What, Diff, Paired, SPid, SKey, Verdict} <- Rows],
    ok.

signed(X) when X >= 0 -> "+" ++ fmt(X);
signed(X) -> "-" ++ fmt(-X).

ratio(_V, A) when A == 0 -> "-";
ratio(V, A) when V / A < 0.1 -> io_lib:format("~.4f", [V / A]);
ratio(V, A) -> io_lib:format("~.2f", [V / A]).

fmt(V) when V >= 100000 -> io_lib:format("~.1fK", [V / 1000]);
fmt(V) when V >= 1000 -> integer_to_list(round(V));
fmt(V) when V >= 0.1 -> io_lib:format("~.1f", [float(V)]);
fmt(V) -> io_lib:format("~.4f", [float(V)]).

%% ===================================================================
%% Helpers
%% ===================================================================

pct(Sorted, Len, P) ->
    lists:nth(max(1, ceil(Len * P / 100)), Sorted).

median(L) ->
    S = lists:sort(L),
    N = length(S),
    case N rem 2 of
        1 -> lists:nth((N + 1) div 2, S);
        0 -> (lists:nth(N div 2, S) + lists:nth(N div 2 + 1, S)) / 2
    end.

%% Rounds in the order run: [[First, Second], ...], one of each kind.
pairs([A, B | Rest]) -> [[A, B] | pairs(Rest)];
pairs(_) -> [].

pair_diff(F, [{K1, R1}, {_, R2}]) ->
    {KR, PR} = case K1 of
                   key -> {R1, R2};
                   pid -> {R2, R1}
               end,
    maps:get(F, KR) / maps:get(F, PR) - 1.

spread(L) ->
    (lists:max(L) - lists:min(L)) / median(L).

loadavg() ->
    case file:read_file("/proc/loadavg") of
        {ok, B} -> lists:join(" ", lists:sublist(string:lexemes(B, " "), 3));
        _ -> "?"
    end.

%% Poll F every 5 ms until it is true; fail naming What after Ms.
