%% Crafted terms against the real C nodes the application starts: the pool
%% node (an echo pool) and the receptionist node (issue 12, finding 1).
%%
%% The crafted term is a fun (NEW_FUN_EXT) whose Size claims 5 bytes more
%% than its fields span, followed by a binary whose first bytes are another
%% binary header claiming many bytes. A walk over the fields finds it well
%% formed; ei skips a fun by its Size, lands on the inner header, and ends far
%% past the message. Before the fix a C node trusted that end: a cast crashed
%% the pool node, a call tagged with the fun was answered with bytes from
%% past the request, and `{send, Pid, Term}' crashed the receptionist node.
%%
%% The frames go out through actor_rawpeer, which completes a real
%% handshake (under a node name given here, so that pids of it can be put in
%% the frames and replies come back to it), writes the bytes, and reports
%% what it read back. Each case checks that the node keeps its OS process,
%% keeps serving, and that nothing beyond the request came back.
%%
%% A start_pool whose backoff jitter is a NaN float (NEW_FLOAT_EXT with NaN
%% bits: a BEAM cannot send one, any peer with the cookie can) passed the
%% manager's `d < 0 || d > 1' check, and a crashed worker's restart delay
%% then turned NaN into an int. It is refused as badarg now.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the I/O backend;
%% ACTOR_POOL_NODE_EXE / ACTOR_RECEPTIONIST_NODE_EXE run the ASan builds.
-module(actor_security_term_tests).

-import(ap_test_util, [ext_atom/1, ext_pid/1, fun_overrun/1, reg_send_frame/3]).
-import(ap_support, [wait_until/2, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

-export([pool_survives_a_cast_of_a_fun_overrunning_its_size/1,
         pool_call_tagged_with_such_a_fun_gets_no_foreign_bytes/1,
         receptionist_survives_send_of_such_a_fun/1,
         pool_node_refuses_a_nan_jitter/1]).

-define(WAIT_MS, 10000).
%% The binary header the fun overruns into claims this much.
-define(HUGE, 256 * 1024 * 1024).
%% Small enough to stay inside a receive buffer: a node that trusted it
%% would copy it into a reply instead of crashing.
-define(LEAK, 150000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_security_term_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 pool_survives_a_cast_of_a_fun_overrunning_its_size,
                 pool_call_tagged_with_such_a_fun_gets_no_foreign_bytes,
                 receptionist_survives_send_of_such_a_fun,
                 pool_node_refuses_a_nan_jitter]]
     end}.

case_(Name, Ctx) ->
    {atom_to_list(Name), {timeout, 60, fun() -> ?MODULE:Name(Ctx) end}}.

setup() ->
    WasAlive = ap_test_util:start_app(),
    PoolNode = actor_pool:pool_node(),
    RcptNode = actor_receptionist:receptionist_node(),
    ?assert(is_atom(PoolNode) andalso PoolNode =/= undefined),
    ?assert(is_atom(RcptNode) andalso RcptNode =/= undefined),
    #{pool_node => PoolNode, rcpt_node => RcptNode, was_alive => WasAlive}.

cleanup(#{was_alive := WasAlive}) ->
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Cases
%% ===================================================================

%% (a) {'$gen_cast', {Fun, Pad}} to an echo pool.
pool_survives_a_cast_of_a_fun_overrunning_its_size(#{pool_node := N}) ->
    Name = ?FUNCTION_NAME,
    with_pool(Name, fun(P) ->
        OsPid = os_pid(actor_pool_node_owner),
        Self = peer_name(Name),
        Msg = <<131, 104, 2, (ext_atom('$gen_cast'))/binary, 104, 2, (fun_overrun(?HUGE))/binary>>,
        {State, Got, _} = rawpeer(N, Self, reg_send_frame(Self, Name, Msg), <<"unused">>),
        %% The frame is refused and its connection closed; nothing comes
        %% back but maybe a tick.
        ?assertEqual("closed", State),
        ?assert(Got < 64),
        still_serving(P, OsPid, actor_pool_node_owner)
    end).

%% (b) {'$gen_call', {Pid, Fun}, Pad}: the fun is the reply tag, copied into
%% the reply. Another connection (this node's) sends a marker just before.
pool_call_tagged_with_such_a_fun_gets_no_foreign_bytes(#{pool_node := N}) ->
    Name = ?FUNCTION_NAME,
    with_pool(Name, fun(P) ->
        OsPid = os_pid(actor_pool_node_owner),
        Marker = <<"foreign-bytes-", (integer_to_binary(erlang:unique_integer([positive])))/binary>>,
        ok = gen_server:cast(P, {marker, binary:copy(Marker, 4000)}),
        ?assertEqual({ok, <<"sync">>}, actor_pool:ask(P, <<"sync">>)),
        Self = peer_name(Name),
        [begin
             Msg = <<131, 104, 3, (ext_atom('$gen_call'))/binary, 104, 2, (ext_pid(Self))/binary,
                     (fun_overrun(Claim))/binary>>,
             {State, Got, Seen} = rawpeer(N, Self, reg_send_frame(Self, Name, Msg), Marker),
             %% Refused and closed: no reply at all (a tick at most), so
             %% none with the marker or bytes from past the request.
             ?assertEqual({Claim, "closed", small, false},
                          {Claim, State, if Got < 64 -> small; true -> Got end, Seen})
         end || Claim <- [?LEAK, ?HUGE]],
        still_serving(P, OsPid, actor_pool_node_owner)
    end).

%% (c) {send, Pid, {Fun, Pad}} to the receptionist C node's process.
receptionist_survives_send_of_such_a_fun(#{rcpt_node := R}) ->
    up(actor_receptionist_owner),
    OsPid = os_pid(actor_receptionist_owner),
    Self = peer_name(?FUNCTION_NAME),
    Msg = <<131, 104, 3, (ext_atom(send))/binary, (ext_pid(Self))/binary, 104, 2,
            (fun_overrun(?HUGE))/binary>>,
    {State, Got, _} = rawpeer(R, Self, reg_send_frame(Self, actor_receptionist, Msg), <<"unused">>),
    ?assertEqual("closed", State),
    ?assert(Got < 64),
    ?assertEqual(OsPid, os_pid(actor_receptionist_owner)),
    ?assert(os_pid_alive(OsPid)),
    %% It keeps serving: a registration is acknowledged (the ack goes out
    %% through the C node as another {send, Pid, Term}) and then found.
    K = actor_receptionist:service_key(atom_to_binary(?FUNCTION_NAME)),
    Me = self(),
    ok = actor_receptionist:register(K, Me, Me),
    receive {registered, _, Me} -> ok
    after ?WAIT_MS -> error(no_ack)
    end,
    ok = actor_receptionist:find(K, Me),
    receive {listing, K, Refs} -> ?assertEqual([Me], Refs)
    after ?WAIT_MS -> error(no_listing)
    end,
    ok = actor_receptionist:deregister(K, Me).

%% (d) {start_pool, Name, echo, #{backoff => #{jitter => NaN}}} to the
%% pool node's manager: answered {error, {badarg, {backoff, _}}}, and no
%% pool starts.
pool_node_refuses_a_nan_jitter(#{pool_node := N}) ->
    up(actor_pool_node_owner),
    OsPid = os_pid(actor_pool_node_owner),
    Name = ?FUNCTION_NAME,
    Self = peer_name(Name),
    NaN = <<70, 16#7ff8000000000000:64>>,
    Opts = <<116, 1:32, (ext_atom(backoff))/binary, 116, 1:32, (ext_atom(jitter))/binary, NaN/binary>>,
    Msg = <<131, 104, 3, (ext_atom('$gen_call'))/binary, 104, 2, (ext_pid(Self))/binary, (ext_atom(nan_tag))/binary,
            104, 4, (ext_atom(start_pool))/binary, (ext_atom(Name))/binary, (ext_atom(echo))/binary, Opts/binary>>,
    %% The reply {nan_tag, {error, {badarg, {backoff, _}}}} comes back to
    %% the peer's pid: its tag and the atoms in order.
    Marker = <<(ext_atom(nan_tag))/binary, 104, 2, (ext_atom(error))/binary, 104, 2, (ext_atom(badarg))/binary,
               104, 2, (ext_atom(backoff))/binary>>,
    {State, _, Seen} = rawpeer(N, Self, reg_send_frame(Self, actor_pool_node, Msg), Marker),
    Pools = actor_pool:which_pools(),
    [actor_pool:stop_pool(Name) || lists:keymember(Name, 1, Pools)],
    ?assertEqual({"open", true, false}, {State, Seen, lists:keymember(Name, 1, Pools)}),
    ?assertEqual(OsPid, os_pid(actor_pool_node_owner)).

%% ===================================================================
%% Helpers
%% ===================================================================

with_pool(Name, Fun) ->
    up(actor_pool_node_owner),
    {ok, P} = actor_pool:start_pool(Name, echo, #{workers => 1}),
    try Fun(P)
    after actor_pool:stop_pool(P)
    end.

%% Each case starts from a node that is up, whatever the one before did.
up(Owner) ->
    wait_until(fun() -> maps:get(status, actor_cnode:info(Owner)) =:= up end, ?WAIT_MS).

os_pid(Owner) ->
    #{os_pid := OsPid, status := up} = actor_cnode:info(Owner),
    OsPid.

%% Same OS process, and the pool still answers.
still_serving(P, OsPid, Owner) ->
    ?assertEqual(OsPid, os_pid(Owner)),
    ?assert(os_pid_alive(OsPid)),
    ?assertEqual({ok, <<"after">>}, actor_pool:ask(P, <<"after">>)).

%% The raw peer's node name, on this node's host.
peer_name(Case) ->
    [_, Host] = string:split(atom_to_list(node()), "@"),
    "rawsec" ++ integer_to_list(erlang:phash2({Case, os:getpid()}, 100000)) ++ "@" ++ Host.

%% Runs actor_rawpeer (a test executable) as node Self against Node with the frame; returns
%% {"closed" | "open", BytesReadBack, MarkerSeen}.
rawpeer(Node, Self, Frame, Marker) ->
    {Status, Out} = ap_test_util:rawpeer("actor_security_term_tests",
                                         fun(Cookie) -> ["-N", Self, "-m", hex(Marker), atom_to_list(Node), Cookie,
                                                         hex(Frame)]
                                         end, 20000),
    ?assertEqual({0, Out}, {Status, Out}),
    Last = lists:last(string:lexemes(binary_to_list(Out), "\r\n")),
    [State, Got, Seen] = string:lexemes(Last, " "),
    {State, list_to_integer(Got), Seen =:= "1"}.

hex(Bin) -> binary_to_list(binary:encode_hex(Bin)).

