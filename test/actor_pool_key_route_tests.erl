%% Calls by service key across pool nodes (actor_pool_route): three
%% standalone pool nodes (real `actor_pool_node' processes, connected to
%% this node) serve one key. A frozen node (SIGSTOP) stops taking asks and
%% takes them again once it runs (SIGCONT); a slow node gets fewer asks;
%% an ask answered `overloaded' goes on to another pool and runs once;
%% only idempotent asks go on after a pool that is gone; what this node
%% knows of each pool shows in key_stats/1 and the metrics.
-module(actor_pool_key_route_tests).

-import(ap_support, [wait_until/2, epmd_names/0, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

-export([a_frozen_node_stops_taking_asks_and_takes_them_again/1,
         a_slow_node_gets_fewer_asks/1,
         overloaded_goes_on_to_another_pool_and_runs_once/1,
         only_idempotent_asks_go_on_after_a_pool_that_is_gone/1,
         ask_options_are_checked/1,
         key_stats_and_metrics_show_each_pool/1]).

-define(WAIT_MS, 20000).

key_route_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 180, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [a_frozen_node_stops_taking_asks_and_takes_them_again,
                          a_slow_node_gets_fewer_asks,
                          overloaded_goes_on_to_another_pool_and_runs_once,
                          only_idempotent_asks_go_on_after_a_pool_that_is_gone,
                          ask_options_are_checked,
                          key_stats_and_metrics_show_each_pool]]
     end}.

setup() ->
    #{was_alive => ap_test_util:start_app()}.

cleanup(#{was_alive := WasAlive}) ->
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Cases
%% ===================================================================

%% One of three pool nodes is frozen (SIGSTOP: a long GC pause, a
%% throttled VM). Callers asking by key with a short timeout keep being
%% answered by the other two: only the asks that went to the frozen node
%% before it was found out, and the single probes let through to it, time
%% out, and none waits much past its timeout. Once it runs again it takes
%% asks.
a_frozen_node_stops_taking_asks_and_takes_them_again(_) ->
    Id = <<"kr.freeze">>,
    K = actor_receptionist:service_key(Id),
    with_nodes("krf", ["--pool", "fr:echo:2:key=" ++ binary_to_list(Id)], fun(Nodes) ->
        %% Frozen before it answered any ask here: nothing is known of it,
        %% so it is as likely a choice as the others at first. (Its stats
        %% go by ring: the lane to its pool node is set up before.)
        Pools = wait_listed(K, 3),
        [_ = processed(P) || P <- Pools],
        [{_, FrozenOs} | _] = Nodes,
        [Frozen] = [P || P <- Pools, node(P) =:= element(1, hd(Nodes))],
        Others = Pools -- [Frozen],
        Before = [processed(P) || P <- Others],
        signal(FrozenOs, "STOP"),
        Timeout = 400,
        %% 4 callers, 150 asks each; a caller gives up after 10 timeouts
        %% (random choice meets the frozen node every third ask).
        Results = run_callers(4, fun(_) -> asks(K, 150, Timeout, 10) end),
        Oks = length([ok || {{ok, _}, _} <- Results]),
        TimedOut = length([t || {{error, timeout}, _} <- Results]),
        Longest = lists:max([Ms || {_, Ms} <- Results]),
        ?assertEqual([], [R || {R, _} <- Results, R =/= {error, timeout}, element(1, R) =/= ok]),
        ?assert(TimedOut =< 12, {timeouts, TimedOut, of_asks, length(Results)}),
        ?assertEqual(4 * 150, Oks + TimedOut),
        ?assert(Longest < Timeout + 1000, {longest_ask_ms, Longest}),
        %% Every ask answered ok ran on one of the other two.
        ?assertEqual(Oks, lists:sum([processed(P) || P <- Others]) - lists:sum(Before)),
        #{asks := AsksFrozen} = stats_of(Frozen, actor_pool:key_stats(K)),
        signal(FrozenOs, "CONT"),
        %% It runs again: asks by key reach it, and it answers them.
        Processed0 = processed(Frozen),
        wait_until(fun() ->
                           [{ok, I} = actor_pool:ask(K, I, 2000) || I <- lists:seq(1, 20)],
                           #{asks := A} = stats_of(Frozen, actor_pool:key_stats(K)),
                           A > AsksFrozen andalso processed(Frozen) > Processed0
                   end, ?WAIT_MS),
        ?assertMatch(#{set_asides := S, timeouts := T} when S >= 1 andalso T >= 1,
                     stats_of(Frozen, actor_pool:key_stats(K)))
    end).

%% One pool node of three is ten times slower (its handler waits 20 ms
%% before each message, the others 2 ms): asks by key from 6 callers
%% mostly go to the other two.
a_slow_node_gets_fewer_asks(_) ->
    K = actor_receptionist:service_key(<<"kr.slow">>),
    {plugin, Crash} = ap_test_util:crash_plugin(),
    with_nodes("krs", [], fun([{Slow, _}, {F1, _}, {F2, _}]) ->
        Start = fun(Node, Us) ->
                        {ok, P} = actor_pool:start_pool(kr_slow, {plugin, Crash, {delay_us, Us}},
                                                        #{node => Node, workers => 2,
                                                          service_key => K}),
                        P
                end,
        SlowPool = Start(Slow, 20000),
        Fast = [Start(N, 2000) || N <- [F1, F2]],
        wait_listed(K, 3),
        Results = run_callers(6, fun(_) -> asks(K, 40, 5000, 1) end),
        ?assertEqual([], [R || {R, _} <- Results, element(1, R) =/= ok]),
        NSlow = processed(SlowPool),
        NFast = [processed(P) || P <- Fast],
        ?assertEqual(6 * 40, NSlow + lists:sum(NFast)),
        %% At random each would get a third.
        ?assert(2 * NSlow < lists:min(NFast), {slow, NSlow, fast, NFast})
    end).

%% One pool's worker is busy and its mailbox full: an ask by key that
%% lands there is answered overloaded, was not run, and goes on to another
%% pool under the key. Every ask is answered ok, and each ran exactly once
%% (the pools' processed counts add up to the asks).
overloaded_goes_on_to_another_pool_and_runs_once(_) ->
    K = actor_receptionist:service_key(<<"kr.full">>),
    {plugin, Crash} = ap_test_util:crash_plugin(),
    with_nodes("kro", [], fun([{NFull, _}, {N2, _}, {N3, _}]) ->
        {ok, Full} = actor_pool:start_pool(kr_full, {plugin, Crash},
                                           #{node => NFull, workers => 1, mailbox_limit => 1,
                                             service_key => K}),
        Free = [begin
                    {ok, P} = actor_pool:start_pool(kr_full, {plugin, Crash},
                                                    #{node => N, workers => 1, service_key => K}),
                    P
                end || N <- [N2, N3]],
        wait_listed(K, 3),
        %% By pid, not by key: one message runs (sleeping), one waits.
        ok = actor_pool:tell(Full, {sleep, 60000}),
        ok = actor_pool:tell(Full, {sleep, 60000}),
        wait_until(fun() ->
                           #{workers := [#{mailbox := M}]} = actor_pool:stats(Full),
                           M =:= 1
                   end, ?WAIT_MS),
        ?assertEqual({error, overloaded}, actor_pool:ask(Full, <<"by pid">>, 2000)),
        FullBefore = processed(Full),
        FreeBefore = [processed(P) || P <- Free],
        Replies = [actor_pool:ask(K, <<"k", I>>, 5000) || I <- lists:seq(1, 40)],
        ?assertEqual([{ok, <<"k", I>>} || I <- lists:seq(1, 40)], Replies),
        ?assertEqual(FullBefore, processed(Full)),
        ?assertEqual(40, lists:sum([processed(P) || P <- Free]) - lists:sum(FreeBefore)),
        #{spills := Spills} = stats_of(Full, actor_pool:key_stats(K)),
        ?assert(Spills >= 1),
        %% With one pool left under the key, overloaded is the answer.
        [ok = actor_pool:stop_pool(P) || P <- Free],
        ?assertEqual([Full], actor_receptionist:lookup(K)),
        ?assertEqual({error, overloaded}, actor_pool:ask(K, <<"last">>, 2000))
    end).

%% A pool listed under the key that is no more (stopped on its pool node,
%% still registered by it) answers noproc: the caller gets that answer,
%% unless it said the work is idempotent; then the ask goes on to another
%% pool under the key.
only_idempotent_asks_go_on_after_a_pool_that_is_gone(_) ->
    Id = <<"kr.gone">>,
    K = actor_receptionist:service_key(Id),
    with_nodes("krg", ["--pool", "gone:echo:1:key=" ++ binary_to_list(Id)],
               fun([{NGone, _} | _]) ->
        wait_listed(K, 3),
        ok = actor_pool:stop_pool({gone, NGone}),
        %% The pool node registered it itself: it stays listed.
        ?assertEqual(3, length(actor_receptionist:lookup(K))),
        Plain = [actor_pool:ask(K, I, 2000) || I <- lists:seq(1, 60)],
        ?assert(lists:member({error, noproc}, Plain)),
        ?assertEqual([], [R || R <- Plain, R =/= {error, noproc}, element(1, R) =/= ok]),
        Idem = [actor_pool:ask(K, I, 2000, #{idempotent => true}) || I <- lists:seq(1, 60)],
        ?assertEqual([{ok, I} || I <- lists:seq(1, 60)], Idem)
    end).

ask_options_are_checked(_) ->
    ap_test_util:with_pool(kr_opts, echo, #{workers => 1}, fun(Pool) ->
        ?assertEqual({ok, <<"a">>}, actor_pool:ask(Pool, <<"a">>, 1000, #{})),
        ?assertEqual({ok, <<"b">>}, actor_pool:ask(Pool, <<"b">>, 1000, #{idempotent => true})),
        ?assertEqual({ok, <<"c">>}, actor_pool:ask(Pool, <<"c">>, 1000, #{idempotent => false})),
        Done = processed(Pool),
        ?assertEqual({error, {badarg, {idempotent, yes}}},
                     actor_pool:ask(Pool, <<"d">>, 1000, #{idempotent => yes})),
        ?assertEqual({error, {badarg, {retries, 3}}}, actor_pool:ask(Pool, <<"d">>, 1000, #{retries => 3})),
        ?assertEqual({error, {badarg, {opts, [idempotent]}}},
                     actor_pool:ask(Pool, <<"d">>, 1000, [idempotent])),
        ?assertError(badarg, actor_pool:ask(Pool, <<"d">>, -1, #{})),
        %% Nothing was sent.
        ?assertEqual(Done, processed(Pool))
    end).

%% key_stats/1 and the metrics show, per pool under the key, what this
%% node sent it by key; the metrics pass promtool.
key_stats_and_metrics_show_each_pool(_) ->
    Id = <<"kr.stats">>,
    K = actor_receptionist:service_key(Id),
    with_nodes("krm", ["--pool", "st:echo:2:key=" ++ binary_to_list(Id)], fun(Nodes) ->
        Pools = wait_listed(K, 3),
        [{ok, I} = actor_pool:ask(K, I) || I <- lists:seq(1, 90)],
        [ok = actor_pool:tell(K, I) || I <- lists:seq(1, 30)],
        wait_until(fun() -> lists:sum([processed(P) || P <- Pools]) =:= 120 end, ?WAIT_MS),
        Stats = actor_pool:key_stats(Id),
        ?assertEqual(lists:sort(Pools), lists:sort([P || #{pool := P} <- Stats])),
        ?assertEqual(90, lists:sum([A || #{asks := A} <- Stats])),
        ?assertEqual(30, lists:sum([T || #{tells := T} <- Stats])),
        ?assertEqual(lists:sort([N || {N, _} <- Nodes]), lists:sort([N || #{node := N} <- Stats])),
        [?assertMatch(#{in_flight := 0, timeouts := 0, set_asides := 0, spills := 0,
                        set_aside := false, local := true}, S) || S <- Stats],
        %% The names come from the pool nodes, a moment after the first call.
        wait_until(fun() -> [st, st, st] =:= [N || #{name := N} <- actor_pool:key_stats(K)] end,
                   ?WAIT_MS),
        Text = iolist_to_binary(actor_pool_metrics:render()),
        ?assertEqual({0, ""}, ap_test_util:promtool_check(Text)),
        [?assertEqual(integer_to_binary(A),
                      sample(Text, <<"actor_pool_key_asks_total">>, Id, N))
         || #{node := N, asks := A} <- Stats],
        [?assertEqual(integer_to_binary(T),
                      sample(Text, <<"actor_pool_key_tells_total">>, Id, N))
         || #{node := N, tells := T} <- Stats],
        [?assertMatch({match, _}, re:run(Text, "^# TYPE " ++ F ++ " ", [multiline]), F)
         || F <- ["actor_pool_key_asks_in_flight", "actor_pool_key_asks_total",
                  "actor_pool_key_tells_total", "actor_pool_key_timeouts_total",
                  "actor_pool_key_set_asides_total", "actor_pool_key_set_aside",
                  "actor_pool_key_spills_total"]],
        ?assertError(badarg, actor_pool:key_stats(42))
    end).

%% ===================================================================
%% Helpers
%% ===================================================================

%% Three standalone pool nodes (`actor_pool_node --connect ThisNode' and
%% Args), Fun([{Node, OsPid}]) once each is connected; then each is let
%% run (SIGCONT, if a case froze it), killed by pid, and gone from epmd.
with_nodes(Tag, Args, Fun) ->
    Dir = ap_test_util:temp_dir("actor_pool_key_route_tests"),
    CookieFile = filename:join(Dir, "cookie"),
    ok = file:write_file(CookieFile, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(CookieFile, 8#600),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Exe = case os:getenv("ACTOR_POOL_NODE_EXE") of
              E when is_list(E), E =/= "" -> E;
              _ -> filename:join(ap_test_util:priv_dir(), "actor_pool_node")
          end,
    Started = lists:foldl(
                fun(I, Acc) ->
                        Alive = ap_test_util:alive(Tag ++ integer_to_list(I)),
                        N = list_to_atom(Alive ++ "@" ++ Host),
                        Port = open_port({spawn_executable, Exe},
                                         [{args, ["--name", atom_to_list(N),
                                                  "--cookie-file", CookieFile,
                                                  "--connect", atom_to_list(node()) | Args]},
                                          exit_status, binary, stderr_to_stdout, use_stdio]),
                        {os_pid, OsPid} = erlang:port_info(Port, os_pid),
                        put({krt_node, N}, {Port, OsPid, Alive}),
                        Acc ++ [{N, OsPid}]
                end, [], [1, 2, 3]),
    try
        [wait_until(fun() -> lists:member(N, nodes(hidden)) end, ?WAIT_MS) || {N, _} <- Started],
        Fun(Started)
    after
        [stop_node(N) || {N, _} <- Started],
        _ = file:del_dir_r(Dir)
    end.

stop_node(N) ->
    {Port, OsPid, Alive} = erase({krt_node, N}),
    %% Only while it runs: a pid number is reused once reaped.
    _ = os_pid_alive(OsPid) andalso signal(OsPid, "CONT"),
    _ = os_pid_alive(OsPid) andalso signal(OsPid, "KILL"),
    wait_until(fun() -> not os_pid_alive(OsPid) end, ?WAIT_MS),
    catch port_close(Port),
    flush_port(Port),
    wait_until(fun() -> not lists:member(N, nodes(hidden)) end, ?WAIT_MS),
    wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS).

flush_port(Port) ->
    receive {Port, _} -> flush_port(Port)
    after 0 -> ok
    end.

signal(OsPid, Sig) ->
    [] = os:cmd("kill -" ++ Sig ++ " " ++ integer_to_list(OsPid)),
    ok.

%% The N pools listed under K, once they are.
wait_listed(K, N) ->
    wait_until(fun() -> length(actor_receptionist:lookup(K)) =:= N end, ?WAIT_MS),
    actor_receptionist:lookup(K).

processed(Pool) ->
    #{processed := P} = actor_pool:stats(Pool),
    P.

stats_of(Pool, Stats) ->
    [S] = [S || #{pool := P} = S <- Stats, P =:= Pool],
    S.

%% NC processes running F(I) at once; their results, appended.
run_callers(NC, F) ->
    Self = self(),
    Pids = [spawn_link(fun() -> Self ! {self(), F(I)} end) || I <- lists:seq(1, NC)],
    lists:append([receive {P, R} -> R end || P <- Pids]).

%% N asks by key, each with Timeout: [{Reply, Ms}], cut short after
%% MaxTimeouts timeouts.
asks(K, N, Timeout, MaxTimeouts) ->
    asks(K, N, Timeout, MaxTimeouts, 0, []).

asks(_K, 0, _Timeout, _Max, _T, Acc) ->
    lists:reverse(Acc);
asks(_K, _N, _Timeout, Max, T, Acc) when T > Max ->
    lists:reverse(Acc);
asks(K, N, Timeout, Max, T, Acc) ->
    T0 = erlang:monotonic_time(millisecond),
    R = actor_pool:ask(K, N, Timeout),
    Ms = erlang:monotonic_time(millisecond) - T0,
    T1 = case R of
             {error, timeout} -> T + 1;
             _ -> T
         end,
    asks(K, N - 1, Timeout, Max, T1, [{R, Ms} | Acc]).

%% The value of Family's sample for key Id on pool node N.
sample(Text, Family, Id, N) ->
    Prefix = <<Family/binary, "{key=\"", Id/binary, "\",">>,
    NodeL = <<"node=\"", (atom_to_binary(N))/binary, "\"}">>,
    [V] = [V || Line <- binary:split(Text, <<"\n">>, [global]),
                binary:match(Line, Prefix) =:= {0, byte_size(Prefix)},
                binary:match(Line, NodeL) =/= nomatch,
                [_, V] <- [binary:split(Line, <<"} ">>)]],
    V.

