%% Pools across BEAM nodes: real peer nodes (the `peer' module) that run the
%% actor_pool application, with and without a pool C node of their own.
%%
%% A pool node is an ordinary (hidden) node, so any BEAM with the cookie can
%% start pools on it (`node' option) and reach them as `{Name, PoolNode}' or
%% by pid; each BEAM batches its own traffic. Every peer and C node started
%% here is stopped, and its name leaves epmd.
-module(actor_pool_cluster_tests).

-import(ap_support, [wait_until/2, epmd_names/0]).

-include_lib("eunit/include/eunit.hrl").

-export([peer_without_a_pool_node_uses_this_nodes/1,
         pool_on_a_peers_pool_node_is_reached_from_here/1]).

-define(WAIT_MS, 15000).
-define(POLL_MS, 10).

actor_pool_cluster_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [peer_without_a_pool_node_uses_this_nodes,
                          pool_on_a_peers_pool_node_is_reached_from_here]]
     end}.

setup() ->
    WasAlive = ap_test_util:start_app(),
    #{pool_node => actor_pool:pool_node(), was_alive => WasAlive}.

cleanup(#{was_alive := WasAlive}) ->
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Cases
%% ===================================================================

peer_without_a_pool_node_uses_this_nodes(#{pool_node := PN}) ->
    with_peer(false, fun(Peer) ->
        Call = fun(F, A) -> peer:call(Peer, actor_pool, F, A, 30000) end,
        ?assertEqual(undefined, Call(pool_node, [])),
        ?assertEqual([], Call(which_pools, [])),
        ?assertEqual({error, noproc}, Call(start_pool, [cluster_nowhere, echo, #{}])),
        {ok, Pid} = Call(start_pool, [cluster_remote, echo, #{node => PN, workers => 2}]),
        ?assertEqual(PN, node(Pid)),
        ?assertEqual({ok, <<"a">>}, Call(ask, [Pid, <<"a">>])),
        ?assertEqual({ok, <<"b">>}, Call(ask, [{cluster_remote, PN}, <<"b">>])),
        %% A bare name means the peer's own pool node, which it has not.
        ?assertEqual({error, noproc}, Call(ask, [cluster_remote, <<"c">>])),
        %% This node sees the pool as one of its own node's.
        ?assertEqual({ok, <<"d">>}, actor_pool:ask(cluster_remote, <<"d">>)),
        ?assertMatch([{cluster_remote, Pid}], actor_pool:which_pools()),
        ?assertEqual(actor_pool:which_pools(), Call(which_pools, [PN])),
        %% A burst from the peer, through its own batchers.
        ok = peer:call(Peer, erlang, apply,
                       [fun() ->
                                [ok = actor_pool:tell(Pid, <<"t">>) || _ <- lists:seq(1, 20000)],
                                ok
                        end, []], 30000),
        S = wait_stats(Pid, fun(#{processed := N}) -> N >= 20003 end),
        ?assertMatch(#{processed := 20003, dropped_tells := 0}, S),
        ?assertEqual(ok, Call(stop_pool, [Pid])),
        ?assertEqual([], actor_pool:which_pools())
    end).

pool_on_a_peers_pool_node_is_reached_from_here(_Ctx) ->
    with_peer(true, fun(Peer) ->
        PeerPN = peer:call(Peer, actor_pool, pool_node, [], 30000),
        ?assert(is_atom(PeerPN) andalso PeerPN =/= undefined),
        {ok, Pid} = peer:call(Peer, actor_pool, start_pool, [on_peer, echo, #{workers => 2}], 30000),
        ?assertEqual(PeerPN, node(Pid)),
        ?assertEqual({ok, <<"x">>}, actor_pool:ask({on_peer, PeerPN}, <<"x">>)),
        ?assertEqual({ok, <<"y">>}, actor_pool:ask(Pid, <<"y">>)),
        ?assertMatch(#{name := on_peer, size := 2}, actor_pool:stats({on_peer, PeerPN})),
        %% And this node starts a pool there.
        {ok, Mine} = actor_pool:start_pool(from_here, echo, #{node => PeerPN, workers => 1}),
        ?assertEqual({ok, <<"z">>}, peer:call(Peer, actor_pool, ask, [from_here, <<"z">>], 30000)),
        ?assertEqual([on_peer, from_here],
                     [N || {N, _} <- actor_pool:which_pools(PeerPN)]),
        ?assertEqual(ok, actor_pool:stop_pool(Mine)),
        put(peer_pool_node, PeerPN)
    end),
    %% The peer stopped its application: its pool node left.
    PeerPN = get(peer_pool_node),
    [Alive, _] = string:split(atom_to_list(PeerPN), "@"),
    wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS),
    ?assertEqual({error, {nodedown, PeerPN}}, actor_pool:ask({on_peer, PeerPN}, <<"x">>)).

%% ===================================================================
%% Helpers
%% ===================================================================

%% A peer BEAM running actor_pool, with (`true') or without its own pool node.
with_peer(PoolNode, Fun) ->
    %% This module too: the peer runs a fun of it.
    Paths = lists:usort([filename:dirname(code:which(M)) || M <- [actor_pool, ?MODULE]]),
    {ok, Peer, PeerNode} =
        peer:start_link(#{name => peer:random_name(actor_pool_cluster),
                          connection => standard_io,
                          args => ["-setcookie", atom_to_list(erlang:get_cookie()),
                                   "-pa" | Paths]}),
    try
        ok = peer:call(Peer, application, load, [actor_pool]),
        ok = peer:call(Peer, application, set_env, [actor_pool, pool_node, PoolNode]),
        {ok, _} = peer:call(Peer, application, ensure_all_started, [actor_pool], 30000),
        ?assertEqual(PeerNode, peer:call(Peer, erlang, node, [])),
        Fun(Peer)
    after
        catch peer:call(Peer, application, stop, [actor_pool], 30000),
        peer:stop(Peer)
    end.

wait_stats(P, Pred) ->
    Stats = fun() -> actor_pool:stats(P) end,
    case ap_support:poll(Stats, fun(S) -> is_map(S) andalso Pred(S) end, ?WAIT_MS, ?POLL_MS) of
        {ok, S} -> S;
        {timeout, S} -> error({stats_condition_not_met, S})
    end.
