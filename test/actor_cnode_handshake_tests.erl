%% Incoming handshakes of a real C node (the pool node, priv/actor_pool_node
%% or ACTOR_POOL_NODE_EXE) cannot be starved by peers that hold no cookie,
%% and the node listens only where it is told.
%%
%% Each case starts its own C node through actor_cnode (so it connects to
%% this node first), cuts that connection, lets hostile clients at the
%% node's distribution port, and then has this node connect again: the
%% connection must be up and answering in under a second. Clients are plain
%% gen_tcp sockets from 127.0.0.1, like this node. Every case closes its
%% sockets and stops its C node, so no OS process or epmd name stays.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the I/O backend of the C nodes.
-module(actor_cnode_handshake_tests).

-import(ap_test_util, [alive/1, name_packet/1]).
-import(ap_support, [wait_until/2, epmd_names/0, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

-export([three_idle_connections_do_not_keep_a_node_out/1,
         fifty_idle_connections_do_not_keep_a_node_out/1,
         two_thousand_idle_connections_do_not_keep_a_node_out/1,
         oversized_name_packet_sent_slowly_is_refused_at_once/1,
         slow_name_packet_is_dropped_at_the_handshake_deadline/1,
         stalled_handshakes_after_their_name_make_room_for_a_node/1,
         name_flood_from_one_address_does_not_keep_a_node_out/1,
         listen_ip_binds_only_that_address/1,
         default_listen_ip_follows_the_beams_distribution_interface/1,
         ipv6_distribution_interface_falls_back_to_any_once_logged/1,
         bad_handshake_options_are_badarg/1,
         standalone_node_refuses_bad_listen_and_limits/1,
         port_config_listen_with_a_nul_is_refused/1]).

%% logger handler callback (the IPv6 fallback case).
-export([log/2]).

%% A connection that got in works within this; the BEAM's own setup time
%% is 7 s, the C node's handshake deadline 5 s by default.
-define(CONNECT_MS, 1000).
-define(WAIT_MS, 10000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_cnode_handshake_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 three_idle_connections_do_not_keep_a_node_out,
                 fifty_idle_connections_do_not_keep_a_node_out,
                 two_thousand_idle_connections_do_not_keep_a_node_out,
                 oversized_name_packet_sent_slowly_is_refused_at_once,
                 slow_name_packet_is_dropped_at_the_handshake_deadline,
                 stalled_handshakes_after_their_name_make_room_for_a_node,
                 name_flood_from_one_address_does_not_keep_a_node_out,
                 listen_ip_binds_only_that_address,
                 default_listen_ip_follows_the_beams_distribution_interface,
                 ipv6_distribution_interface_falls_back_to_any_once_logged,
                 bad_handshake_options_are_badarg,
                 standalone_node_refuses_bad_listen_and_limits,
                 port_config_listen_with_a_nul_is_refused]]
     end}.

case_(Name, Ctx) ->
    {atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}.

setup() ->
    WasAlive = is_alive(),
    ok = actor_dist:ensure_distributed(),
    #{was_alive => WasAlive}.

cleanup(#{was_alive := true}) ->
    ok;
cleanup(#{was_alive := false}) ->
    ok = net_kernel:stop().

%% ===================================================================
%% Idle and slow clients
%% ===================================================================

three_idle_connections_do_not_keep_a_node_out(_Ctx) ->
    idle_clients_then_connect(3, "idle3").

fifty_idle_connections_do_not_keep_a_node_out(_Ctx) ->
    idle_clients_then_connect(50, "idle50").

%% More than the pending caps (256 overall, 64 per address): the node drops
%% the oldest to make room, down to the last newcomer.
two_thousand_idle_connections_do_not_keep_a_node_out(_Ctx) ->
    %% The test node holds the sockets too; say so plainly if it cannot.
    Limit = list_to_integer(string:trim(os:cmd("ulimit -n"))),
    ?assert(Limit > 2100),
    idle_clients_then_connect(2000, "idle2000").

idle_clients_then_connect(Count, Tag) ->
    with_node(Tag, #{}, fun(N, Port) ->
        Socks = [idle_client(Port) || _ <- lists:seq(1, Count)],
        try
            connects_fast(N)
        after
            [gen_tcp:close(S) || S <- Socks]
        end
    end).

%% A name packet announcing 65535 bytes, then one byte a second: refused as
%% soon as its length is seen, and nobody waits for it meanwhile.
oversized_name_packet_sent_slowly_is_refused_at_once(_Ctx) ->
    with_node("oversized", #{}, fun(N, Port) ->
        {ok, S} = gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, false}]),
        ok = gen_tcp:send(S, <<65535:16>>),
        Trickler = trickle(S, 1000),
        try
            connects_fast(N),
            ?assertEqual({error, closed}, gen_tcp:recv(S, 0, ?WAIT_MS))
        after
            stop_trickle(Trickler),
            gen_tcp:close(S)
        end
    end).

%% A plausible name packet trickling in keeps nothing busy and is dropped
%% at the handshake deadline, not per read.
slow_name_packet_is_dropped_at_the_handshake_deadline(_Ctx) ->
    TimeoutMs = 1500,
    with_node("slowname", #{handshake_timeout_ms => TimeoutMs}, fun(N, Port) ->
        {ok, S} = gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, false}]),
        T0 = erlang:monotonic_time(millisecond),
        ok = gen_tcp:send(S, <<200:16, $N>>),
        Trickler = trickle(S, 100),
        try
            connects_fast(N),
            ?assertEqual({error, closed}, gen_tcp:recv(S, 0, ?WAIT_MS)),
            Took = erlang:monotonic_time(millisecond) - T0,
            ?assert(Took >= TimeoutMs - 100),
            ?assert(Took < TimeoutMs + 2000)
        after
            stop_trickle(Trickler),
            gen_tcp:close(S)
        end
    end).

%% Clients that send a well-formed name (no cookie needed) and then stall
%% hold every handshake thread; a node arriving later still gets one.
stalled_handshakes_after_their_name_make_room_for_a_node(_Ctx) ->
    with_node("stalled", #{}, fun(N, Port) ->
        Socks = [name_then_stall(Port, I) || I <- lists:seq(1, 8)],
        try
            %% The node answers a name with status ok and its challenge,
            %% from a handshake thread that now waits for the client: as
            %% many as there are threads (four) within a second.
            Answered = answered(Socks, 4, erlang:monotonic_time(millisecond) + ?CONNECT_MS),
            ?assert(length(Answered) >= 1),
            connects_fast(N)
        after
            [gen_tcp:close(S) || S <- Socks]
        end
    end).

%% A flood of name-then-stall clients from another address (127.0.0.3,
%% loopback too) at a few hundred connections a second for a few seconds:
%% each sends a valid name, so it takes a handshake thread and holds it
%% until evicted. This node reconnects over and over meanwhile, each time
%% in under a second: the flood only competes with itself for threads.
name_flood_from_one_address_does_not_keep_a_node_out(_Ctx) ->
    with_node("flood", #{}, fun(N, Port) ->
        Flooder = flood(Port, {127, 0, 0, 3}),
        try
            receive {flooding, Flooder} -> ok
            after ?WAIT_MS -> error(no_flood)
            end,
            ?assert(reconnect_until_flooded(N, Flooder, 0) >= 4)
        after
            stop_flood(Flooder)
        end
    end).

%% Connect (fast), disconnect, again, until the flood is over; how often.
reconnect_until_flooded(N, Flooder, Rounds) ->
    connects_fast(N),
    true = erlang:disconnect_node(N),
    wait_until(fun() -> not lists:member(N, nodes(hidden)) end, ?WAIT_MS),
    receive {flooded, Flooder} -> Rounds + 1
    after 0 -> reconnect_until_flooded(N, Flooder, Rounds + 1)
    end.

%% The flooding process: 4 name-then-stall clients from Ip every 10 ms
%% (about 400 a second), ?FLOOD_COUNT of them or for ?FLOOD_MS, whichever
%% ends first. It says {flooding, Pid} once 300 are out and {flooded, Pid}
%% at the end, then holds the sockets until told to stop.
-define(FLOOD_COUNT, 1200).
-define(FLOOD_MS, 8000).

flood(Port, Ip) ->
    Parent = self(),
    Until = erlang:monotonic_time(millisecond) + ?FLOOD_MS,
    spawn_link(fun() -> flood_loop(Parent, Port, Ip, Until, 0, []) end).

flood_loop(Parent, _Port, _Ip, _Until, Count, Socks)
  when Count >= ?FLOOD_COUNT ->
    flood_end(Parent, Socks);
flood_loop(Parent, Port, Ip, Until, Count, Socks) ->
    case erlang:monotonic_time(millisecond) >= Until of
        true ->
            flood_end(Parent, Socks);
        false ->
            More = [S || I <- lists:seq(Count + 1, Count + 4),
                         {ok, S} <- [flood_client(Port, Ip, I)]],
            Count1 = Count + length(More),
            Count < 300 andalso Count1 >= 300 andalso (Parent ! {flooding, self()}),
            receive
                {stop, From} -> flood_stop(From, More ++ Socks)
            after 10 ->
                flood_loop(Parent, Port, Ip, Until, Count1, More ++ Socks)
            end
    end.

flood_end(Parent, Socks) ->
    Parent ! {flooded, self()},
    receive {stop, From} -> flood_stop(From, Socks) end.

flood_stop(From, Socks) ->
    [gen_tcp:close(S) || S <- Socks],
    From ! {stopped, self()}.

flood_client(Port, Ip, I) ->
    case gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, false}, {ip, Ip}]) of
        {ok, S} ->
            _ = gen_tcp:send(S, name_packet("flood" ++ integer_to_list(I))),
            {ok, S};
        {error, _} = E ->
            E
    end.

stop_flood(Pid) ->
    unlink(Pid),
    Pid ! {stop, self()},
    receive {stopped, Pid} -> ok
    after ?WAIT_MS -> exit(Pid, kill)
    end.

%% The first Want sockets (of Socks, active) that got status ok.
answered(Socks, Want, Deadline) ->
    answered(Socks, Want, Deadline, []).

answered(_Socks, Want, _Deadline, Acc) when length(Acc) =:= Want ->
    Acc;
answered(Socks, Want, Deadline, Acc) ->
    Left = max(0, Deadline - erlang:monotonic_time(millisecond)),
    receive
        {tcp, S, <<3:16, "sok", _/binary>>} ->
            true = lists:member(S, Socks),
            answered(Socks, Want, Deadline, lists:usort([S | Acc]))
    after Left ->
        Acc
    end.

%% ===================================================================
%% The listen address
%% ===================================================================

listen_ip_binds_only_that_address(_Ctx) ->
    with_node("listen", #{listen_ip => {127, 0, 0, 1}}, fun(N, Port) ->
        ?assertEqual([{127, 0, 0, 1}], listen_addresses(Port)),
        connects_fast(N),
        [?assertEqual({error, econnrefused},
                      gen_tcp:connect(Ip, Port, [binary, {active, false}], 2000))
         || Ip <- other_local_ipv4()]
    end),
    with_node("listenany", #{listen_ip => any}, fun(_N, Port) ->
        ?assertEqual([{0, 0, 0, 0}], listen_addresses(Port))
    end).

default_listen_ip_follows_the_beams_distribution_interface(_Ctx) ->
    ap_test_util:with_env(kernel, inet_dist_use_interface, {127, 0, 0, 1}, fun() ->
        with_node("listendist", #{}, fun(_N, Port) ->
            ?assertEqual([{127, 0, 0, 1}], listen_addresses(Port))
        end)
    end).

%% C nodes speak IPv4 only: an IPv6 distribution interface (kernel
%% inet_dist_use_interface an 8-tuple) cannot be followed. Nodes still
%% start, listening on every interface, and that is logged once.
ipv6_distribution_interface_falls_back_to_any_once_logged(_Ctx) ->
    Saved = application:get_env(kernel, inet_dist_use_interface),
    %% A value no earlier run in this VM has logged.
    Ip6 = {16#fd00, 0, 0, 0, 0, 0, 0, rand:uniform(16#fffe)},
    ok = application:set_env(kernel, inet_dist_use_interface, Ip6),
    ok = logger:add_handler(?MODULE, ?MODULE, #{level => all, config => #{pid => self()}}),
    try
        [with_node(Tag, #{}, fun(_N, Port) ->
             ?assertEqual([{0, 0, 0, 0}], listen_addresses(Port))
         end) || Tag <- ["listen6a", "listen6b"]],
        ?assertEqual([Ip6], fallback_logs())
    after
        ok = logger:remove_handler(?MODULE),
        restore_env(kernel, inet_dist_use_interface, Saved)
    end.

%% logger handler: the listen address fallback goes to the test process.
-spec log(logger:log_event(), logger:handler_config()) -> ok.
log(#{meta := #{listen_ip_fallback := Ip}}, #{config := #{pid := Pid}}) ->
    Pid ! {listen_ip_fallback, Ip},
    ok;
log(_Event, _Config) ->
    ok.

%% Every fallback logged so far (the handler runs in the logging process,
%% so they are in the mailbox by now).
fallback_logs() ->
    receive {listen_ip_fallback, Ip} -> [Ip | fallback_logs()]
    after 0 -> []
    end.

restore_env(App, Key, {ok, V}) -> application:set_env(App, Key, V);
restore_env(App, Key, undefined) -> application:unset_env(App, Key).

%% ===================================================================
%% Settings
%% ===================================================================

bad_handshake_options_are_badarg(_Ctx) ->
    E = pool_exe(),
    Bad = [{listen_ip, "127.0.0.1"}, {listen_ip, {127, 0, 0, 256}},
           {listen_ip, {0, 0, 0, 0, 0, 0, 0, 1}}, {listen_ip, localhost},
           {handshake_timeout_ms, 0}, {handshake_timeout_ms, 3600001},
           {handshake_timeout_ms, 1.5}, {max_handshakes, 0},
           {max_handshakes, 65537}, {max_handshakes_per_source, -1},
           {max_handshakes_per_source, many}],
    [?assertEqual({error, {badarg, {K, V}}}, actor_cnode:start_link(#{exe => E, K => V}))
     || {K, V} <- Bad],
    %% A default from this application's environment is checked too.
    Saved = application:get_env(actor_pool, cnode_listen_ip),
    ok = application:set_env(actor_pool, cnode_listen_ip, "127.0.0.1"),
    try
        ?assertEqual({error, {badarg, {listen_ip, "127.0.0.1"}}},
                     actor_cnode:start_link(#{exe => E}))
    after
        restore_env(actor_pool, cnode_listen_ip, Saved)
    end.

%% Standalone, a bad --listen or limit is a usage error (status 2).
standalone_node_refuses_bad_listen_and_limits(_Ctx) ->
    Dir = ap_test_util:temp_dir("actor_cnode_handshake_tests"),
    CookieFile = filename:join(Dir, "cookie"),
    ok = file:write_file(CookieFile, atom_to_list(erlang:get_cookie())),
    ok = file:change_mode(CookieFile, 8#600),
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Name = alive("hs_usage") ++ "@" ++ Host,
    try
        [begin
             {Status, Out} = run_exe(["--name", Name, "--cookie-file", CookieFile | Args]),
             ?assertEqual({2, Args}, {Status, Args}),
             ?assertMatch({match, _}, re:run(Out, "usage:"))
         end || Args <- [["--listen", "bogus"], ["--listen", "::1"], ["--listen", "127.0.0.1.5"],
                         ["--max-handshakes", "0"], ["--max-handshakes", "12x"],
                         ["--max-handshakes-per-source", "70000"],
                         ["--handshake-timeout-ms", "-5"]]]
    after
        _ = file:del_dir_r(Dir)
    end,
    ?assertNot(lists:member(alive("hs_usage"), epmd_names())).

%% The owner's configuration packet is checked as strictly as the command
%% line: a listen address with a NUL inside ("127.0.0.1\0x", which C would
%% read as 127.0.0.1) is a bad packet (status 2), not an address.
port_config_listen_with_a_nul_is_refused(_Ctx) ->
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Alive = alive("hs_nul"),
    Config = #{node => list_to_binary(Alive ++ "@" ++ Host),
               cookie => atom_to_binary(erlang:get_cookie()),
               listen => <<"127.0.0.1", 0, "x">>},
    Port = open_port({spawn_executable, pool_exe_path()},
                     [{packet, 4}, binary, exit_status, use_stdio, {args, ["--port"]}]),
    true = port_command(Port, term_to_binary(Config)),
    ?assertMatch({2, _}, collect(Port, [])),
    ?assertNot(lists:member(Alive, epmd_names())).

%% ===================================================================
%% Helpers
%% ===================================================================

%% Start a pool C node owned by actor_cnode, cut its connection to this
%% node (which it made at start), run Fun(Node, DistPort), stop it.
with_node(Tag, Opts, Fun) ->
    Alive = alive("hs_" ++ Tag),
    {ok, Owner} = actor_cnode:start_link(Opts#{exe => pool_exe(), name => Alive}),
    #{node := N, port := Port, os_pid := OsPid} = actor_cnode:info(Owner),
    try
        %% The C node's side of its handshake ends (and it says ready) a
        %% moment before net_kernel here marks the connection up, and
        %% until then disconnect_node/1 returns false (even once the node
        %% is in nodes(hidden)): cut it once that is done.
        wait_until(fun() -> erlang:disconnect_node(N) end, ?WAIT_MS),
        wait_until(fun() -> not lists:member(N, nodes(hidden)) end, ?WAIT_MS),
        Fun(N, Port)
    after
        ok = actor_cnode:stop(Owner)
    end,
    ?assertNot(os_pid_alive(OsPid)),
    wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS).

%% This node connects (a fresh handshake) and the C node answers a call,
%% all in under CONNECT_MS.
connects_fast(N) ->
    false = lists:member(N, nodes(hidden)),
    T0 = erlang:monotonic_time(millisecond),
    ?assertEqual(pong, net_adm:ping(N)),
    ?assertEqual([], gen_server:call({actor_pool_node, N}, which_pools, ?CONNECT_MS)),
    Took = erlang:monotonic_time(millisecond) - T0,
    ?assert(Took < ?CONNECT_MS).

idle_client(Port) ->
    {ok, S} = gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, false}]),
    S.

%% A well-formed name packet (ap_test_util:name_packet/1), then nothing.
name_then_stall(Port, I) ->
    {ok, S} = gen_tcp:connect({127, 0, 0, 1}, Port, [binary, {active, true}]),
    ok = gen_tcp:send(S, name_packet("stall" ++ integer_to_list(I))),
    S.

%% A process sending one byte every GapMs (the slow client itself, not a
%% wait in the test) until told to stop or the socket fails.
trickle(S, GapMs) ->
    spawn_link(fun() -> trickle_loop(S, GapMs) end).

trickle_loop(S, GapMs) ->
    case gen_tcp:send(S, <<"x">>) of
        ok ->
            receive stop -> ok
            after GapMs -> trickle_loop(S, GapMs)
            end;
        {error, _} ->
            receive stop -> ok end
    end.

stop_trickle(Pid) ->
    unlink(Pid),
    Mref = monitor(process, Pid),
    Pid ! stop,
    receive {'DOWN', Mref, process, Pid, _} -> ok end.

%% Local addresses of the listening sockets on Port, from /proc/net/tcp
%% ("0100007F:1F90" is 127.0.0.1:8080, the address little-endian).
listen_addresses(Port) ->
    {ok, Bin} = file:read_file("/proc/net/tcp"),
    [_Header | Lines] = string:split(Bin, "\n", all),
    lists:usort(
      [{D, C, B, A}
       || Line <- Lines,
          [_Sl, Local, _Remote, State | _] <- [string:lexemes(Line, " ")],
          State =:= <<"0A">>,
          [AddrHex, PortHex] <- [string:split(Local, ":")],
          binary_to_integer(PortHex, 16) =:= Port,
          <<A, B, C, D>> <- [<<(binary_to_integer(AddrHex, 16)):32>>]]).

%% An address of this host that the node must not answer on: 127.0.0.2 is
%% loopback too (the whole 127/8 is local), so no traffic leaves the host,
%% and it exists on every host, unlike a second interface.
other_local_ipv4() ->
    [{127, 0, 0, 2}].

run_exe(Args) ->
    Port = open_port({spawn_executable, pool_exe_path()},
                     [{args, Args}, exit_status, binary, stderr_to_stdout, use_stdio]),
    collect(Port, []).

collect(Port, Acc) ->
    receive
        {Port, {data, D}} -> collect(Port, [Acc, D]);
        {Port, {exit_status, St}} -> {St, iolist_to_binary(Acc)}
    after ?WAIT_MS ->
        catch port_close(Port),
        error(no_exit)
    end.

pool_exe() ->
    os:getenv("ACTOR_POOL_NODE_EXE", "actor_pool_node").

pool_exe_path() ->
    case pool_exe() of
        "/" ++ _ = Abs -> Abs;
        Rel -> filename:join(code:priv_dir(actor_pool), Rel)
    end.
