%% Stalled handshakes from many source addresses cannot keep a real node
%% out of the C nodes the application starts: the pool node and the
%% receptionist node.
%%
%% A flood holds stalled handshakes from each of 8 loopback source
%% addresses (127.0.0.2 to 127.0.0.9: any local user can bind them, no
%% cookie needed): half of them sent a well-formed name and wait (each takes
%% a handshake thread once it gets one, and holds it until the node drops
%% it), half sent nothing (each holds a pending slot). Each one the node
%% closes is opened again at once, or ?GAP_MS after that address's last
%% open: cheap enough for a 2-core machine. Meanwhile a peer BEAM holding
%% the cookie connects 5 times (a fresh handshake each: it disconnects in
%% between), and each connect must be up within a second.
%%
%% With 40 from each address (320, over the node's pending cap of 256) the
%% flood churns at the cap, over a thousand connections a second: the node
%% used to make room by dropping the oldest of all, soon the node's. With
%% 30 from each (240, under the cap) nothing churns, but the stalled names
%% queue for the handshake threads long before the node's.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the I/O backend of the C nodes.
%% The peer is stopped, every flood socket closed and the application
%% stopped (its C nodes with it) before the module ends.
-module(actor_cnode_handshake_flood_tests).

-import(ap_test_util, [name_packet/1]).
-import(ap_support, [wait_until/2]).

-include_lib("eunit/include/eunit.hrl").

-export([a_flood_churning_at_the_cap_does_not_keep_a_node_out_of_the_pool_node/1,
         a_flood_churning_at_the_cap_does_not_keep_a_node_out_of_the_receptionist_node/1,
         stalled_names_queued_for_threads_do_not_keep_a_node_out_of_the_pool_node/1,
         stalled_names_queued_for_threads_do_not_keep_a_node_out_of_the_receptionist_node/1]).

-define(SOURCES, [{127, 0, 0, I} || I <- lists:seq(2, 9)]).
%% The C nodes' defaults: pending handshakes, handshake threads.
-define(MAX_PENDING, 256).
-define(THREADS, 4).
-define(CONNECTS, 5).
-define(GAP_MS, 5).
%% Each connect of the peer is up within this (the BEAM's own setup time
%% is 7 s).
-define(CONNECT_MS, 1000).
-define(WAIT_MS, 20000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_cnode_handshake_flood_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [a_flood_churning_at_the_cap_does_not_keep_a_node_out_of_the_pool_node,
                          a_flood_churning_at_the_cap_does_not_keep_a_node_out_of_the_receptionist_node,
                          stalled_names_queued_for_threads_do_not_keep_a_node_out_of_the_pool_node,
                          stalled_names_queued_for_threads_do_not_keep_a_node_out_of_the_receptionist_node]]
     end}.

setup() ->
    WasAlive = ap_test_util:start_app(),
    {ok, Peer, _PeerNode} = peer:start(#{name => peer:random_name(ap_hsflood),
                                         connection => standard_io,
                                         args => ["-hidden", "-setcookie",
                                                  atom_to_list(erlang:get_cookie())]}),
    #{was_alive => WasAlive, peer => Peer}.

cleanup(#{was_alive := WasAlive, peer := Peer}) ->
    catch peer:stop(Peer),
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Cases
%% ===================================================================

a_flood_churning_at_the_cap_does_not_keep_a_node_out_of_the_pool_node(Ctx) ->
    flood_then_connect(actor_pool_node_owner, 40, Ctx).

a_flood_churning_at_the_cap_does_not_keep_a_node_out_of_the_receptionist_node(Ctx) ->
    flood_then_connect(actor_receptionist_owner, 40, Ctx).

stalled_names_queued_for_threads_do_not_keep_a_node_out_of_the_pool_node(Ctx) ->
    flood_then_connect(actor_pool_node_owner, 30, Ctx).

stalled_names_queued_for_threads_do_not_keep_a_node_out_of_the_receptionist_node(Ctx) ->
    flood_then_connect(actor_receptionist_owner, 30, Ctx).

flood_then_connect(Owner, PerSource, #{peer := Peer}) ->
    #{node := N, port := Port} = actor_cnode:info(Owner),
    Flooders = [flooder(Port, Ip, PerSource) || Ip <- ?SOURCES],
    try
        [receive {flooding, F} -> ok after ?WAIT_MS -> error(no_flood) end || F <- Flooders],
        %% The flood has hold of the node once it closed the flood's
        %% excess over the pending cap (the node is at the cap), and
        %% evicted stalled names from every thread twice (names queue for
        %% the threads).
        Excess = length(?SOURCES) * PerSource - ?MAX_PENDING,
        wait_until(fun() -> closed_by_node(Flooders) >= max(Excess, 2 * ?THREADS) end, ?WAIT_MS),
        Closed0 = closed_by_node(Flooders),
        Connects = [real_connect(Peer, N) || _ <- lists:seq(1, ?CONNECTS)],
        %% Every connect, numbered, that failed or took a second or more.
        ?assertEqual([], [{I, R, Ms} || {I, {R, Ms}} <- lists:enumerate(Connects),
                                        R =/= pong orelse Ms >= ?CONNECT_MS]),
        %% The flood went on all along: the node kept closing its
        %% connections, and they kept coming back.
        ?assert(closed_by_node(Flooders) > Closed0)
    after
        [stop_flooder(F) || F <- Flooders]
    end.

%% The peer connects to N (a fresh handshake: net_adm:ping/1 sets up the
%% connection and the C node answers its net_kernel call), then cuts the
%% connection again. {pong | pang, how long the ping took in ms}.
real_connect(Peer, N) ->
    false = lists:member(N, peer:call(Peer, erlang, nodes, [hidden])),
    {Us, R} = peer:call(Peer, timer, tc, [net_adm, ping, [N]], ?WAIT_MS),
    _ = peer:call(Peer, erlang, disconnect_node, [N]),
    wait_until(fun() -> not lists:member(N, peer:call(Peer, erlang, nodes, [hidden])) end, ?WAIT_MS),
    {R, Us div 1000}.

%% ===================================================================
%% The flood
%% ===================================================================

%% A process holding Count stalled handshakes from Ip to Port (odd
%% ones sent a name, even ones nothing), opening one again as soon as the
%% node closes one, ?GAP_MS after the last open at the soonest. It says
%% {flooding, Pid} once all are open.
flooder(Port, Ip, Count) ->
    Parent = self(),
    spawn_link(fun() ->
                       Socks = [S || I <- lists:seq(1, Count), {ok, S} <- [open(Port, Ip, I)]],
                       Parent ! {flooding, self()},
                       flood_loop(#{port => Port, ip => Ip, count => Count, socks => Socks,
                                    next => Count + 1, closed => 0, last => now_ms(),
                                    timer => false})
               end).

flood_loop(#{socks := Socks, closed := Closed} = St) ->
    receive
        {tcp, _S, _Challenge} ->
            flood_loop(St);
        {tcp_closed, S} ->
            flood_loop(reopen(St#{socks := lists:delete(S, Socks), closed := Closed + 1}));
        {tcp_error, S, _} ->
            gen_tcp:close(S),
            flood_loop(reopen(St#{socks := lists:delete(S, Socks), closed := Closed + 1}));
        reopen ->
            flood_loop(reopen(St#{timer := false}));
        {closed, From} ->
            From ! {closed, self(), Closed},
            flood_loop(St);
        {stop, From} ->
            [gen_tcp:close(S) || S <- Socks],
            From ! {stopped, self()}
    end.

%% Open one more, up to the count, now or (a timer) once ?GAP_MS have
%% passed since the last open; a connect that fails is tried again then.
reopen(#{socks := Socks, count := Count} = St) when length(Socks) >= Count ->
    St;
reopen(#{timer := true} = St) ->
    St;
reopen(#{port := Port, ip := Ip, socks := Socks, next := Next, last := Last} = St) ->
    Now = now_ms(),
    case Now - Last >= ?GAP_MS of
        false ->
            erlang:send_after(Last + ?GAP_MS - Now, self(), reopen),
            St#{timer := true};
        true ->
            case open(Port, Ip, Next) of
                {ok, S} ->
                    reopen(St#{socks := [S | Socks], next := Next + 1, last := Now});
                {error, _} ->
                    erlang:send_after(?GAP_MS, self(), reopen),
                    St#{timer := true, last := Now}
            end
    end.

now_ms() ->
    erlang:monotonic_time(millisecond).

open(Port, Ip, I) ->
    case gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, true}, {ip, Ip}], ?CONNECT_MS) of
        {ok, S} when I rem 2 =:= 1 ->
            _ = gen_tcp:send(S, name_packet("hsflood" ++ integer_to_list(I))),
            {ok, S};
        Other ->
            Other
    end.

%% How many of the flood's connections the node has closed so far.
closed_by_node(Flooders) ->
    lists:sum([begin
                   F ! {closed, self()},
                   receive {closed, F, C} -> C after ?WAIT_MS -> error(flooder_silent) end
               end || F <- Flooders]).

stop_flooder(Pid) ->
    unlink(Pid),
    Pid ! {stop, self()},
    receive {stopped, Pid} -> ok
    after ?WAIT_MS -> exit(Pid, kill)
    end.
