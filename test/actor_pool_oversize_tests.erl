%% Messages and batches against a small `max_frame', from the library's
%% side: the application runs its pool node and its receptionist node with
%% a `max_frame' of 64 KiB (the floor).
%%
%% - tell/2 and ask/2,3 refuse a message that does not fit in a frame of
%%   the pool node before anything is sent: an ask gets
%%   `{error, {too_large, Size, Max}}', a tell is dropped and counted
%%   (actor_pool:oversized/0). Both by distribution (`fast_path => false')
%%   and on the ring path (a message too large for a ring record too); the
%%   pool's counters and the connection to the pool node show that nothing
%%   reached it.
%% - A huge term (a 10M-element list) on the ring path is refused or
%%   dropped the same way (that the caller's scheduler keeps running its
%%   other processes meanwhile, the term being neither encoded nor sized
%%   inside one NIF or BIF call, is a timing: bench/ap_wake_bench.erl).
%% - The library's own batches fit: tells from one process through the
%%   batcher (which then coalesces them) and a burst of registrations
%%   through the receptionist server all arrive.
%% - Another pool node's max_frame is learned (node_stats), and the pool
%%   node reports its node-wide `oversized' count.
%%
%% The executables are $ACTOR_POOL_NODE_EXE and $ACTOR_RECEPTIONIST_NODE_EXE
%% when set, with the I/O backend of ACTOR_POOL_IO. Every C node started here
%% is stopped, and no epmd name or shared-memory segment is left behind.
-module(actor_pool_oversize_tests).

-import(ap_test_util, [alive/1]).
-import(ap_support, [wait_until/2, epmd_names/0]).

-include_lib("eunit/include/eunit.hrl").

-export([ask_over_the_limit_by_distribution_is_refused_unsent/1,
         tell_over_the_limit_by_distribution_is_a_counted_drop/1,
         tell_drops_are_logged_at_most_once_a_second/1,
         ask_too_large_for_ring_and_frame_is_refused_unsent/1,
         tell_too_large_for_ring_and_frame_is_a_counted_drop/1,
         huge_term_is_refused_as_too_large/1,
         a_message_under_the_limit_still_goes/1,
         tells_of_1_kib_in_batches_are_all_processed/1,
         receptionist_burst_of_1000_registrations_loses_none/1,
         another_pool_nodes_max_frame_is_learned/1,
         pool_node_counts_oversized_frames_in_node_stats/1]).

-define(MAX_FRAME, 65536).
%% A frame's envelope (actor_pool_int.hrl, FRAME_ENVELOPE).
-define(ENVELOPE, 8192).
-define(MAX_MSG, (?MAX_FRAME - ?ENVELOPE)).
-define(WAIT_MS, 30000).
%% logger handler callback: passes on actor_pool's oversized-tell lines.
-export([log/2]).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_pool_oversize_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [ask_over_the_limit_by_distribution_is_refused_unsent,
                          tell_over_the_limit_by_distribution_is_a_counted_drop,
                          tell_drops_are_logged_at_most_once_a_second,
                          ask_too_large_for_ring_and_frame_is_refused_unsent,
                          tell_too_large_for_ring_and_frame_is_a_counted_drop,
                          huge_term_is_refused_as_too_large,
                          a_message_under_the_limit_still_goes,
                          tells_of_1_kib_in_batches_are_all_processed,
                          receptionist_burst_of_1000_registrations_loses_none,
                          another_pool_nodes_max_frame_is_learned,
                          pool_node_counts_oversized_frames_in_node_stats]]
     end}.

-define(ENV, [{max_frame, ?MAX_FRAME}, {receptionist_shm_mb, 16},
              %% every tell goes through a batcher, which coalesces them
              {batch_idle_us, infinity}]).

setup() ->
    Old = ap_test_util:set_env(?ENV),
    WasAlive = ap_test_util:start_app(),
    ok = wait_until(fun() -> actor_pool:pool_node() =/= undefined
                                 andalso actor_receptionist:receptionist_node() =/= undefined
                    end, ?WAIT_MS),
    #{was_alive => WasAlive, old => Old, pool_node => actor_pool:pool_node()}.

cleanup(#{was_alive := WasAlive, old := Old}) ->
    ap_test_util:stop_app(WasAlive),
    ap_test_util:restore_env(Old).

%% ===================================================================
%% Cases: refused before anything is sent
%% ===================================================================

ask_over_the_limit_by_distribution_is_refused_unsent(#{pool_node := PN}) ->
    {ok, _} = actor_pool:start_pool(ov_ask_dist, echo, #{workers => 1, fast_path => false}),
    {ok, <<"warm">>} = actor_pool:ask(ov_ask_dist, <<"warm">>),
    Before = snapshot(ov_ask_dist, PN),
    #{asks := A0} = actor_pool:oversized(),
    %% A binary: its bytes and a 6-byte header.
    Bin = binary:copy(<<"x">>, ?MAX_FRAME),
    ?assertEqual({error, {too_large, ?MAX_FRAME + 6, ?MAX_MSG}}, actor_pool:ask(ov_ask_dist, Bin)),
    %% Any other term: its external size.
    Term = {big, lists:seq(1, 20000)},
    ?assertEqual({error, {too_large, erlang:external_size(Term), ?MAX_MSG}},
                 actor_pool:ask(ov_ask_dist, Term, 5000)),
    ?assertMatch(#{asks := A1} when A1 =:= A0 + 2, actor_pool:oversized()),
    %% Nothing reached the pool; the connection is the one it was.
    ?assertEqual(Before, snapshot(ov_ask_dist, PN)),
    {ok, <<"after">>} = actor_pool:ask(ov_ask_dist, <<"after">>),
    ok = actor_pool:stop_pool(ov_ask_dist).

tell_over_the_limit_by_distribution_is_a_counted_drop(#{pool_node := PN}) ->
    {ok, _} = actor_pool:start_pool(ov_tell_dist, echo, #{workers => 1, fast_path => false}),
    {ok, <<"warm">>} = actor_pool:ask(ov_tell_dist, <<"warm">>),
    Before = snapshot(ov_tell_dist, PN),
    #{tells := T0} = actor_pool:oversized(),
    ok = actor_pool:tell(ov_tell_dist, binary:copy(<<"x">>, ?MAX_FRAME)),
    ok = actor_pool:tell(ov_tell_dist, {big, lists:seq(1, 20000)}),
    ?assertMatch(#{tells := T1} when T1 =:= T0 + 2, actor_pool:oversized()),
    ?assertEqual(Before, snapshot(ov_tell_dist, PN)),
    ok = actor_pool:stop_pool(ov_tell_dist).

%% Oversized tells, 20 ms apart, until a line is logged (the limit allows
%% one a second, so one comes within about a second): every one counted,
%% at most one line per second begun, naming the pool, the size, the limit.
tell_drops_are_logged_at_most_once_a_second(_Ctx) ->
    {ok, _} = actor_pool:start_pool(ov_tell_log, echo, #{workers => 1, fast_path => false}),
    Handler = ov_tell_log_handler,
    ok = logger:add_handler(Handler, ?MODULE, #{level => all, config => #{pid => self()}}),
    try
        #{tells := T0} = actor_pool:oversized(),
        Start = erlang:monotonic_time(millisecond),
        N = tell_until_logged(binary:copy(<<"x">>, ?MAX_FRAME), Start + 5000, 0),
        Elapsed = erlang:monotonic_time(millisecond) - Start,
        ?assertMatch(#{tells := T1} when T1 =:= T0 + N, actor_pool:oversized()),
        Lines = drain_lines([]),
        ?assert(length(Lines) >= 1),
        ?assert(length(Lines) =< Elapsed div 1000 + 2),
        [Line | _] = Lines,
        [?assertNotEqual(nomatch, string:find(Line, S))
         || S <- ["ov_tell_log", integer_to_list(?MAX_FRAME + 6) ++ " bytes",
                  "at most " ++ integer_to_list(?MAX_MSG)]]
    after
        ok = logger:remove_handler(Handler)
    end,
    ok = actor_pool:stop_pool(ov_tell_log).

tell_until_logged(Msg, Deadline, N) ->
    ok = actor_pool:tell(ov_tell_log, Msg),
    receive
        {ov_line, _} = Line -> self() ! Line, N + 1
    after 20 ->
        case erlang:monotonic_time(millisecond) < Deadline of
            true -> tell_until_logged(Msg, Deadline, N + 1);
            false -> error(no_log_line)
        end
    end.

drain_lines(Acc) ->
    receive {ov_line, L} -> drain_lines([L | Acc])
    after 0 -> lists:reverse(Acc)
    end.

log(#{meta := #{actor_pool := oversized_tell}, msg := {F, A}}, #{config := #{pid := Pid}}) ->
    Pid ! {ov_line, lists:flatten(io_lib:format(F, A))},
    ok;
log(_Event, _Config) ->
    ok.

%% A 4 MiB binary fits in no request ring record (the NIF says too_large)
%% nor in a frame of 64 KiB.
ask_too_large_for_ring_and_frame_is_refused_unsent(#{pool_node := PN}) ->
    {ok, _} = actor_pool:start_pool(ov_ask_ring, echo, #{workers => 1}),
    {ok, <<"warm">>} = actor_pool:ask(ov_ask_ring, <<"warm">>),
    ?assertMatch(#{by_path := #{ring := R}} when R > 0, actor_pool:stats(ov_ask_ring)),
    Before = snapshot(ov_ask_ring, PN),
    #{counters := #{too_large := Ring0}} = actor_pool_dp:info(),
    Big = 4 * 1024 * 1024,
    ?assertEqual({error, {too_large, Big + 6, ?MAX_MSG}},
                 actor_pool:ask(ov_ask_ring, binary:copy(<<"x">>, Big))),
    %% The ring refused it first.
    ?assertMatch(#{counters := #{too_large := Ring1}} when Ring1 > Ring0, actor_pool_dp:info()),
    ?assertEqual(Before, snapshot(ov_ask_ring, PN)),
    ok = actor_pool:stop_pool(ov_ask_ring).

tell_too_large_for_ring_and_frame_is_a_counted_drop(#{pool_node := PN}) ->
    {ok, _} = actor_pool:start_pool(ov_tell_ring, echo, #{workers => 1}),
    {ok, <<"warm">>} = actor_pool:ask(ov_tell_ring, <<"warm">>),
    Before = snapshot(ov_tell_ring, PN),
    #{tells := T0} = actor_pool:oversized(),
    ok = actor_pool:tell(ov_tell_ring, binary:copy(<<"x">>, 4 * 1024 * 1024)),
    ?assertMatch(#{tells := T1} when T1 =:= T0 + 1, actor_pool:oversized()),
    ?assertEqual(Before, snapshot(ov_tell_ring, PN)),
    ok = actor_pool:stop_pool(ov_tell_ring).

%% An ask and a tell of a 10M-element list (about 50 MB encoded) to a ring
%% pool: refused and dropped as too large, counted once each, and nothing
%% reaches the pool. (That the caller's scheduler is not held meanwhile is
%% a timing: bench/ap_wake_bench.erl measures it.) The list is a
%% persistent term, so that no garbage collection of the caller copies it
%% during the run.
huge_term_is_refused_as_too_large(#{pool_node := PN}) ->
    {ok, _} = actor_pool:start_pool(ov_huge, echo, #{workers => 1}),
    {ok, <<"warm">>} = actor_pool:ask(ov_huge, <<"warm">>),
    ?assertMatch(#{by_path := #{ring := R}} when R > 0, actor_pool:stats(ov_huge)),
    Key = {?MODULE, huge},
    persistent_term:put(Key, lists:seq(1, 10000000)),
    try
        Huge = persistent_term:get(Key),
        Size = erlang:external_size(Huge),
        Before = snapshot(ov_huge, PN),
        #{tells := T0, asks := A0} = actor_pool:oversized(),
        #{counters := #{too_large := Ring0}} = actor_pool_dp:info(),
        ?assertEqual({error, {too_large, Size, ?MAX_MSG}}, actor_pool:ask(ov_huge, Huge, 30000)),
        ?assertEqual(ok, actor_pool:tell(ov_huge, Huge)),
        ?assertMatch(#{tells := T1, asks := A1} when T1 =:= T0 + 1 andalso A1 =:= A0 + 1,
                     actor_pool:oversized()),
        %% The ring refused both first; nothing reached the pool.
        ?assertMatch(#{counters := #{too_large := Ring1}} when Ring1 =:= Ring0 + 2, actor_pool_dp:info()),
        ?assertEqual(Before, snapshot(ov_huge, PN))
    after
        _ = persistent_term:erase(Key)
    end,
    ok = actor_pool:stop_pool(ov_huge).


%% Just under the limit, by distribution, and a term whose cheap bound is
%% over it while its exact size is not (atoms are bounded by their
%% external size, lists of small integers are STRING_EXT): both go.
a_message_under_the_limit_still_goes(_Ctx) ->
    {ok, _} = actor_pool:start_pool(ov_under, echo, #{workers => 1, fast_path => false}),
    Bin = binary:copy(<<"y">>, ?MAX_MSG - 6),
    ?assertEqual({ok, Bin}, actor_pool:ask(ov_under, Bin)),
    Str = lists:duplicate(30000, $a),
    ?assert(erlang:external_size(Str) =< ?MAX_MSG),
    ?assertEqual({ok, Str}, actor_pool:ask(ov_under, Str)),
    ok = actor_pool:stop_pool(ov_under).

%% ===================================================================
%% Cases: the library's own batches fit in a frame
%% ===================================================================

%% 300 tells of 1 KiB from one process by distribution: the batcher
%% coalesces them (batch_idle_us is infinity) into batches that each fit.
tells_of_1_kib_in_batches_are_all_processed(_Ctx) ->
    {ok, _} = actor_pool:start_pool(ov_batch, echo, #{workers => 1, fast_path => false}),
    {ok, _} = actor_pool:ask(ov_batch, warm),
    #{processed := P0} = actor_pool:stats(ov_batch),
    Payload = binary:copy(<<"y">>, 1024),
    [ok = actor_pool:tell(ov_batch, {I, Payload}) || I <- lists:seq(1, 300)],
    %% Kept in order with the tells: answered after all of them.
    ?assertEqual({ok, barrier}, actor_pool:ask(ov_batch, barrier, 10000)),
    #{processed := P1} = actor_pool:stats(ov_batch),
    ?assertEqual(301, P1 - P0),
    ok = actor_pool:stop_pool(ov_batch).

%% 1000 acknowledged registrations of 200-byte keys in one burst: the
%% receptionist server's {batch, Msgs} messages each fit.
receptionist_burst_of_1000_registrations_loses_none(_Ctx) ->
    ok = ap_test_util:rcpt_barrier(),
    Ref = spawn(fun() -> receive stop -> ok end end),
    Keys = [iolist_to_binary([io_lib:format("ov~6..0b_", [I]), binary:copy(<<"k">>, 191)])
            || I <- lists:seq(1, 1000)],
    ?assertEqual(200, byte_size(hd(Keys))),
    [ok = actor_receptionist:register(K, Ref, self()) || K <- Keys],
    Acked = [receive {registered, {service_key, K}, Ref} -> K
             after ?WAIT_MS -> error({no_ack, K})
             end || K <- Keys],
    ?assertEqual(1000, length(Acked)),
    ?assertEqual([], [K || K <- Keys, actor_receptionist:lookup(K) =/= [Ref]]),
    [ok = actor_receptionist:deregister(K, Ref, self()) || K <- Keys],
    [receive {deregistered, {service_key, K}, Ref} -> ok
     after ?WAIT_MS -> error({no_deregister_ack, K})
     end || K <- Keys],
    Ref ! stop.

%% ===================================================================
%% Cases: another pool node; node_stats
%% ===================================================================

%% A standalone pool node with a max_frame of 128 KiB: learned from it, not
%% taken from this node's own pool node.
another_pool_nodes_max_frame_is_learned(_Ctx) ->
    Alive = alive("ovother"),
    {ok, Owner} = actor_cnode:start(#{exe => os:getenv("ACTOR_POOL_NODE_EXE", "actor_pool_node"),
                                      name => Alive, max_frame => 2 * ?MAX_FRAME}),
    try
        Other = actor_cnode:node(Owner),
        {ok, _} = actor_pool:start_pool(ov_other, echo, #{node => Other, workers => 1,
                                                          fast_path => false}),
        Pool = {ov_other, Other},
        ?assertMatch(#{max_frame := 131072}, actor_pool:node_stats(Other)),
        %% Over this node's own limit, under the other's: it goes.
        Mid = binary:copy(<<"m">>, ?MAX_FRAME + 1000),
        ?assertEqual({ok, Mid}, actor_pool:ask(Pool, Mid)),
        ?assertEqual({error, {too_large, 2 * ?MAX_FRAME + 6, 2 * ?MAX_FRAME - ?ENVELOPE}},
                     actor_pool:ask(Pool, binary:copy(<<"m">>, 2 * ?MAX_FRAME))),
        ok = actor_pool:stop_pool(Pool)
    after
        ok = actor_cnode:stop(Owner),
        wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS)
    end.

%% A call that bypasses the library (a plain gen_server:call) over the
%% pool node's max_frame: answered {error, too_large} by the pool node,
%% and counted in its node_stats.
pool_node_counts_oversized_frames_in_node_stats(#{pool_node := PN}) ->
    {ok, Pid} = actor_pool:start_pool(ov_stats, echo, #{workers => 1, fast_path => false}),
    #{oversized := O0, max_frame := ?MAX_FRAME, io := Io, connections := C} =
        actor_pool:node_stats(PN),
    ?assert(is_atom(Io) andalso C >= 1),
    ?assertEqual({error, too_large},
                 gen_server:call(Pid, binary:copy(<<"z">>, 2 * ?MAX_FRAME), 10000)),
    ?assertMatch(#{oversized := O1} when O1 =:= O0 + 1, actor_pool:node_stats(PN)),
    ok = actor_pool:stop_pool(ov_stats).

%% ===================================================================
%% Helpers
%% ===================================================================

%% What shows that nothing reached the pool: its counters (processed, per
%% transport), and the id of the connection to its pool node.
snapshot(Pool, PN) ->
    #{processed := P} = S = actor_pool:stats(Pool),
    {P, maps:get(by_path, S, none), connection_id(PN)}.

connection_id(Node) ->
    {Node, #{connection_id := Id}} = lists:keyfind(Node, 1, erlang:nodes(hidden, #{connection_id => true})),
    Id.
