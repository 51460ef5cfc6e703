%% Pools registered with the receptionist (`service_key' option) and called
%% by key (`actor_pool:tell/2', `ask/2,3' with a service key), on this node
%% and from another node of a cluster (real `peer' nodes, each with its own
%% pool node and receptionist).
-module(actor_pool_service_key_tests).

-import(ap_support, [wait_until/2, epmd_names/0]).

-include_lib("eunit/include/eunit.hrl").

-export([registered_pool_is_found_and_called_by_key/1,
         stop_pool_deregisters_and_calls_find_no_pool/1,
         calls_by_key_spread_over_the_pools/1,
         bad_service_key_is_badarg/1,
         a_pool_on_another_node_is_called_by_key_and_leaves_with_its_node/1,
         a_standalone_pool_node_registers_its_keyed_pools/1,
         a_hidden_node_uses_pools_and_the_receptionist/1,
         a_hidden_node_calling_a_pool_node_keeps_a_complete_view/1,
         three_peers_and_a_standalone_pool_node/1]).

-define(WAIT_MS, 20000).

service_key_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [registered_pool_is_found_and_called_by_key,
                          stop_pool_deregisters_and_calls_find_no_pool,
                          calls_by_key_spread_over_the_pools,
                          bad_service_key_is_badarg,
                          a_pool_on_another_node_is_called_by_key_and_leaves_with_its_node,
                          a_standalone_pool_node_registers_its_keyed_pools,
                          a_hidden_node_uses_pools_and_the_receptionist,
                          a_hidden_node_calling_a_pool_node_keeps_a_complete_view,
                          three_peers_and_a_standalone_pool_node]]
     end}.

setup() ->
    #{was_alive => ap_test_util:start_app()}.

cleanup(#{was_alive := WasAlive}) ->
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Cases
%% ===================================================================

registered_pool_is_found_and_called_by_key(_) ->
    K = actor_receptionist:service_key(<<"sk.echo">>),
    {ok, Pid} = actor_pool:start_pool(sk_echo, echo, #{workers => 2, service_key => K}),
    %% Recorded before start_pool returned.
    ?assertEqual([Pid], actor_receptionist:lookup(K)),
    ?assertEqual({ok, <<"hi">>}, actor_pool:ask(K, <<"hi">>)),
    ?assertEqual({ok, <<"x">>}, actor_pool:ask(K, <<"x">>, 1000)),
    ok = actor_pool:tell(K, <<"t">>),
    wait_until(fun() -> maps:get(processed, actor_pool:stats(Pid)) >= 3 end, ?WAIT_MS),
    %% An id works as the key too.
    ?assertEqual({ok, <<"y">>}, actor_pool:ask(actor_receptionist:service_key("sk.echo"), <<"y">>)),
    %% A key whose id is an atom or a string is the same key.
    ?assertEqual({ok, <<"z">>}, actor_pool:ask({service_key, 'sk.echo'}, <<"z">>)),
    ?assertEqual({ok, <<"w">>}, actor_pool:ask({service_key, "sk.echo"}, <<"w">>)),
    %% Nothing stray left in this process's mailbox by the registration.
    ?assertEqual({messages, []}, process_info(self(), messages)),
    ok = actor_pool:stop_pool(Pid).

stop_pool_deregisters_and_calls_find_no_pool(_) ->
    K = actor_receptionist:service_key(<<"sk.stop">>),
    {ok, Pid} = actor_pool:start_pool(sk_stop, echo, #{workers => 1, service_key => <<"sk.stop">>}),
    ?assertEqual([Pid], actor_receptionist:lookup(K)),
    %% By name: the registration goes with it, before stop_pool returns.
    ok = actor_pool:stop_pool(sk_stop),
    ?assertEqual([], actor_receptionist:lookup(K)),
    ?assertEqual({error, no_pool}, actor_pool:ask(K, <<"q">>)),
    Before = actor_pool:no_pool_tells(),
    ok = actor_pool:tell(K, <<"lost">>),
    ?assertEqual(Before + 1, actor_pool:no_pool_tells()).

calls_by_key_spread_over_the_pools(_) ->
    K = actor_receptionist:service_key(<<"sk.two">>),
    {ok, P1} = actor_pool:start_pool(sk_one, echo, #{workers => 1, service_key => K}),
    {ok, P2} = actor_pool:start_pool(sk_two, echo, #{workers => 1, service_key => K}),
    ?assertEqual(lists:sort([P1, P2]), lists:sort(actor_receptionist:lookup(K))),
    [{ok, I} = actor_pool:ask(K, I) || I <- lists:seq(1, 200)],
    N1 = maps:get(processed, actor_pool:stats(P1)),
    N2 = maps:get(processed, actor_pool:stats(P2)),
    ?assertEqual(200, N1 + N2),
    ?assert(N1 >= 50 andalso N2 >= 50),
    ok = actor_pool:stop_pool(P1),
    ?assertEqual([P2], actor_receptionist:lookup(K)),
    ?assertEqual({ok, 1}, actor_pool:ask(K, 1)),
    ok = actor_pool:stop_pool(P2).

bad_service_key_is_badarg(_) ->
    ?assertEqual({error, {badarg, {service_key, 42}}},
                 actor_pool:start_pool(sk_bad, echo, #{service_key => 42})),
    ?assertEqual({error, {badarg, {service_key, <<>>}}},
                 actor_pool:start_pool(sk_bad, echo, #{service_key => <<>>})),
    %% Nothing was started.
    ?assertNot(lists:keymember(sk_bad, 1, actor_pool:which_pools())).

%% A peer starts a pool on its own pool node under a key; this node finds it
%% by key and calls it; the peer's pool node dies and the key lists nothing
%% here, then a new pool comes back under the key.
a_pool_on_another_node_is_called_by_key_and_leaves_with_its_node(_) ->
    K = actor_receptionist:service_key(<<"sk.remote">>),
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE]]),
    {ok, Peer, PeerNode} =
        peer:start(#{name => peer:random_name(sk_peer), connection => standard_io,
                     args => ["-setcookie", atom_to_list(erlang:get_cookie()), "-pa" | Paths]}),
    Call = fun(M, F, A) -> peer:call(Peer, M, F, A, 30000) end,
    try
        ok = Call(application, load, [actor_pool]),
        ok = Call(application, set_env, [actor_pool, gossip_interval_ms, 200]),
        {ok, _} = Call(application, ensure_all_started, [actor_pool]),
        true = Call(net_kernel, connect_node, [node()]),
        wait_until(fun() -> maps:get(complete, actor_receptionist:status())
                                andalso lists:member(PeerNode, maps:get(members, actor_receptionist:status()))
                   end, ?WAIT_MS),
        PeerPN = Call(actor_pool, pool_node, []),
        {ok, Pid} = Call(actor_pool, start_pool, [sk_remote, echo, #{workers => 1, service_key => K}]),
        ?assertEqual(PeerPN, node(Pid)),
        wait_until(fun() -> actor_receptionist:lookup(K) =:= [Pid] end, ?WAIT_MS),
        ?assertEqual({ok, <<"r">>}, actor_pool:ask(K, <<"r">>)),
        %% Its pool node dies: the old pool's registration goes, here too,
        %% and the peer starts the pool again on the new incarnation, which
        %% registers it again: the key lists the new pid only.
        #{os_pid := OsPid} = Call(actor_cnode, info, [actor_pool_node_owner]),
        _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        wait_until(fun() ->
                           case actor_receptionist:lookup(K) of
                               [Pid2] -> Pid2 =/= Pid;
                               _ -> false
                           end
                   end, ?WAIT_MS),
        ?assertEqual({error, noproc}, actor_pool:ask(Pid, <<"r">>)),
        ?assertEqual({ok, <<"s">>}, actor_pool:ask(K, <<"s">>)),
        %% Stopped for good: the key lists nothing, and asks by key say so.
        ok = Call(actor_pool, stop_pool, [sk_remote]),
        wait_until(fun() -> actor_receptionist:lookup(K) =:= [] end, ?WAIT_MS),
        ?assertEqual({error, no_pool}, actor_pool:ask(K, <<"t">>))
    after
        catch Call(application, stop, [actor_pool]),
        catch peer:stop(Peer),
        [Alive | _] = string:split(atom_to_list(PeerNode), "@"),
        wait_until(fun() -> [N || N <- epmd_names(), lists:prefix(Alive, N)] =:= [] end, ?WAIT_MS)
    end.

%% `actor_pool_node --connect ThisNode --pool name:echo:1:key=Id' joins as a
%% hidden node and registers that pool with this node's receptionist; it
%% goes when the pool node goes, and comes back when it is run again.
a_standalone_pool_node_registers_its_keyed_pools(_) ->
    K = actor_receptionist:service_key(<<"sk:standalone">>),
    Dir = ap_test_util:temp_dir("actor_pool_service_key_tests"),
    CookieFile = filename:join(Dir, "cookie"),
    ok = file:write_file(CookieFile, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(CookieFile, 8#600),
    [Self, Host] = string:split(atom_to_list(node()), "@"),
    Alive = Self ++ "_sk_standalone",
    N = list_to_atom(Alive ++ "@" ++ Host),
    Exe = filename:join(code:priv_dir(actor_pool), "actor_pool_node"),
    Run = fun() ->
                  Port = open_port({spawn_executable, Exe},
                                   [{args, ["--name", atom_to_list(N), "--cookie-file", CookieFile,
                                            "--connect", atom_to_list(node()),
                                            "--pool", "skp:echo:1:key=sk:standalone"]},
                                    exit_status, binary, stderr_to_stdout, use_stdio]),
                  {os_pid, OsPid} = erlang:port_info(Port, os_pid),
                  {Port, OsPid}
          end,
    Stop = fun({Port, OsPid}) ->
                   %% Only while it runs: a pid number is reused once reaped.
                   _ = ap_support:os_pid_alive(OsPid) andalso
                       os:cmd("kill -9 " ++ integer_to_list(OsPid)),
                   wait_until(fun() -> not ap_support:os_pid_alive(OsPid) end, ?WAIT_MS),
                   catch port_close(Port),
                   wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS)
           end,
    First = Run(),
    try
        wait_until(fun() -> [node(P) || P <- actor_receptionist:lookup(K)] =:= [N] end, ?WAIT_MS),
        ?assertEqual({ok, <<"a">>}, actor_pool:ask(K, <<"a">>)),
        ?assertNot(lists:member(N, nodes())),
        %% A pool started from the command line is stamped with the time it
        %% started (it was once 0: the uptime read as the host's, and the
        %% rate over the last 10 s as messages since boot).
        #{uptime_ms := Up, throughput_10s := Tp} = actor_pool:stats({skp, N}),
        ?assert(Up < ?WAIT_MS * 2),
        ?assert(Tp > 0.1),
        %% Its connection drops (and the receptionist drops its pool): it
        %% connects again and registers again.
        true = erlang:disconnect_node(N),
        wait_until(fun() -> [node(P) || P <- actor_receptionist:lookup(K)] =:= [N]
                                andalso lists:member(N, nodes(hidden)) end, ?WAIT_MS),
        ?assertEqual({ok, <<"c">>}, actor_pool:ask(K, <<"c">>)),
        Stop(First),
        wait_until(fun() -> actor_receptionist:lookup(K) =:= [] end, ?WAIT_MS),
        ?assertEqual({error, no_pool}, actor_pool:ask(K, <<"a">>)),
        Second = Run(),
        try
            wait_until(fun() -> [node(P) || P <- actor_receptionist:lookup(K)] =:= [N] end, ?WAIT_MS),
            ?assertEqual({ok, <<"b">>}, actor_pool:ask(K, <<"b">>))
        after
            Stop(Second)
        end
    after
        catch Stop(First),
        _ = file:del_dir_r(Dir)
    end,
    wait_until(fun() -> actor_receptionist:lookup(K) =:= [] end, ?WAIT_MS).

%% An operator shell or an app started with -hidden, running the
%% application: it follows this node's receptionist, finds the pool by key
%% and calls it, subscribes, and registers a process of its own (made here).
a_hidden_node_uses_pools_and_the_receptionist(_) ->
    K = actor_receptionist:service_key(<<"sk.hidden">>),
    {ok, Pool} = actor_pool:start_pool(sk_hidden, echo, #{workers => 1, service_key => K}),
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE, ap_test_util]]),
    {ok, Peer, HNode} =
        peer:start(#{name => peer:random_name(sk_hidden), connection => standard_io,
                     args => ["-hidden", "-setcookie", atom_to_list(erlang:get_cookie()), "-pa" | Paths]}),
    Call = fun(M, F, A) -> peer:call(Peer, M, F, A, 30000) end,
    try
        ok = Call(application, load, [actor_pool]),
        ok = Call(application, set_env, [actor_pool, pool_node, false]),
        {ok, _} = Call(application, ensure_all_started, [actor_pool]),
        true = Call(net_kernel, connect_node, [node()]),
        ?assertNot(lists:member(HNode, nodes())),
        wait_until(fun() -> Call(actor_receptionist, lookup, [K]) =:= [Pool] end, ?WAIT_MS),
        ?assertEqual({ok, <<"from hidden">>}, Call(actor_pool, ask, [K, <<"from hidden">>])),
        ?assertEqual({ok, <<"by pid">>}, Call(actor_pool, ask, [Pool, <<"by pid">>])),
        %% This node does not count it as a member.
        ?assertNot(lists:member(HNode, maps:get(members, actor_receptionist:status()))),
        %% What it registers is made here, and goes with its connection.
        Mine = Call(erlang, spawn, [timer, sleep, [infinity]]),
        ok = Call(actor_receptionist, register, [K, Mine]),
        wait_until(fun() -> lists:sort(actor_receptionist:lookup(K)) =:= lists:sort([Pool, Mine]) end,
                   ?WAIT_MS),
        true = erlang:disconnect_node(HNode),
        wait_until(fun() -> actor_receptionist:lookup(K) =:= [Pool] end, ?WAIT_MS)
    after
        catch Call(application, stop, [actor_pool]),
        catch peer:stop(Peer),
        ok = actor_pool:stop_pool(Pool),
        [Alive | _] = string:split(atom_to_list(HNode), "@"),
        wait_until(fun() -> [N || N <- epmd_names(), lists:prefix(Alive, N)] =:= [] end, ?WAIT_MS)
    end.

%% A hidden node that calls a pool by pid connects to its pool node, a C
%% node, and probes it as it probes every node it connects to: a C node
%% cannot answer, so the view is incomplete until the probe is given up
%% (three rounds). After that it stays complete: the C node is not probed
%% again while connected (it was every fourteen rounds, each time making the
%% view incomplete for four). Rounds of 100 ms here; 40 of them watched.
a_hidden_node_calling_a_pool_node_keeps_a_complete_view(_) ->
    {ok, Pool} = actor_pool:start_pool(sk_hidden_complete, echo, #{workers => 1}),
    PoolNode = node(Pool),
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE, ap_test_util]]),
    {ok, Peer, HNode} =
        peer:start(#{name => peer:random_name(sk_hidden_complete), connection => standard_io,
                     args => ["-hidden", "-setcookie", atom_to_list(erlang:get_cookie()), "-pa" | Paths]}),
    Call = fun(M, F, A) -> peer:call(Peer, M, F, A, 30000) end,
    Complete = fun() -> maps:get(complete, Call(actor_receptionist, status, [])) end,
    try
        ok = Call(application, load, [actor_pool]),
        ok = Call(application, set_env, [actor_pool, pool_node, false]),
        ok = Call(application, set_env, [actor_pool, gossip_interval_ms, 100]),
        {ok, _} = Call(application, ensure_all_started, [actor_pool]),
        true = Call(net_kernel, connect_node, [node()]),
        wait_until(Complete, ?WAIT_MS),
        ?assertEqual({ok, <<"by pid">>}, Call(actor_pool, ask, [Pool, <<"by pid">>])),
        ?assert(lists:member(PoolNode, Call(erlang, nodes, [hidden]))),
        wait_until(Complete, ?WAIT_MS),
        Until = erlang:monotonic_time(millisecond) + 4000,
        Watch = fun W(Seen) ->
                        case erlang:monotonic_time(millisecond) < Until of
                            true ->
                                receive after 20 -> ok end,
                                W([Complete() | Seen]);
                            false ->
                                Seen
                        end
                end,
        Seen = Watch([]),
        ?assert(length(Seen) > 20),
        ?assertEqual([], [false || false <- Seen]),
        %% Still connected to it, still following this node.
        ?assert(lists:member(PoolNode, Call(erlang, nodes, [hidden]))),
        ?assertMatch(#{members := [_], syncing := []}, Call(actor_receptionist, status, []))
    after
        catch Call(application, stop, [actor_pool]),
        catch peer:stop(Peer),
        ok = actor_pool:stop_pool(Pool),
        [Alive | _] = string:split(atom_to_list(HNode), "@"),
        wait_until(fun() -> [N || N <- epmd_names(), lists:prefix(Alive, N)] =:= [] end, ?WAIT_MS)
    end.

%% Three peer nodes and a standalone pool node connected to one of them:
%% every peer discovers the pool by key (by subscription and by lookup) and
%% calls it by key; the pool node dies and every subscriber's listing
%% shrinks, asks by key say no_pool; it runs again and they grow back.
three_peers_and_a_standalone_pool_node(_) ->
    K = actor_receptionist:service_key(<<"sk.three">>),
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE, ap_test_util]]),
    Peers = [begin
                 %% Driven over standard_io, and only explicit connections, so
                 %% that this node stays out of their cluster.
                 {ok, P, N} = peer:start(#{name => peer:random_name(sk_three), connection => standard_io,
                                           args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                                                    "-connect_all", "false",
                                                    "-kernel", "prevent_overlapping_partitions", "false",
                                                    "-kernel", "logger_level", "warning", "-pa" | Paths]}),
                 put({sk_peer, N}, P),
                 ok = peer:call(P, application, load, [actor_pool]),
                 ok = peer:call(P, application, set_env, [actor_pool, pool_node, false]),
                 ok = peer:call(P, application, set_env, [actor_pool, gossip_interval_ms, 200]),
                 {ok, _} = peer:call(P, application, ensure_all_started, [actor_pool], 30000),
                 {P, N}
             end || _ <- [1, 2, 3]],
    Nodes = [N || {_, N} <- Peers],
    [N1 | _] = Nodes,
    Dir = ap_test_util:temp_dir("actor_pool_service_key_tests"),
    CookieFile = filename:join(Dir, "cookie"),
    ok = file:write_file(CookieFile, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(CookieFile, 8#600),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    PoolAlive = "sk_three_pool_" ++ os:getpid(),
    PN = list_to_atom(PoolAlive ++ "@" ++ Host),
    Exe = filename:join(code:priv_dir(actor_pool), "actor_pool_node"),
    Run = fun() ->
                  Port = open_port({spawn_executable, Exe},
                                   [{args, ["--name", atom_to_list(PN), "--cookie-file", CookieFile,
                                            "--connect", atom_to_list(N1),
                                            "--pool", "three:echo:1:key=sk.three"]},
                                    exit_status, binary, stderr_to_stdout, use_stdio]),
                  {os_pid, OsPid} = erlang:port_info(Port, os_pid),
                  {Port, OsPid}
          end,
    Kill = fun({Port, OsPid}) ->
                   _ = ap_support:os_pid_alive(OsPid) andalso os:cmd("kill -9 " ++ integer_to_list(OsPid)),
                   wait_until(fun() -> not ap_support:os_pid_alive(OsPid) end, ?WAIT_MS),
                   catch port_close(Port),
                   wait_until(fun() -> not lists:member(PoolAlive, epmd_names()) end, ?WAIT_MS)
           end,
    %% The number of pools in the last listing S got, none before the first.
    Listing = fun(N, S) ->
                      case [length(R) || {listing, K2, R} <- pcall(N, ap_test_util, collected, [S]), K2 =:= K] of
                          [] -> none;
                          Ls -> lists:last(Ls)
                      end
              end,
    put(sk_three_pool, none),
    try
        [true = pcall(A, net_kernel, connect_node, [B]) || A <- Nodes, B <- Nodes, A < B],
        [wait_until(fun() ->
                            case pcall(N, actor_receptionist, status, []) of
                                #{complete := true, members := M} -> lists:all(fun(X) -> lists:member(X, M) end, Nodes -- [N]);
                                _ -> false
                            end
                    end, ?WAIT_MS) || N <- Nodes],
        Subs = [{N, pcall(N, ap_test_util, spawn_collector, [])} || N <- Nodes],
        [ok = pcall(N, actor_receptionist, subscribe, [K, S]) || {N, S} <- Subs],
        put(sk_three_pool, Run()),
        %% Discovery from every node: the subscription, the lookup, a call.
        [wait_until(fun() -> Listing(N, S) =:= 1 end, ?WAIT_MS) || {N, S} <- Subs],
        [?assertMatch([P] when node(P) =:= PN, pcall(N, actor_receptionist, lookup, [K])) || N <- Nodes],
        [?assertEqual({ok, N}, pcall(N, actor_pool, ask, [K, N])) || N <- Nodes],
        [ok = pcall(N, actor_pool, tell, [K, <<"t">>]) || N <- Nodes],
        %% The pool node dies: every listing shrinks; asks by key say so.
        Kill(get(sk_three_pool)),
        [wait_until(fun() -> Listing(N, S) =:= 0 end, ?WAIT_MS) || {N, S} <- Subs],
        [?assertEqual({error, no_pool}, pcall(N, actor_pool, ask, [K, x])) || N <- Nodes],
        %% It runs again: they grow back, and calls by key work.
        put(sk_three_pool, Run()),
        [wait_until(fun() -> Listing(N, S) =:= 1 end, ?WAIT_MS) || {N, S} <- Subs],
        [?assertEqual({ok, back}, pcall(N, actor_pool, ask, [K, back])) || N <- Nodes]
    after
        catch Kill(get(sk_three_pool)),
        [begin catch pcall(N, application, stop, [actor_pool]), catch peer:stop(P) end || {P, N} <- Peers],
        _ = file:del_dir_r(Dir),
        Alives = [hd(string:split(atom_to_list(N), "@")) || N <- Nodes],
        wait_until(fun() -> [A || A <- epmd_names(), lists:any(fun(X) -> lists:prefix(X, A) end, Alives)] =:= [] end,
                   ?WAIT_MS)
    end.

pcall(Node, M, F, A) ->
    peer:call(get({sk_peer, Node}), M, F, A, 30000).
