%% Behaviour of a real C node owned by actor_cnode: the echo node from
%% actor_echo_node (c_src/test/echo/), reached over distributed Erlang like any node.
%%
%% One shared echo node serves the cases that leave it running; the cases
%% that kill or stop a node start their own, with a name of their own. Every
%% case waits on messages or polls with a deadline, never sleeps, and stops
%% every OS process it started (C nodes, peers), so no name stays in epmd.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the I/O backend of the C nodes;
%% `make test' runs this module once with each. ACTOR_POOL_ECHO_EXE names
%% another echo executable (an absolute path) when set.
-module(actor_cnode_tests).

-import(ap_test_util, [alive/1, echo_exe/0]).
-import(ap_support, [wait_until/2, epmd_names/0, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

%% The cases, called through ?MODULE by case_/2.
-export([call_is_answered_by_the_echo_process/1,
         call_by_pid_reaches_the_same_process/1,
         cast_reply_to_sends_the_term/1,
         plain_message_with_pid_is_forwarded/1,
         stats_count_messages_and_name_the_backend/1,
         ping_answers_pong/1,
         cnode_is_hidden/1,
         link_delivers_exit_with_the_stop_reason/1,
         call_to_missing_name_replies_noproc/1,
         malformed_frames_close_only_that_connection/1,
         oversized_frame_whose_head_is_no_control_message_closes_the_connection/1,
         a_burst_of_calls_over_a_small_max_frame_is_all_answered/1,
         an_exit_whose_reason_outgrows_the_head_is_passed_over/1,
         wrong_cookie_is_refused_right_cookie_accepted/1,
         io_backend_is_the_one_requested/1,
         await_up_returns_ok_when_up/1,
         kill_9_fails_calls_fast_and_the_owner_restarts_it/1,
         stopping_the_owner_ends_the_os_process_and_epmd_entry/1,
         bad_options_are_badarg/1,
         missing_executable_fails_the_start/1,
         executable_that_exits_fails_the_start/1,
         executable_never_ready_is_killed_after_the_timeout/1]).

-define(CALL_TIMEOUT, 5000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_cnode_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 call_is_answered_by_the_echo_process,
                 call_by_pid_reaches_the_same_process,
                 cast_reply_to_sends_the_term,
                 plain_message_with_pid_is_forwarded,
                 stats_count_messages_and_name_the_backend,
                 ping_answers_pong,
                 cnode_is_hidden,
                 link_delivers_exit_with_the_stop_reason,
                 call_to_missing_name_replies_noproc,
                 malformed_frames_close_only_that_connection,
                 oversized_frame_whose_head_is_no_control_message_closes_the_connection,
                 a_burst_of_calls_over_a_small_max_frame_is_all_answered,
                 an_exit_whose_reason_outgrows_the_head_is_passed_over,
                 wrong_cookie_is_refused_right_cookie_accepted,
                 io_backend_is_the_one_requested,
                 await_up_returns_ok_when_up,
                 kill_9_fails_calls_fast_and_the_owner_restarts_it,
                 stopping_the_owner_ends_the_os_process_and_epmd_entry,
                 bad_options_are_badarg,
                 missing_executable_fails_the_start,
                 executable_that_exits_fails_the_start,
                 executable_never_ready_is_killed_after_the_timeout]]
     end}.

case_(Name, Ctx) ->
    {atom_to_list(Name), {timeout, 60, fun() -> ?MODULE:Name(Ctx) end}}.

setup() ->
    WasAlive = ap_test_util:start_app(),
    {ok, Owner} = actor_cnode:start(#{exe => echo_exe(), name => alive("echo")}),
    #{owner => Owner, node => actor_cnode:node(Owner), was_alive => WasAlive}.

cleanup(#{owner := Owner, was_alive := WasAlive}) ->
    catch actor_cnode:stop(Owner),
    ap_test_util:stop_app(WasAlive).

%% ===================================================================
%% Messages, calls, casts
%% ===================================================================

call_is_answered_by_the_echo_process(#{node := N}) ->
    ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
    Req = {any, [term, 1.5, <<"bin">>, #{k => v}], make_ref(), self()},
    ?assertEqual(Req, gen_server:call({echo, N}, Req, ?CALL_TIMEOUT)).

call_by_pid_reaches_the_same_process(#{node := N}) ->
    Pid = gen_server:call({echo, N}, pid, ?CALL_TIMEOUT),
    ?assert(is_pid(Pid)),
    ?assertEqual(N, node(Pid)),
    ?assertEqual(pong, gen_server:call(Pid, ping, ?CALL_TIMEOUT)),
    ?assertEqual({by_pid, 42}, gen_server:call(Pid, {by_pid, 42}, ?CALL_TIMEOUT)).

cast_reply_to_sends_the_term(#{node := N}) ->
    Ref = make_ref(),
    ok = gen_server:cast({echo, N}, {reply_to, self(), {cast, Ref}}),
    ?assertEqual({cast, Ref}, receive {cast, Ref} = M -> M
                              after ?CALL_TIMEOUT -> timeout end).

plain_message_with_pid_is_forwarded(#{node := N}) ->
    Ref = make_ref(),
    {echo, N} ! {self(), {plain, Ref}},
    ?assertEqual({plain, Ref}, receive {plain, Ref} = M -> M
                               after ?CALL_TIMEOUT -> timeout end).

stats_count_messages_and_name_the_backend(#{node := N}) ->
    Before = stats(N),
    [?assert(is_integer(maps:get(K, Before)))
     || K <- [received, unknown_name, bad_frames, oversized, utime_us, stime_us, connections]],
    ?assert(lists:member(maps:get(io, Before), [uring, epoll])),
    {echo, N} ! <<"a plain binary">>,
    {echo, N} ! {batch, [a, b, c]},
    _ = gen_server:call({nosuch_for_stats, N}, x, ?CALL_TIMEOUT),
    After = stats(N),
    %% The binary and the batch were sent before the second stats call on the
    %% same connection, so both are counted in its reply: `received' counts
    %% delivered messages, `tells' (when present) counts a batch of three as
    %% three.
    ?assert(maps:get(received, After) >= maps:get(received, Before) + 2),
    case Before of
        #{tells := Tells0} -> ?assert(maps:get(tells, After) >= Tells0 + 4);
        #{} -> ok
    end,
    ?assert(maps:get(unknown_name, After) >= maps:get(unknown_name, Before) + 1).

ping_answers_pong(#{node := N}) ->
    ?assertEqual(pong, net_adm:ping(N)).

cnode_is_hidden(#{node := N}) ->
    ?assert(lists:member(N, nodes(hidden))),
    ?assertNot(lists:member(N, nodes())).

link_delivers_exit_with_the_stop_reason(#{node := N}) ->
    Result = in_fresh_process(
               fun() ->
                       process_flag(trap_exit, true),
                       {ok, P1} = gen_server:call({echo, N}, spawn, ?CALL_TIMEOUT),
                       true = link(P1),
                       P1 ! stop,
                       Exit1 = receive {'EXIT', P1, R1} -> R1
                               after ?CALL_TIMEOUT -> timeout end,
                       {ok, P2} = gen_server:call({echo, N}, spawn, ?CALL_TIMEOUT),
                       true = link(P2),
                       P2 ! {stop, custom},
                       Exit2 = receive {'EXIT', P2, R2} -> R2
                               after ?CALL_TIMEOUT -> timeout end,
                       {node(P1), node(P2), Exit1, Exit2}
               end),
    ?assertEqual({N, N, normal, custom}, Result).

call_to_missing_name_replies_noproc(#{node := N}) ->
    ?assertEqual({error, noproc}, gen_server:call({nosuch, N}, x, ?CALL_TIMEOUT)).

%% ===================================================================
%% Hostile peers
%% ===================================================================

malformed_frames_close_only_that_connection(#{node := N}) ->
    #{bad_frames := Bad0} = stats(N),
    %% A 5-byte frame: 'p' then bytes that are no control tuple.
    ?assertEqual("closed", rawpeer(N, "000000057000000000")),
    ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
    %% A length header far beyond max_frame is no malformed frame: the node
    %% waits for its bytes to pass them over (actor_cnode_oversize_tests),
    %% and the idle timeout ends a peer that sends nothing more.
    ?assertEqual("open", rawpeer(N, "FFFFFFFF")),
    ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
    #{bad_frames := Bad1} = stats(N),
    ?assert(Bad1 >= Bad0 + 1).

%% A frame over max_frame whose first bytes are no control message at all
%% means the peer's stream is out of step: its length cannot be trusted to
%% skip by (it may come from junk, and then the next 4 GiB of good frames
%% would be passed over), so the connection closes as for a bad frame
%% within max_frame. Readable oversized frames are passed over
%% (actor_cnode_oversize_tests).
oversized_frame_whose_head_is_no_control_message_closes_the_connection(_Ctx) ->
    Alive = alive("ovhead"),
    {ok, Owner} = actor_cnode:start(#{exe => echo_exe(), name => Alive, max_frame => 65536}),
    try
        N = actor_cnode:node(Owner),
        #{oversized := Ov0, bad_frames := Bad0} = stats(N),
        %% 66000 bytes (0x101D0): 'q', then zeros (through a file: more
        %% hex than one argument may hold).
        ?assertEqual("closed", rawpeer_file(N, "000101D0" ++ "71" ++ lists:duplicate(65999 * 2, $0))),
        %% 4 junk bytes that read as a 1 MiB length, then good frames
        %% (ticks, enough to fill the 64 KiB head the node looks at): those
        %% frames would have been passed over with the junk.
        ?assertEqual("closed", rawpeer_file(N, "00100000" ++ lists:duplicate(17000 * 8, $0))),
        ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
        #{oversized := Ov1, bad_frames := Bad1} = stats(N),
        ?assertEqual({Ov0, Bad0 + 2}, {Ov1, Bad1})
    after
        ok = actor_cnode:stop(Owner),
        wait_until(fun() -> not lists:member(Alive, epmd_names()) end, 10000)
    end.

%% An exit signal whose reason is over max_frame: the reason lies inside
%% the control tuple, so the head the node keeps (64 KiB here) ends before
%% the control message does. That is a readable stream, not one out of
%% step: the frame is passed over and counted, and the connection stays.
an_exit_whose_reason_outgrows_the_head_is_passed_over(_Ctx) ->
    Alive = alive("ovexit"),
    {ok, Owner} = actor_cnode:start(#{exe => echo_exe(), name => Alive, max_frame => 65536}),
    try
        N = actor_cnode:node(Owner),
        {ok, P} = gen_server:call({echo, N}, spawn, ?CALL_TIMEOUT),
        #{oversized := Ov0, bad_frames := Bad0, connections := C0} = stats(N),
        exit(P, {big, binary:copy(<<"reason">>, 20000)}),
        ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
        #{oversized := Ov1, bad_frames := Bad1, connections := C1} = stats(N),
        ?assertEqual({Ov0 + 1, Bad0, C0}, {Ov1, Bad1, C1})
    after
        ok = actor_cnode:stop(Owner),
        wait_until(fun() -> not lists:member(Alive, epmd_names()) end, 10000)
    end.

%% 500 calls of 1 KiB at once from this node, which reads its replies, to
%% a node whose max_frame is 64 KiB (the smallest allowed): the replies pile up faster than one
%% write takes them, far past 4 * max_frame, and that is no sign of a peer
%% that stopped reading. Every call is answered on the same connection.
a_burst_of_calls_over_a_small_max_frame_is_all_answered(_Ctx) ->
    Alive = alive("burst"),
    {ok, Owner} = actor_cnode:start(#{exe => echo_exe(), name => Alive, max_frame => 65536}),
    try
        N = actor_cnode:node(Owner),
        ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
        #{connections := C0} = stats(N),
        Parent = self(),
        Bins = [<<I:32, (binary:copy(<<I:8>>, 1020))/binary>> || I <- lists:seq(1, 500)],
        Pids = [spawn_link(fun() ->
                               R = (catch gen_server:call({echo, N}, B, 30000)),
                               Parent ! {self(), R =:= B}
                           end) || B <- Bins],
        Answers = [receive {P, Ok} -> Ok after 60000 -> timeout end || P <- Pids],
        ?assertEqual(500, length([ok || true <- Answers])),
        %% Still the one connection it had.
        #{connections := C1} = stats(N),
        ?assertEqual(C0, C1)
    after
        ok = actor_cnode:stop(Owner),
        wait_until(fun() -> not lists:member(Alive, epmd_names()) end, 10000)
    end.

wrong_cookie_is_refused_right_cookie_accepted(#{node := N}) ->
    ?assertEqual(pang, ping_from_peer(N, "actor_pool_not_the_cookie")),
    ?assertEqual(pong, ping_from_peer(N, atom_to_list(erlang:get_cookie()))),
    ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)).

%% ===================================================================
%% The owner
%% ===================================================================

io_backend_is_the_one_requested(#{owner := Owner, node := N}) ->
    #{io := Io, status := up} = actor_cnode:info(Owner),
    #{io := StatsIo} = stats(N),
    ?assertEqual(Io, StatsIo),
    case os:getenv("ACTOR_POOL_IO") of
        Want when Want =:= "uring"; Want =:= "epoll" ->
            ?assertEqual(list_to_atom(Want), Io);
        _ ->
            ?assert(lists:member(Io, [uring, epoll]))
    end.

await_up_returns_ok_when_up(#{owner := Owner}) ->
    ?assertEqual(ok, actor_cnode:await_up(Owner, 1000)).

kill_9_fails_calls_fast_and_the_owner_restarts_it(_Ctx) ->
    %% A backoff of at least 1 s leaves an outage to call into.
    {ok, Owner} = actor_cnode:start(#{exe => echo_exe(), name => alive("kill"),
                                      backoff => #{min_ms => 2000, max_ms => 2000}}),
    try
        N = actor_cnode:node(Owner),
        #{os_pid := OsPid, status := up, restarts := R0} = actor_cnode:info(Owner),
        ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT)),
        _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
        wait_until(fun() -> maps:get(status, actor_cnode:info(Owner)) =:= down end,
                   5000),
        T0 = erlang:monotonic_time(millisecond),
        Reason = try gen_server:call({echo, N}, ping, 10000) of
                     Reply -> {replied, Reply}
                 catch
                     exit:{R, {gen_server, call, _}} -> R
                 end,
        Elapsed = erlang:monotonic_time(millisecond) - T0,
        ?assert(lists:member(Reason, [{nodedown, N}, noconnection])),
        ?assert(Elapsed < 1000),
        ?assertEqual(ok, actor_cnode:await_up(Owner, 15000)),
        wait_until(fun() ->
                           case actor_cnode:info(Owner) of
                               #{status := up, os_pid := New} -> New =/= OsPid;
                               _ -> false
                           end
                   end, 15000),
        #{restarts := R1} = actor_cnode:info(Owner),
        ?assert(R1 > R0),
        ?assertEqual(pong, gen_server:call({echo, N}, ping, ?CALL_TIMEOUT))
    after
        actor_cnode:stop(Owner)
    end.

stopping_the_owner_ends_the_os_process_and_epmd_entry(_Ctx) ->
    Alive = alive("stop"),
    Registered = list_to_atom(Alive ++ "_owner"),
    {ok, Owner} = actor_cnode:start(#{exe => echo_exe(), name => Alive,
                                      register => Registered}),
    ?assertEqual(Owner, whereis(Registered)),
    #{os_pid := OsPid, node := N, status := up} = actor_cnode:info(Registered),
    ?assert(lists:member(Alive, epmd_names())),
    ok = actor_cnode:stop(Registered),
    ?assertEqual(undefined, whereis(Registered)),
    wait_until(fun() -> not os_pid_alive(OsPid) end, 5000),
    wait_until(fun() -> not lists:member(Alive, epmd_names()) end, 5000),
    wait_until(fun() -> not lists:member(N, nodes(hidden)) end, 5000).

bad_options_are_badarg(_Ctx) ->
    E = echo_exe(),
    Children = length(supervisor:which_children(actor_cnode_sup)),
    Bad = [{not_a_map, {options, not_a_map}},
           {#{}, {exe, missing}},
           {#{exe => 42}, {exe, 42}},
           {#{exe => ""}, {exe, ""}},
           {#{exe => E, io => bogus}, {io, bogus}},
           {#{exe => E, max_frame => 0}, {max_frame, 0}},
           %% Below the floor: the library's own batches are capped to fit.
           {#{exe => E, max_frame => 65535}, {max_frame, 65535}},
           {#{exe => E, max_frame => 1024}, {max_frame, 1024}},
           {#{exe => E, idle_timeout_ms => -1}, {idle_timeout_ms, -1}},
           {#{exe => E, start_timeout_ms => 0}, {start_timeout_ms, 0}},
           {#{exe => E, stable_ms => soon}, {stable_ms, soon}},
           {#{exe => E, backoff => #{min_ms => 100, max_ms => 10}},
            {backoff, #{min_ms => 100, max_ms => 10}}},
           {#{exe => E, backoff => #{min_ms => 100, typo => 1}},
            {backoff, #{min_ms => 100, typo => 1}}},
           {#{exe => E, backoff => 100}, {backoff, 100}},
           {#{exe => E, name => "has@host"}, {name, "has@host"}},
           {#{exe => E, name => ""}, {name, ""}},
           {#{exe => E, args => [1, 2]}, {args, [1, 2]}},
           {#{exe => E, args => <<"x">>}, {args, <<"x">>}},
           {#{exe => E, register => "owner"}, {register, "owner"}},
           {#{exe => E, no_such_option => 1}, {no_such_option, 1}}],
    [begin
         ?assertEqual({error, {badarg, Expected}}, actor_cnode:start_link(Opts)),
         ?assertEqual({error, {badarg, Expected}}, actor_cnode:start(Opts))
     end || {Opts, Expected} <- Bad],
    ?assertEqual(Children, length(supervisor:which_children(actor_cnode_sup))).

missing_executable_fails_the_start(_Ctx) ->
    ?assertMatch({error, {cnode_start_failed, {no_executable, _}}},
                 actor_cnode:start_link(#{exe => "actor_no_such_node"})).

executable_that_exits_fails_the_start(_Ctx) ->
    %% start_link fails without killing its (non-trapping) caller, at
    %% once, not at the start timeout. Which of the two reasons depends on
    %% whether /bin/false's exit status reached the port before the owner
    %% wrote its configuration (else the write breaks the port: epipe).
    [?assert(exited_at_once(actor_cnode:Start(#{exe => "/bin/false",
                                                name => alive("false")})))
     || Start <- [start_link, start], _ <- lists:seq(1, 5)].

exited_at_once({error, {cnode_start_failed, {exit_status, 1}}}) -> true;
exited_at_once({error, {cnode_start_failed, {port_closed, epipe}}}) -> true;
exited_at_once(Other) -> error({not_an_early_exit, Other}).

executable_never_ready_is_killed_after_the_timeout(_Ctx) ->
    Dir = ap_test_util:temp_dir("actor_cnode_tests"),
    Script = filename:join(Dir, "never_ready"),
    PidFile = filename:join(Dir, "pid"),
    ok = file:write_file(Script, ["#!/bin/sh\necho $$ > '", PidFile, "'\n",
                                  "exec cat >/dev/null\n"]),
    ok = file:change_mode(Script, 8#755),
    try
        ?assertEqual({error, {cnode_start_failed, timeout}},
                     actor_cnode:start_link(#{exe => Script,
                                              name => alive("never"),
                                              start_timeout_ms => 300})),
        {ok, PidText} = file:read_file(PidFile),
        OsPid = binary_to_integer(string:trim(PidText)),
        wait_until(fun() -> not os_pid_alive(OsPid) end, 5000)
    after
        _ = file:del_dir_r(Dir)
    end.

%% ===================================================================
%% Helpers
%% ===================================================================

stats(N) ->
    Stats = gen_server:call({echo, N}, stats, ?CALL_TIMEOUT),
    ?assert(is_map(Stats)),
    Stats.

in_fresh_process(Fun) ->
    {Pid, Mref} = spawn_monitor(fun() -> exit({result, Fun()}) end),
    receive
        {'DOWN', Mref, process, Pid, {result, Result}} -> Result;
        {'DOWN', Mref, process, Pid, Reason} -> error({helper_failed, Reason})
    end.

%% Runs actor_rawpeer (a test executable), which handshakes with Node, writes the bytes and
%% reports whether Node closed the connection. Returns its last line.
rawpeer(Node, Hex) ->
    {Status, Out} = ap_test_util:rawpeer("actor_cnode_tests", fun(Cookie) -> [atom_to_list(Node), Cookie, Hex] end,
                                         15000),
    ?assertEqual(0, Status),
    lists:last(string:lexemes(binary_to_list(Out), "\r\n")).

rawpeer_file(Node, Hex) ->
    Dir = ap_test_util:temp_dir("actor_cnode_tests_hex"),
    HexFile = filename:join(Dir, "frame.hex"),
    ok = file:write_file(HexFile, Hex),
    try
        rawpeer(Node, "@" ++ HexFile)
    after
        _ = file:del_dir_r(Dir)
    end.


%% net_adm:ping(Node) from a fresh BEAM peer holding Cookie.
ping_from_peer(Node, Cookie) ->
    {ok, Peer, _PeerNode} =
        peer:start_link(#{name => peer:random_name(actor_pool_peer),
                          connection => standard_io,
                          args => ["-hidden", "-setcookie", Cookie]}),
    try
        peer:call(Peer, net_adm, ping, [Node], 15000)
    after
        peer:stop(Peer)
    end.
