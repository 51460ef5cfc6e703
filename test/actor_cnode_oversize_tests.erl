%% Messages larger than a C node's `max_frame', sent by a BEAM that never
%% loaded actor_pool: a peer node started without the library's code path,
%% which talks to the C nodes with plain `gen_server' calls and casts only
%% (stdlib functions, never a fun of this module).
%%
%% A pool node and a receptionist node of this module's own run with a
%% `max_frame' of 64 KiB; a 256 KiB message is over it (and a 64 MiB one,
%% the issue's example, far over). The C node reads the
%% frame and passes it over: a call gets `{error, too_large}', a cast is
%% dropped, each is counted and logged once, and the connection stays up:
%% the same peer's next call is answered, and calls in flight with it
%% (from the same peer, and from this node) are answered as usual.
%%
%% The executables are $ACTOR_POOL_NODE_EXE and $ACTOR_RECEPTIONIST_NODE_EXE
%% when set (the sanitizer builds of `make eunit-asan'), with the I/O backend
%% of ACTOR_POOL_IO. Every C node and peer started here is stopped, and no
%% epmd name or shared-memory segment is left behind (the receptionist runs
%% without a snapshot).
-module(actor_cnode_oversize_tests).

-import(ap_test_util, [alive/1]).
-import(ap_support, [wait_until/2, epmd_names/0]).

-include_lib("eunit/include/eunit.hrl").

%% The cases, called through ?MODULE.
-export([call_over_max_frame_gets_too_large_and_the_connection_stays/1,
         cast_over_max_frame_is_dropped_and_the_connection_stays/1,
         calls_in_flight_beside_an_oversized_one_are_answered/1,
         a_64_mib_call_is_read_through_without_being_kept/1,
         receptionist_answers_too_large_drops_the_cast_and_keeps_serving/1,
         the_line_names_the_sender_and_escapes_the_name/1]).
%% logger handler callback: passes on the events of one C node.
-export([log/2]).

-define(MAX_FRAME, 65536).
-define(BIG, (4 * ?MAX_FRAME)).
-define(CALL_TIMEOUT, 10000).
-define(WAIT_MS, 30000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_cnode_oversize_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [call_over_max_frame_gets_too_large_and_the_connection_stays,
                          cast_over_max_frame_is_dropped_and_the_connection_stays,
                          calls_in_flight_beside_an_oversized_one_are_answered,
                          a_64_mib_call_is_read_through_without_being_kept,
                          receptionist_answers_too_large_drops_the_cast_and_keeps_serving,
                          the_line_names_the_sender_and_escapes_the_name]]
     end}.

setup() ->
    WasAlive = ap_test_util:start_app(),
    PoolAlive = alive("ovpool"),
    RcptAlive = alive("ovrcpt"),
    {ok, PoolOwner} = actor_cnode:start(#{exe => os:getenv("ACTOR_POOL_NODE_EXE", "actor_pool_node"),
                                          name => PoolAlive, max_frame => ?MAX_FRAME}),
    {ok, RcptOwner} = actor_cnode:start(#{exe => os:getenv("ACTOR_RECEPTIONIST_NODE_EXE",
                                                           "actor_receptionist_node"),
                                          name => RcptAlive, max_frame => ?MAX_FRAME,
                                          args => ["--shm-mb", "0"]}),
    {ok, Peer, PeerNode} = peer:start(#{name => peer:random_name(ap_oversize),
                                        connection => standard_io,
                                        args => ["-hidden", "-setcookie",
                                                 atom_to_list(erlang:get_cookie())]}),
    #{was_alive => WasAlive, peer => Peer, peer_node => PeerNode,
      pool_owner => PoolOwner, pool_node => actor_cnode:node(PoolOwner), pool_alive => PoolAlive,
      rcpt_owner => RcptOwner, rcpt_node => actor_cnode:node(RcptOwner), rcpt_alive => RcptAlive}.

cleanup(#{was_alive := WasAlive, peer := Peer, pool_owner := PoolOwner, rcpt_owner := RcptOwner,
          pool_alive := PoolAlive, rcpt_alive := RcptAlive}) ->
    catch peer:stop(Peer),
    catch actor_cnode:stop(PoolOwner),
    catch actor_cnode:stop(RcptOwner),
    wait_until(fun() -> not lists:member(PoolAlive, epmd_names())
                            andalso not lists:member(RcptAlive, epmd_names()) end, ?WAIT_MS),
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Cases: the pool node
%% ===================================================================

call_over_max_frame_gets_too_large_and_the_connection_stays(#{peer := Peer, peer_node := PeerNode,
                                                              pool_node := PN} = Ctx) ->
    {Pool, Pid} = start_pool(Ctx, ov_call, 2),
    %% The peer never loaded the library: it has not even the module.
    ?assertEqual(non_existing, peer:call(Peer, code, which, [actor_pool])),
    ?assertEqual({ok, <<"small">>}, echo_call(Peer, Pool, <<"small">>)),
    Conn = connection_id(Peer, PN),
    with_log(PN, fun() ->
        ?assertEqual({error, too_large}, peer_call(Peer, Pool, big())),
        Line = await_log(PN, "oversized call"),
        %% Who sent what to whom, how big, and the limit.
        [?assertNotEqual(nomatch, string:find(Line, S))
         || S <- [atom_to_list(PeerNode), "'ov_call'", "answered {error, too_large}",
                  "max_frame " ++ integer_to_list(?MAX_FRAME)]],
        {match, [Size]} = re:run(Line, "([0-9]+) bytes", [{capture, all_but_first, list}]),
        ?assert(list_to_integer(Size) > ?BIG)
    end),
    %% The same connection serves the peer's next call.
    ?assertEqual({ok, <<"after">>}, echo_call(Peer, Pool, <<"after">>)),
    ?assertEqual(Conn, connection_id(Peer, PN)),
    %% A call by pid is answered the same way.
    ?assertEqual({error, too_large}, peer:call(Peer, gen_server, call, [Pid, big(), ?CALL_TIMEOUT])),
    ?assertEqual(Conn, connection_id(Peer, PN)),
    ok = actor_pool:stop_pool(Pool).

cast_over_max_frame_is_dropped_and_the_connection_stays(#{peer := Peer, pool_node := PN} = Ctx) ->
    %% One worker: it takes its mailbox in order, so a message delivered
    %% before the call below would be processed before the call's answer.
    {Pool, _} = start_pool(Ctx, ov_cast, 1),
    ?assertEqual({ok, <<"first">>}, echo_call(Peer, Pool, <<"first">>)),
    Conn = connection_id(Peer, PN),
    #{processed := P0} = actor_pool:stats(Pool),
    with_log(PN, fun() ->
        ok = peer:call(Peer, gen_server, cast, [Pool, big()]),
        _ = peer:call(Peer, erlang, send, [Pool, {plain, big()}]),
        ?assertEqual({ok, <<"next">>}, echo_call(Peer, Pool, <<"next">>)),
        _ = await_log(PN, "oversized cast"),
        _ = await_log(PN, "oversized message")
    end),
    %% Only the call was processed: both big ones were dropped.
    #{processed := P1} = actor_pool:stats(Pool),
    ?assertEqual(P0 + 1, P1),
    ?assertEqual(Conn, connection_id(Peer, PN)),
    ok = actor_pool:stop_pool(Pool).

%% 40 small calls from the peer, in parallel with one oversized call over
%% the same connection, and 200 asks from this node meanwhile: every small
%% one is answered, the big one gets too_large.
calls_in_flight_beside_an_oversized_one_are_answered(#{peer := Peer, pool_node := PN} = Ctx) ->
    {Pool, _} = start_pool(Ctx, ov_flight, 2),
    ?assertEqual({ok, <<"warm">>}, echo_call(Peer, Pool, <<"warm">>)),
    Conn = connection_id(Peer, PN),
    Self = self(),
    Asker = spawn_link(fun() ->
                               Self ! {asks, [actor_pool:ask(Pool, {n, I}) || I <- lists:seq(1, 200)]}
                       end),
    Small = [{gen_server, call, [Pool, {small, I}, ?CALL_TIMEOUT]} || I <- lists:seq(1, 40)],
    {Before, After} = lists:split(20, Small),
    Calls = Before ++ [{gen_server, call, [Pool, big(), ?CALL_TIMEOUT]}] ++ After,
    Results = peer:call(Peer, rpc, parallel_eval, [Calls], 60000),
    {RBefore, [RBig | RAfter]} = lists:split(20, Results),
    ?assertEqual([{ok, {small, I}} || I <- lists:seq(1, 40)], RBefore ++ RAfter),
    ?assertEqual({error, too_large}, RBig),
    Asks = receive {asks, A} -> A after ?WAIT_MS -> error({asker, Asker}) end,
    ?assertEqual([{ok, {n, I}} || I <- lists:seq(1, 200)], Asks),
    ?assertEqual(Conn, connection_id(Peer, PN)),
    ok = actor_pool:stop_pool(Pool).

%% The issue's example, a 64 MiB call (built on the peer, by erl_eval, so
%% it never crosses the peer's control channel): the pool node reads all of
%% it and keeps none of it; its peak resident memory barely moves.
a_64_mib_call_is_read_through_without_being_kept(#{peer := Peer, pool_node := PN,
                                                    pool_owner := Owner} = Ctx) ->
    {Pool, _} = start_pool(Ctx, ov_huge, 1),
    ?assertEqual({ok, <<"warm">>}, echo_call(Peer, Pool, <<"warm">>)),
    Conn = connection_id(Peer, PN),
    #{os_pid := OsPid} = actor_cnode:info(Owner),
    Hwm0 = vm_hwm_kib(OsPid),
    ?assertEqual({error, too_large},
                 peer_eval(Peer, "gen_server:call(P, binary:copy(<<\"0123456789abcdef\">>, 4194304), 60000).",
                           #{'P' => Pool})),
    ?assertEqual({ok, <<"after">>}, echo_call(Peer, Pool, <<"after">>)),
    ?assertEqual(Conn, connection_id(Peer, PN)),
    GrowthKiB = vm_hwm_kib(OsPid) - Hwm0,
    ?assert(GrowthKiB < 16 * 1024),
    ok = actor_pool:stop_pool(Pool).

%% ===================================================================
%% Cases: the receptionist node
%% ===================================================================

receptionist_answers_too_large_drops_the_cast_and_keeps_serving(#{peer := Peer, rcpt_node := RN}) ->
    Rcpt = {actor_receptionist, RN},
    ?assertEqual(ok, peer:call(Peer, gen_server, call, [Rcpt, sync, ?CALL_TIMEOUT])),
    Conn = connection_id(Peer, RN),
    #{oversized := O0} = gen_server:call(Rcpt, stats, ?CALL_TIMEOUT),
    with_log(RN, fun() ->
        ?assertEqual({error, too_large},
                     peer:call(Peer, gen_server, call, [Rcpt, {lookup, big()}, ?CALL_TIMEOUT])),
        _ = await_log(RN, "oversized call")
    end),
    %% {send, Pid, Term} makes the receptionist send Term to Pid: the big
    %% one must never come; the marker after it must.
    Marker = make_ref(),
    ok = peer:call(Peer, gen_server, cast, [Rcpt, {send, self(), {big, big()}}]),
    ok = peer:call(Peer, gen_server, cast, [Rcpt, {send, self(), Marker}]),
    receive Marker -> ok after ?WAIT_MS -> error(no_marker) end,
    ?assertEqual(none, receive {big, _} -> got_big after 0 -> none end),
    ?assertEqual(ok, peer:call(Peer, gen_server, call, [Rcpt, sync, ?CALL_TIMEOUT])),
    ?assertEqual(Conn, connection_id(Peer, RN)),
    #{oversized := O1} = gen_server:call(Rcpt, stats, ?CALL_TIMEOUT),
    ?assertEqual(O0 + 2, O1).

%% The oversized line names the caller (its pid, as num.serial), and a name
%% the peer chose is escaped in it: a newline in an atom cannot start a
%% forged line. The line for a message to an unregistered name escapes it
%% the same way.
the_line_names_the_sender_and_escapes_the_name(#{peer := Peer, pool_node := PN}) ->
    Evil = list_to_atom("evil\nname"),
    with_log(PN, fun() ->
        {Caller, Reply} = peer_eval(Peer, "{self(), gen_server:call({Name, PN}, Big, Timeout)}.",
                                    #{'Name' => Evil, 'PN' => PN, 'Big' => big(),
                                      'Timeout' => ?CALL_TIMEOUT}),
        ?assertEqual({error, too_large}, Reply),
        Line = await_log(PN, "oversized call"),
        {match, [Num, Serial]} = re:run(pid_to_list(Caller), "<[0-9]+\\.([0-9]+)\\.([0-9]+)>",
                                        [{capture, all_but_first, list}]),
        ?assertNotEqual(nomatch, string:find(Line, "from <" ++ Num ++ "." ++ Serial ++ "> on ")),
        ?assertNotEqual(nomatch, string:find(Line, "to 'evil\\x0aname'")),
        ?assertEqual(nomatch, string:find(Line, "\n")),
        _ = peer:call(Peer, erlang, send, [{Evil, PN}, small]),
        Unknown = await_log(PN, "unregistered name"),
        ?assertNotEqual(nomatch, string:find(Unknown, "'evil\\x0aname'")),
        ?assertEqual(nomatch, string:find(Unknown, "\n"))
    end).

%% ===================================================================
%% logger handler
%% ===================================================================

-spec log(logger:log_event(), logger:handler_config()) -> ok.
log(#{meta := #{cnode := N}, msg := Msg}, #{config := #{pid := Pid, node := N}}) ->
    Pid ! {cnode_log, N, iolist_to_binary(format(Msg))},
    ok;
log(_Event, _Config) ->
    ok.

format({string, S}) -> S;
format({F, A}) when is_list(F) -> io_lib:format(F, A);
format(Other) -> io_lib:format("~p", [Other]).

%% ===================================================================
%% Helpers
%% ===================================================================

%% A binary over the C nodes' max_frame (a 256 KiB binary, built from a
%% seed so no part of it compresses into anything smaller on the wire).
big() ->
    binary:copy(<<"0123456789abcdef">>, ?BIG div 16).

start_pool(#{pool_node := PN}, Name, Workers) ->
    {ok, Pid} = actor_pool:start_pool(Name, echo, #{node => PN, workers => Workers}),
    {{Name, PN}, Pid}.

peer_call(Peer, Pool, Msg) ->
    peer:call(Peer, gen_server, call, [Pool, Msg, ?CALL_TIMEOUT], 60000).

%% The echo handler answers a call with {ok, Request}.
echo_call(Peer, Pool, Msg) ->
    peer_call(Peer, Pool, Msg).

%% Evaluate Expr on the peer, with the given variables bound: only stdlib
%% runs there.
peer_eval(Peer, Expr, Vars) ->
    {ok, Tokens, _} = erl_scan:string(Expr),
    {ok, Exprs} = erl_parse:parse_exprs(Tokens),
    Bindings = maps:fold(fun erl_eval:add_binding/3, erl_eval:new_bindings(), Vars),
    {value, Value, _} = peer:call(Peer, erl_eval, exprs, [Exprs, Bindings], 120000),
    Value.

%% Peak resident memory of an OS process, KiB.
vm_hwm_kib(OsPid) ->
    {ok, Status} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/status"),
    {match, [Kib]} = re:run(Status, "VmHWM:\\s+([0-9]+) kB", [{capture, all_but_first, list}]),
    list_to_integer(Kib).

%% The peer's connection to Node: the same id before and after means it
%% was never closed (a new connection gets a new id).
connection_id(Peer, Node) ->
    Conns = peer:call(Peer, erlang, nodes, [hidden, #{connection_id => true}]),
    {Node, #{connection_id := Id}} = lists:keyfind(Node, 1, Conns),
    Id.

with_log(N, Fun) ->
    HandlerId = list_to_atom("oversize_" ++ integer_to_list(erlang:unique_integer([positive]))),
    ok = logger:add_handler(HandlerId, ?MODULE, #{level => all, config => #{pid => self(), node => N}}),
    try Fun()
    after
        _ = logger:remove_handler(HandlerId),
        flush_logs()
    end.

%% The next log line of C node N that contains What.
await_log(N, What) ->
    receive
        {cnode_log, N, Line} ->
            case string:find(Line, What) of
                nomatch -> await_log(N, What);
                _ -> binary_to_list(Line)
            end
    after ?WAIT_MS -> error({no_log_line, What})
    end.

flush_logs() ->
    receive {cnode_log, _, _} -> flush_logs()
    after 0 -> ok
    end.
