%% The data plane NIF (actor_dp) against real peers.
%%
%% - The pool-node end of c_src/test/dp_peer.c (actor_dp_peer, a test executable):
%%   the real ring library, driven over its stdin (pause, answer modes,
%%   refuse), so the cases that need a misbehaving or stalled pool node can
%%   have one: replies that are no term or lie about their length, a full
%%   request ring, a kill -9 with asks pending.
%% - The pool node itself (actor_dp_pool_node_test_): the application's
%%   pool node, attached through its manager's dp_info, asks and tells to
%%   an echo pool, the node killed under pending asks.
%%
%% Every peer is stopped by its OS pid and checked gone.
-module(actor_dp_tests).

-import(ap_test_util, [with_pool/4, crash_plugin/0]).

-include_lib("eunit/include/eunit.hrl").

-export([asks_are_answered_with_their_ref/1,
         tells_stats_and_consumed/1,
         unknown_pool_is_noproc/1,
         cancel_before_the_reply_means_no_message/1,
         cancel_after_the_reply_is_false_and_late_replies_are_dropped/1,
         cancel_racing_the_reply_thread_leaves_nothing_behind/1,
         cancel_racing_a_deliverer_leaves_nothing_behind/1,
         timeouts_kept_by_the_nif_answer_once_never_early/1,
         an_ask_whose_caller_died_is_dropped_at_its_timeout/1,
         close_answers_every_pending_ask_at_once/1,
         peer_killed_answers_pending_asks_promptly/1,
         bad_replies_are_errors_not_crashes/1,
         new_atoms_in_answers_stop_at_the_segments_allowance/1,
         scribbled_reply_ring_closes_with_bad_segment/1,
         scribbling_anywhere_never_crashes/1,
         full_ring_and_too_large/1,
         large_terms_are_left_to_the_caller_to_encode/1,
         hostile_encoded_messages_are_badarg/1,
         owner_exit_closes_the_segment/1,
         refused_and_failed_attaches/1,
         segments_are_freed_no_fd_leaks/1,
         bad_arguments_are_badarg/1,
         many_answers_in_a_row_arrive_whole/1,
         await_takes_a_lone_asks_answer_once/1,
         await_is_none_unless_the_ask_is_alone/1,
         await_after_close_or_cancel_is_none/1,
         await_answers_bad_replies_as_errors/1,
         awaiting_and_waiting_askers_get_every_answer_once/1,
         await_leaves_large_answers_and_others_asks_alone/1,
         pool_node_answers_asks_tells_and_stats/1,
         pool_node_cancel_and_close_leave_no_reply_behind/1,
         pool_node_scribbled_segment_is_errors_not_crashes/1,
         pool_node_killed_answers_64_pending_asks_promptly/1,
         child_upgrade/0]).

-define(T, 5000).

%% ===================================================================
%% Against actor_dp_peer
%% ===================================================================

actor_dp_peer_test_() ->
    [{atom_to_list(Name), {timeout, 60, fun() -> with_peer(Name) end}}
      || Name <- [asks_are_answered_with_their_ref,
                  tells_stats_and_consumed,
                  unknown_pool_is_noproc,
                  cancel_before_the_reply_means_no_message,
                  cancel_after_the_reply_is_false_and_late_replies_are_dropped,
                  cancel_racing_the_reply_thread_leaves_nothing_behind,
                  cancel_racing_a_deliverer_leaves_nothing_behind,
                  timeouts_kept_by_the_nif_answer_once_never_early,
                  an_ask_whose_caller_died_is_dropped_at_its_timeout,
                  close_answers_every_pending_ask_at_once,
                  peer_killed_answers_pending_asks_promptly,
                  bad_replies_are_errors_not_crashes,
                  new_atoms_in_answers_stop_at_the_segments_allowance,
                  scribbled_reply_ring_closes_with_bad_segment,
                  scribbling_anywhere_never_crashes,
                  full_ring_and_too_large,
                  large_terms_are_left_to_the_caller_to_encode,
                  hostile_encoded_messages_are_badarg,
                  owner_exit_closes_the_segment,
                  refused_and_failed_attaches,
                  segments_are_freed_no_fd_leaks,
                  bad_arguments_are_badarg,
                  many_answers_in_a_row_arrive_whole,
                  await_takes_a_lone_asks_answer_once,
                  await_is_none_unless_the_ask_is_alone,
                  await_after_close_or_cancel_is_none,
                  await_answers_bad_replies_as_errors,
                  awaiting_and_waiting_askers_get_every_answer_once,
                  await_leaves_large_answers_and_others_asks_alone]].

%% The peer's port belongs to the process that runs the case.
with_peer(Name) ->
    P = peer_start(),
    try ?MODULE:Name(P)
    after peer_stop(P)
    end.

%% ===================================================================
%% Against the pool node the application starts
%% ===================================================================

actor_dp_pool_node_test_() ->
    {setup, fun pool_setup/0, fun pool_cleanup/1,
     fun(Ctx) ->
             [{atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}
              || Name <- [pool_node_answers_asks_tells_and_stats,
                          pool_node_cancel_and_close_leave_no_reply_behind,
                          pool_node_scribbled_segment_is_errors_not_crashes,
                          %% last: the node restarts afterwards
                          pool_node_killed_answers_64_pending_asks_promptly]]
     end}.

%% A hot upgrade that brings a new actor_dp.so (another file, as a release
%% upgrade does), then a purge of the old code, while a segment is open:
%% its reply thread still runs the old library, so the VM must not unmap
%% it. In a child VM: the failure is a crash of the VM.
upgrade_with_open_segment_keeps_the_vm_test_() ->
    {timeout, 60, fun() ->
        Dir = ap_test_util:temp_dir("dp_upgrade"),
        So = case os:getenv("ACTOR_DP_NIF") of
                 P when is_list(P), P =/= "" -> P;
                 _ -> filename:join(ap_test_util:priv_dir(), "actor_dp.so")
             end,
        try
            [begin
                 ok = file:make_dir(filename:join(Dir, D)),
                 {ok, _} = file:copy(So, filename:join([Dir, D, "actor_dp.so"]))
             end || D <- ["a", "b"]],
            {Status, Out} = child_vm("child_upgrade", [{"AP_DP_UPGRADE_DIR", Dir}]),
            ?assertEqual({0, true}, {Status, string:find(Out, "alive") =/= nomatch})
        after
            _ = file:del_dir_r(Dir)
        end
    end}.

%% Tells published right before an orderly close/2 are read by the pool
%% node, whichever it notices first: the BEAM's closed bit or the
%% socket's EOF.
tells_before_close_are_not_dropped_test_() ->
    {setup, fun ap_test_util:start_app/0, fun ap_test_util:stop_app/1,
     {timeout, 120, fun() ->
        N = actor_pool:pool_node(),
        {ok, P} = actor_pool:start_pool(dp_close, echo, #{workers => 2}),
        try
            Count = fun(R0) -> #{by_path := #{ring := R}} = actor_pool:stats(P), R - R0 end,
            Lost = [begin
                        {ok, #{socket := Sock, token := Token}} = gen_server:call({actor_pool_node, N}, dp_info),
                        {ok, Seg} = actor_dp:open(Sock, Token, #{node => N, req_rings => 1}),
                        #{by_path := #{ring := R0}} = actor_pool:stats(P),
                        [{ok, _} = actor_dp:submit(Seg, tell, dp_close, {t, K}, undefined, undefined)
                         || K <- lists:seq(1, 200)],
                        ok = actor_dp:close(Seg, done),
                        _ = catch ap_support:wait_until(fun() -> Count(R0) =:= 200 end, 2000),
                        200 - Count(R0)
                    end || _ <- lists:seq(1, 30)],
            ?assertEqual([], [L || L <- Lost, L =/= 0])
        after
            actor_pool:stop_pool(P)
        end
     end}}.

-spec child_upgrade() -> ok.
child_upgrade() ->
    Dir = os:getenv("AP_DP_UPGRADE_DIR"),
    os:putenv("ACTOR_DP_NIF", filename:join([Dir, "a", "actor_dp.so"])),
    {module, actor_dp} = code:ensure_loaded(actor_dp),
    P = peer_start(),
    try
        Seg = open(P, #{}),
        os:putenv("ACTOR_DP_NIF", filename:join([Dir, "b", "actor_dp.so"])),
        {module, actor_dp} = code:load_file(actor_dp),
        _ = code:purge(actor_dp),
        Ref = make_ref(),
        {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, hi, Ref, undefined)),
        receive {Ref, {ok, hi}} -> ok after ?T -> error(no_answer) end,
        ok = actor_dp:close(Seg, done)
    after
        peer_stop(P)
    end,
    io:format("alive~n").

child_vm(Fun, Env) ->
    Erl = os:find_executable("erl"),
    Paths = lists:append([["-pa", filename:dirname(code:which(M))] || M <- [actor_dp, ?MODULE, ap_test_util, ap_support]]),
    Port = open_port({spawn_executable, Erl},
                     [{args, ["+S", "2", "-noshell"] ++ Paths ++
                           ["-eval", atom_to_list(?MODULE) ++ ":" ++ Fun ++ "(), halt()."]},
                      {env, Env}, exit_status, stderr_to_stdout, binary]),
    child_collect(Port, []).

child_collect(Port, Acc) ->
    receive
        {Port, {data, D}} -> child_collect(Port, [Acc, D]);
        {Port, {exit_status, S}} -> {S, binary_to_list(iolist_to_binary(Acc))}
    after 50000 -> error(child_hung)
    end.

nif_is_loaded_test() ->
    ?assert(actor_dp:loaded()),
    %% under make eunit-asan: the sanitized build is the one mapped
    case os:getenv("ACTOR_DP_NIF") of
        Path when is_list(Path), Path =/= "" ->
            {ok, Maps} = file:read_file("/proc/self/maps"),
            ?assertMatch({_, _}, binary:match(Maps, list_to_binary(Path)));
        _ ->
            ok
    end.

asks_are_answered_with_their_ref(P) ->
    Seg = open(P, #{req_rings => 1}),
    Node = atom_to_binary(node(), utf8),
    expect(P, <<"attached ", Node/binary>>),
    Msgs = [<<"bin">>, {a, tuple, [1, 2.5, "str"]}, <<>>, binary:copy(<<7>>, 100000), self()],
    Refs = [begin
                Ref = make_ref(),
                {ok, 0, Id} = asked(actor_dp:submit(Seg, ask, echo, M, Ref, undefined)),
                ?assert(is_integer(Id)),
                {Ref, M}
            end || M <- Msgs],
    [receive {Ref, R} -> ?assertEqual({ok, M}, R) after ?T -> error({no_reply, M}) end
     || {Ref, M} <- Refs],
    #{asks := 5, replies := 5, pending := 0, late := 0, bad_records := 0, state := open,
      req_rings := 1, rep_rings := 2} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

tells_stats_and_consumed(P) ->
    %% Bound to one scheduler, so that both submits below take the same
    %% request ring (a ring per scheduler thread).
    Old = process_flag(scheduler, 1),
    try tells_stats_and_consumed_bound(P)
    after process_flag(scheduler, Old)
    end.

tells_stats_and_consumed_bound(P) ->
    Seg = open(P, #{req_rings => 2}),
    %% A ticket is the ring the record went to; a mark, where a ring ends.
    {ok, R1} = actor_dp:submit(Seg, tell, echo, <<"t1">>, undefined, undefined),
    M1 = actor_dp:mark(Seg, R1),
    {ok, R1} = actor_dp:submit(Seg, tell, self(), {t, 2}, undefined, R1),
    M2 = actor_dp:mark(Seg, R1),
    {R1, Pos1} = untk(M1),
    {R1, Pos2} = untk(M2),
    ?assert(Pos2 > Pos1),
    R1B = integer_to_binary(R1),
    expect(P, <<"tell 1 ring ", R1B/binary, " fence none">>),
    %% the same ring as the ticket: no fence needed
    expect(P, <<"tell 2 ring ", R1B/binary, " fence none">>),
    ap_support:wait_until(fun() -> actor_dp:consumed(Seg, M2) end, ?T),
    Ref = make_ref(),
    {ok, _, _} = actor_dp:submit(Seg, stats, echo, undefined, Ref, R1),
    receive {Ref, Stats} -> ?assertEqual(#{tells => 2, asks => 0}, Stats)
    after ?T -> error(no_stats)
    end,
    #{tells := 2, stats := 1} = actor_dp:info(Seg),
    %% a ticket of the other ring (the caller moved): the record carries a
    %% fence to where that ring ends now (nothing was written there: 0)
    Other = 1 - R1,
    {ok, R1} = actor_dp:submit(Seg, tell, echo, <<"t3">>, undefined, Other),
    expect(P, iolist_to_binary(["tell 3 ring ", R1B, " fence ", integer_to_binary(Other), " 0"])),
    %% a mark past where the ring ends (none of ours): read as that end
    M3 = actor_dp:mark(Seg, R1),
    {R1, Pos3} = untk(M3),
    ap_support:wait_until(fun() -> actor_dp:consumed(Seg, tk(R1, Pos3 + 1000000)) end, ?T),
    ?assert(actor_dp:consumed(Seg, M3)),
    ok = actor_dp:close(Seg, done),
    closed = actor_dp:consumed(Seg, M2),
    closed = actor_dp:mark(Seg, R1),
    closed = actor_dp:submit(Seg, tell, echo, <<"late">>, undefined, R1).

unknown_pool_is_noproc(P) ->
    Seg = open(P, #{}),
    Ref = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, no_such_pool, hi, Ref, undefined)),
    receive {Ref, R} -> ?assertEqual({error, noproc}, R) after ?T -> error(no_reply) end,
    ok = actor_dp:close(Seg, done).

cancel_before_the_reply_means_no_message(P) ->
    Seg = open(P, #{}),
    cmd(P, "pause"),
    Ref = make_ref(),
    {ok, _, Id} = asked(actor_dp:submit(Seg, ask, echo, hi, Ref, undefined)),
    ?assert(actor_dp:cancel(Seg, Id)),
    ?assertNot(actor_dp:cancel(Seg, Id)),
    cmd(P, "resume"),
    %% The reply comes and is dropped: counted late, never sent.
    ap_support:wait_until(fun() -> maps:get(late, actor_dp:info(Seg)) =:= 1 end, ?T),
    receive {Ref, _} = Late -> error({late_reply_delivered, Late}) after 0 -> ok end,
    ok = actor_dp:close(Seg, done).

cancel_after_the_reply_is_false_and_late_replies_are_dropped(P) ->
    Seg = open(P, #{}),
    cmd(P, "mode twice"),
    Ref = make_ref(),
    {ok, _, Id} = asked(actor_dp:submit(Seg, ask, echo, hi, Ref, undefined)),
    receive {Ref, {ok, hi}} -> ok after ?T -> error(no_reply) end,
    ?assertNot(actor_dp:cancel(Seg, Id)),
    ap_support:wait_until(fun() -> maps:get(late, actor_dp:info(Seg)) =:= 1 end, ?T),
    receive {Ref, _} = Twice -> error({second_reply_delivered, Twice}) after 0 -> ok end,
    #{replies := 1} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

%% A timeout the NIF keeps ({Ref, TimeoutMs}): the ask is answered
%% {error, timeout} once, never before its time, and the reply that comes
%% later is dropped (counted late); an ask with a longer timeout is left
%% alone and answered when its reply comes.
timeouts_kept_by_the_nif_answer_once_never_early(P) ->
    Seg = open(P, #{}),
    cmd(P, "pause"),
    Asks = [begin
                {Ref, T0} = timed_ask(Seg, T, T),
                {Ref, T, T0}
            end || T <- [1, 5, 20, 60]],
    {Long, _} = timed_ask(Seg, long, 60000),
    [receive
         {Ref, R} ->
             Waited = erlang:monotonic_time(microsecond) - T0,
             ?assertEqual({error, timeout}, R),
             %% 2% slack: the VM's monotonic time may run up to 1%
             %% off the OS clock the NIF's deadlines are on
             ?assert(Waited >= T * 980, {early, T, Waited})
     after ?T -> error({no_timeout, T})
     end || {Ref, T, T0} <- Asks],
    ?assertMatch(#{timeouts := 4, pending := 1}, actor_dp:info(Seg)),
    cmd(P, "resume"),
    receive {Long, L} -> ?assertEqual({ok, long}, L) after ?T -> error(no_reply) end,
    ap_support:wait_until(fun() -> maps:get(late, actor_dp:info(Seg)) =:= 4 end, ?T),
    receive {_, _} = Late -> error({late_reply_delivered, Late}) after 0 -> ok end,
    ?assertMatch(#{timeouts := 4, pending := 0, replies := 1}, actor_dp:info(Seg)),
    %% a timeout is 1..4294967295 ms beside a reference
    [?assertError(badarg, asked(actor_dp:submit(Seg, ask, echo, hi, Bad, undefined)))
     || Bad <- [{make_ref(), 0}, {make_ref(), -1}, {make_ref(), 1 bsl 32}, {not_a_ref, 5},
                {make_ref(), 5, x}]],
    ok = actor_dp:close(Seg, done).

%% An ask of Msg whose timeout of T ms the NIF keeps: {Ref, when it was
%% submitted (us)}.
timed_ask(Seg, Msg, T) ->
    Ref = make_ref(),
    T0 = erlang:monotonic_time(microsecond),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, Msg, {Ref, T}, undefined)),
    {Ref, T0}.

%% An ask whose caller exited is not kept past its timeout: its entry goes
%% (pending 0), with no reply ever sent.
an_ask_whose_caller_died_is_dropped_at_its_timeout(P) ->
    Seg = open(P, #{}),
    cmd(P, "mode silent"),
    {Pid, Mref} = spawn_monitor(fun() -> timed_ask(Seg, hi, 30) end),
    receive {'DOWN', Mref, process, Pid, normal} -> ok after ?T -> error(asker_stuck) end,
    ap_support:wait_until(fun() -> maps:get(pending, actor_dp:info(Seg)) =:= 0 end, ?T),
    ?assertMatch(#{timeouts := 1, replies := 0}, actor_dp:info(Seg)),
    ok = actor_dp:close(Seg, done).

%% Cancels timed to meet the reply thread at any point of its delivery
%% (it sends outside the ask table's lock): a cancel that answers false
%% finds the answer already in the mailbox, one that answers true never
%% gets it, and every answer is counted once (delivered or late).
cancel_racing_the_reply_thread_leaves_nothing_behind(P) ->
    Seg = open(P, #{}),
    rand:seed(exsss, {13, 15, 2026}),
    _ = cancel_race(Seg, 3000, fun(K) -> K end),
    ok = actor_dp:close(Seg, done).

%% The same race against a deliverer process (actor_dp_deliverer's part,
%% played here by a process of the test registered for every index): it
%% sends answers from a scheduler, outside the ask table's lock, and a
%% cancel that misses the entry must still find the answer sent. Answers
%% of 400 bytes: each alone is enough for the reply thread to hand its
%% ring over.
cancel_racing_a_deliverer_leaves_nothing_behind(P) ->
    Seg = open(P, #{}),
    Count = actor_dp_deliverer:count(),
    Self = self(),
    Dlv = spawn_link(fun() ->
                             [ok = actor_dp:deliver_for(I, Count) || I <- lists:seq(0, Count - 1)],
                             Self ! {registered, self()},
                             drain_loop()
                     end),
    receive {registered, Dlv} -> ok after ?T -> error(deliverer_not_registered) end,
    try
        rand:seed(exsss, {17, 15, 2026}),
        #{sched_delivered := D0} = actor_dp:info(Seg),
        {Sent, _} = cancel_race(Seg, 3000, fun(K) -> <<K:32, 0:(396 * 8)>> end),
        #{sched_delivered := D1} = actor_dp:info(Seg),
        %% Most answers that were sent went through the deliverer.
        ?assert(D1 - D0 > Sent div 2, {sched_delivered, D1 - D0, Sent}),
        ok = actor_dp:close(Seg, done)
    after
        unlink(Dlv),
        exit(Dlv, kill),
        reregister_deliverers()
    end.

drain_loop() ->
    receive
        {actor_dp_drain, Seg, Ring} ->
            ok = actor_dp:drain(Seg, Ring),
            drain_loop()
    end.

%% The application's deliverers, if it runs, register again (a restart of
%% each): ours took their places.
reregister_deliverers() ->
    case whereis(actor_pool_sup) of
        undefined ->
            ok;
        _ ->
            [begin
                 ok = supervisor:terminate_child(actor_pool_sup, Id),
                 {ok, _} = supervisor:restart_child(actor_pool_sup, Id)
             end || {{actor_dp_deliverer, _} = Id, _, _, _} <- supervisor:which_children(actor_pool_sup)],
            ok
    end.

%% N asks of Msg(K), each cancelled after a random 0-60 us: a cancel that
%% answers false finds the answer in the mailbox at once, one that answers
%% true never gets it, and the counts add up. {Sent, Cancelled}.
cancel_race(Seg, N, Msg) ->
    Outcomes =
        [begin
             Ref = make_ref(),
             {ok, _, Id} = asked(actor_dp:submit(Seg, ask, echo, Msg(K), Ref, undefined)),
             spin_us(rand:uniform(60) - 1),
             case actor_dp:cancel(Seg, Id) of
                 false ->
                     receive {Ref, A} -> ?assertEqual({ok, Msg(K)}, A), sent
                     after 0 -> error({cancel_false_without_the_answer, K})
                     end;
                 true ->
                     {cancelled, Ref}
             end
         end || K <- lists:seq(1, N)],
    Cancelled = [Ref || {cancelled, Ref} <- Outcomes],
    Sent = length(Outcomes) - length(Cancelled),
    ap_support:wait_until(fun() ->
                                  #{replies := R, late := L} = actor_dp:info(Seg),
                                  R + L =:= N
                          end, ?T),
    #{replies := Sent, late := Late, pending := 0} = actor_dp:info(Seg),
    ?assertEqual(length(Cancelled), Late),
    [receive {Ref, _} = Extra -> error({cancelled_ask_answered, Extra}) after 0 -> ok end
     || Ref <- Cancelled],
    {Sent, length(Cancelled)}.

spin_us(Us) ->
    Until = erlang:monotonic_time(microsecond) + Us,
    Spin = fun F() ->
                   case erlang:monotonic_time(microsecond) < Until of
                       true -> F();
                       false -> ok
                   end
           end,
    Spin().

close_answers_every_pending_ask_at_once(P) ->
    Seg = open(P, #{}),
    cmd(P, "mode silent"),
    Refs = [begin
                Ref = make_ref(),
                {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, N, Ref, undefined)),
                Ref
            end || N <- lists:seq(1, 20)],
    ap_support:wait_until(fun() -> maps:get(pending, actor_dp:info(Seg)) =:= 20 end, ?T),
    ok = actor_dp:close(Seg, {nodedown, x@y}),
    [receive {Ref, R} -> ?assertEqual({error, {nodedown, x@y}}, R) after 0 -> error(not_at_once) end
     || Ref <- Refs],
    ok = actor_dp:close(Seg, again),
    #{state := closed, pending := 0} = actor_dp:info(Seg),
    closed = asked(actor_dp:submit(Seg, ask, echo, hi, make_ref(), undefined)),
    %% the pool node's end sees EOF
    expect(P, <<"detached">>),
    receive {Ref2, _} = Extra when is_reference(Ref2) -> error({extra, Extra}) after 0 -> ok end.

peer_killed_answers_pending_asks_promptly(P) ->
    Seg = open(P, #{node => pool@here}),
    cmd(P, "mode silent"),
    Refs = [begin
                Ref = make_ref(),
                {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, N, Ref, undefined)),
                Ref
            end || N <- lists:seq(1, 64)],
    ap_support:wait_until(fun() -> maps:get(pending, actor_dp:info(Seg)) =:= 64 end, ?T),
    T0 = erlang:monotonic_time(millisecond),
    kill_peer(P),
    %% promptly: EOF is seen within the reply thread's wait (50 ms), far
    %% under any ask timeout
    [receive {Ref, R} -> ?assertEqual({error, {nodedown, pool@here}}, R) after 1000 -> error(hung) end
     || Ref <- Refs],
    ?assert(erlang:monotonic_time(millisecond) - T0 < 1000),
    receive {actor_dp, Seg, down, Why} -> ?assertEqual({nodedown, pool@here}, Why)
    after 1000 -> error(owner_not_told)
    end,
    #{state := closed} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

bad_replies_are_errors_not_crashes(P) ->
    Seg = open(P, #{}),
    cmd(P, "mode bad_term"),
    Ref = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, hi, Ref, undefined)),
    %% bytes the NIF's walk cannot vouch for are not decoded on its reply
    %% thread: they are passed on, and refused by the asker's decode
    receive
        {Ref, {'$actor_dp_ext', Bytes}} -> ?assertError(badarg, binary_to_term(Bytes))
    after ?T -> error(no_reply)
    end,
    cmd(P, "mode bad_len"),
    Ref2 = make_ref(),
    {ok, _, Id2} = asked(actor_dp:submit(Seg, ask, echo, hi, Ref2, undefined)),
    ap_support:wait_until(fun() -> maps:get(bad_records, actor_dp:info(Seg)) =:= 1 end, ?T),
    %% the record was skipped, the ask is still pending, the segment lives
    ?assert(actor_dp:cancel(Seg, Id2)),
    %% a compressed answer would have the decoder allocate what it claims
    cmd(P, "mode compressed"),
    {ok, _, Id4} = asked(actor_dp:submit(Seg, ask, echo, hi, make_ref(), undefined)),
    ap_support:wait_until(fun() -> maps:get(bad_records, actor_dp:info(Seg)) =:= 2 end, ?T),
    ?assert(actor_dp:cancel(Seg, Id4)),
    cmd(P, "mode echo"),
    Ref3 = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, again, Ref3, undefined)),
    receive {Ref3, R3} -> ?assertEqual({ok, again}, R3) after ?T -> error(no_reply) end,
    #{state := open} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

%% A pool node that checks nothing (the peer's raw mode: the ask's binary
%% is the answer's term) answers each ask with an atom this VM never saw:
%% the NIF makes at most the segment's allowance (new_atoms) of them, by
%% its reply thread and by await/2 alike; the rest are {error, bad_reply}.
%% Atoms it knows cost nothing. An answer left to the asker (a hash map)
%% goes by the same allowance through admit_atoms/2.
new_atoms_in_answers_stop_at_the_segments_allowance(P) ->
    Allowance = 100,
    Seg = open(P, #{new_atoms => Allowance}),
    cmd(P, "mode raw"),
    Prefix = "dpfresh" ++ integer_to_list(erlang:unique_integer([positive])) ++ "_",
    Atom = fun(I) -> N = list_to_binary(Prefix ++ integer_to_list(I)), <<119, (byte_size(N)), N/binary>> end,
    Before = erlang:system_info(atom_count),
    Answers = [begin
                   Ref = make_ref(),
                   Msg = <<104, 2, 119, 2, "ok", (Atom(I))/binary>>,
                   case actor_dp:submit(Seg, ask, echo, Msg, Ref, undefined) of
                       {ok, _, Id, await} when I rem 2 =:= 0 ->
                           case actor_dp:await(Seg, Id) of
                               {reply, R} -> R;
                               none -> receive {Ref, R} -> R after ?T -> error(no_reply) end
                           end;
                       {ok, _, _, _} ->
                           receive {Ref, R} -> R after ?T -> error(no_reply) end;
                       {ok, _, _} ->
                           receive {Ref, R} -> R after ?T -> error(no_reply) end
                   end
               end || I <- lists:seq(1, 3 * Allowance)],
    Grew = erlang:system_info(atom_count) - Before,
    Made = [A || {ok, A} <- Answers],
    ?assertEqual(Allowance, length(Made)),
    ?assertEqual(2 * Allowance, length([x || {error, bad_reply} <- Answers])),
    ?assert(Grew =< Allowance + 8),
    ?assertMatch(#{new_atoms := Allowance}, actor_dp:info(Seg)),
    %% Known atoms pass, the allowance spent or not.
    Ref1 = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, <<104, 2, 119, 2, "ok", 119, 4, "true">>, Ref1, undefined)),
    receive {Ref1, R1} -> ?assertEqual({ok, true}, R1) after ?T -> error(no_reply) end,
    %% A hash map of new atoms comes as its bytes; admit_atoms/2 refuses
    %% them now, and takes a map of known ones.
    Map = fun(Keys) -> <<116, (length(Keys)):32, (iolist_to_binary([[K, 106] || K <- Keys]))/binary>> end,
    Ref2 = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, Map([Atom(I) || I <- lists:seq(1000, 1040)]), Ref2, undefined)),
    receive
        {Ref2, {'$actor_dp_ext', Bytes}} ->
            ?assertError(badarg, binary_to_term(Bytes, [safe])),
            ?assertNot(actor_dp:admit_atoms(Seg, Bytes))
    after ?T -> error(no_reply)
    end,
    Names = lists:sublist(lists:usort([atom_to_binary(F) || {F, _} <- erlang:module_info(exports)]), 40),
    Known = Map([<<119, (byte_size(N)), N/binary>> || N <- Names]),
    ?assert(actor_dp:admit_atoms(Seg, <<131, Known/binary>>)),
    ?assert(erlang:system_info(atom_count) - Before =< Allowance + 8),
    ok = actor_dp:close(Seg, done).

scribbled_reply_ring_closes_with_bad_segment(P) ->
    ReqBytes = 4096,
    Seg = open(P, #{req_rings => 2, req_bytes => ReqBytes, rep_rings => 1, rep_bytes => 4096}),
    cmd(P, "mode silent"),
    Ref = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, hi, Ref, undefined)),
    ap_support:wait_until(fun() -> maps:get(asks, actor_dp:info(Seg)) =:= 1 end, ?T),
    %% reply ring 0's tail (line 1 of its header): far past head + cap
    RepRing = 256 + 2 * (256 + ReqBytes),
    ok = actor_dp:scribble(Seg, RepRing + 64, <<(1 bsl 40):64/little>>),
    receive {Ref, R} -> ?assertEqual({error, bad_segment}, R) after ?T -> error(no_answer) end,
    receive {actor_dp, Seg, down, Why} -> ?assertEqual(bad_segment, Why) after ?T -> error(not_told) end,
    closed = actor_dp:submit(Seg, tell, echo, hi, undefined, undefined),
    ok = actor_dp:close(Seg, done).

scribbling_anywhere_never_crashes(P) ->
    Seg = open(P, #{req_rings => 2, req_bytes => 4096, rep_rings => 2, rep_bytes => 4096}),
    #{size := Size} = actor_dp:info(Seg),
    {error, badarg} = actor_dp:scribble(Seg, Size, <<1>>),
    {error, badarg} = actor_dp:scribble(Seg, Size - 1, <<1, 2>>),
    ok = actor_dp:scribble(Seg, Size - 1, <<1>>),
    rand:seed(exsss, {13, 17, 19}),
    Self = self(),
    %% random bytes at random places while asks and tells go both ways
    Scribbler = spawn_link(fun() -> scribble_loop(Seg, Size, 2000), Self ! scribbled end),
    Results = [asked(actor_dp:submit(Seg, ask, echo, N, make_ref(), undefined)) || N <- lists:seq(1, 300)],
    receive scribbled -> ok after 30000 -> error(scribbler_stuck) end,
    ?assertNot(is_process_alive(Scribbler)),
    [?assert(is_tuple(R) andalso element(1, R) =:= ok orelse lists:member(R, [full, closed])) || R <- Results],
    %% the segment either lives or was closed with bad_segment; the VM lives
    #{state := State} = actor_dp:info(Seg),
    ?assert(lists:member(State, [open, closed])),
    ok = actor_dp:close(Seg, done),
    flush_all().

scribble_loop(_Seg, _Size, 0) ->
    ok;
scribble_loop(Seg, Size, N) ->
    Len = rand:uniform(16),
    Off = rand:uniform(Size - Len) - 1,
    ok = actor_dp:scribble(Seg, Off, rand:bytes(Len)),
    scribble_loop(Seg, Size, N - 1).

full_ring_and_too_large(P) ->
    Seg = open(P, #{req_rings => 1, req_bytes => 4096}),
    cmd(P, "pause"),
    too_large = actor_dp:submit(Seg, tell, echo, binary:copy(<<0>>, 2048), undefined, undefined),
    Last = fill(Seg, undefined, 0),
    #{full := Full, too_large := 1} = actor_dp:info(Seg),
    ?assert(Full >= 1),
    Mark = actor_dp:mark(Seg, Last),
    ?assertNot(actor_dp:consumed(Seg, Mark)),
    cmd(P, "resume"),
    ap_support:wait_until(fun() -> actor_dp:consumed(Seg, Mark) end, ?T),
    {ok, _} = actor_dp:submit(Seg, tell, echo, <<"room again">>, undefined, Last),
    ok = actor_dp:close(Seg, done).

fill(Seg, Ticket, N) when N < 1000 ->
    case actor_dp:submit(Seg, tell, echo, binary:copy(<<1>>, 200), undefined, Ticket) of
        {ok, T} -> fill(Seg, T, N + 1);
        full -> Ticket
    end.

%% submit/6 encodes only small terms in its call: a large one (or one it
%% cannot size: a fun, a bignum) is answered `encode', nothing written,
%% nothing counted (submit/7 takes the caller's bound of the size instead
%% of its walk); submit_encoded/6 then carries term_to_binary/1's bytes,
%% on the dirty path too (over 64 KiB), and the peer gets the same term.
%% Binaries are never `encode': they are not encoded, and refused on their
%% size alone.
large_terms_are_left_to_the_caller_to_encode(P) ->
    Seg = open(P, #{}),
    Large = [lists:seq(1, 100000), {x, binary:copy(<<1>>, 100000)}, 1 bsl 100, fun lists:reverse/1,
             list_to_tuple(lists:seq(1, 300)), maps:from_list([{K, K} || K <- lists:seq(1, 200)]),
             lists:duplicate(3000, {a, b}), <<1:3>>],
    [?assertEqual(encode, actor_dp:submit(Seg, K, echo, M, make_ref(), undefined))
     || M <- Large, K <- [tell, ask]],
    %% few terms, nested past what the pool node reads (1024): not encoded
    %% here, and its bytes refused, never a record the pool node skips
    Deep = lists:foldl(fun(_, T) -> {T} end, x, lists:seq(1, 1500)),
    ?assertEqual(encode, actor_dp:submit(Seg, ask, echo, Deep, make_ref(), undefined)),
    ?assertError(badarg, actor_dp:submit_encoded(Seg, ask, echo, term_to_binary(Deep), make_ref(), undefined)),
    #{tells := 0, asks := 0, too_large := 0, encoded := 0, pending := 0} = actor_dp:info(Seg),
    %% submit/7: the caller's bound of the size stands for the walk up to
    %% 16 KiB (here a wrong one: the term is encoded in the call all the
    %% same); above, the NIF walks.
    Mid = lists:seq(1, 3000),
    ?assertEqual(encode, actor_dp:submit(Seg, tell, echo, Mid, undefined, undefined, 16385)),
    ?assertMatch({ok, _}, actor_dp:submit(Seg, tell, echo, Mid, undefined, undefined, 16384)),
    ?assertError(badarg, actor_dp:submit(Seg, tell, echo, Mid, undefined, undefined, -1)),
    ?assertError(badarg, actor_dp:submit(Seg, tell, echo, Mid, undefined, undefined, undefined)),
    Small = [{a, [1, 2, 3], #{k => v}}, lists:seq(1, 500), 1 bsl 40, -(1 bsl 63), 'héllo', self(),
             binary:copy(<<2>>, 300000)],
    Big = binary:copy(<<0>>, 4 bsl 20),
    ?assertEqual(too_large, actor_dp:submit(Seg, tell, echo, Big, undefined, undefined)),
    %% Maps told: the answers of asked ones are the ext test's below.
    [{ok, _} = actor_dp:submit_encoded(Seg, tell, echo, term_to_binary(M), undefined, undefined)
     || M <- Large, is_map(M)],
    %% one at a time: a 100K-element list is most of a ring record
    Asked = [{fun ask_encoded/2, M} || M <- Large, not is_map(M)] ++ [{fun submit_ask/3, M} || M <- Small],
    [begin
         {Ref, _} = case Ask of
                        F when is_function(F, 2) -> F(Seg, M);
                        F -> F(Seg, echo, M)
                    end,
         receive {Ref, R} -> ?assertEqual({ok, M}, R) after ?T -> error({no_reply, M}) end
     end || {Ask, M} <- Asked],
    ?assertEqual(too_large, actor_dp:submit_encoded(Seg, tell, echo, term_to_binary({Big}), undefined,
                                                    undefined)),
    NEnc = length(Large),
    NAsks = length(Asked),
    #{tells := 2, asks := NAsks, encoded := NEnc, too_large := 2, pending := 0, bad_records := 0} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

ask_encoded(Seg, Msg) ->
    Ref = make_ref(),
    {ok, _, Id} = asked(actor_dp:submit_encoded(Seg, ask, echo, term_to_binary(Msg), Ref, undefined)),
    {Ref, Id}.

%% submit_encoded/6 writes only what the pool node takes for one whole
%% term: anything else is a badarg in the caller (small, and over 64 KiB
%% where the bytes are checked on a dirty scheduler), nothing is written,
%% and the segment goes on.
hostile_encoded_messages_are_badarg(P) ->
    Seg = open(P, #{}),
    Good = term_to_binary({a, lists:seq(1, 100)}),
    BigGood = term_to_binary(lists:seq(1, 100000)),
    ?assert(byte_size(BigGood) > 65536),
    Bad = [hi, [131, 100, 0, 1, $a], <<>>, <<131>>, <<130, 97, 1>>, <<97, 1>>,
           binary:part(Good, 0, byte_size(Good) - 1), <<Good/binary, 0>>,
           <<131, 255, 1, 2, 3>>, <<131, 104, 3, 97, 1>>, <<131, 109, 0, 0, 0, 9, 1, 2>>,
           term_to_binary(lists:seq(1, 1000), [compressed]),
           binary:part(BigGood, 0, byte_size(BigGood) - 1), <<BigGood/binary, 106>>,
           <<131, 0:(100000 * 8)>>, <<131, 108, 0, 1, 0, 0, (binary:copy(<<97, 1>>, 50000))/binary>>],
    [begin
         ?assertError(badarg, actor_dp:submit_encoded(Seg, tell, echo, B, undefined, undefined)),
         ?assertError(badarg, actor_dp:submit_encoded(Seg, ask, echo, B, make_ref(), undefined))
     end || B <- Bad],
    %% a stats request carries no message
    ?assertError(badarg, actor_dp:submit_encoded(Seg, stats, echo, Good, make_ref(), undefined)),
    ?assertError(badarg, actor_dp:submit_encoded(Seg, ask, echo, Good, not_a_ref, undefined)),
    #{tells := 0, asks := 0, encoded := 0, pending := 0, state := open} = actor_dp:info(Seg),
    %% the segment still carries asks, in either form
    {Ref, _} = ask_encoded(Seg, {a, lists:seq(1, 100)}),
    receive {Ref, R} -> ?assertEqual({ok, {a, lists:seq(1, 100)}}, R) after ?T -> error(no_reply) end,
    #{asks := 1, encoded := 1, replies := 1, bad_records := 0} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

owner_exit_closes_the_segment(P) ->
    Self = self(),
    Owner = spawn(fun() -> receive stop -> ok end end),
    Seg = open(P, #{owner => Owner}),
    cmd(P, "mode silent"),
    Ref = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, hi, Ref, undefined)),
    MRef = monitor(process, Owner),
    Owner ! stop,
    receive {'DOWN', MRef, process, Owner, _} -> ok end,
    receive {Ref, R} -> ?assertEqual({error, owner_down}, R) after ?T -> error(no_answer) end,
    #{state := closed} = actor_dp:info(Seg),
    expect(P, <<"detached">>),
    Self = self().

refused_and_failed_attaches(P) ->
    #{socket := Sock, token := Token} = P,
    cmd(P, "refuse"),
    ?assertEqual({error, {refused, eperm}}, actor_dp:open(Sock, Token, #{})),
    expect(P, <<"refused">>),
    %% a wrong token: the pool node drops the connection without an ack
    Bad = crypto:strong_rand_bytes(16),
    ?assertEqual({error, econnreset}, actor_dp:open(Sock, Bad, #{})),
    %% nobody listening under that name
    ?assertEqual({error, econnrefused}, actor_dp:open(<<0, "actor_dp_nobody">>, Token, #{})),
    ?assertEqual({error, einval}, actor_dp:open(Sock, Token, #{req_bytes => 1000})),
    ?assertEqual({error, einval}, actor_dp:open(Sock, Token, #{rep_rings => 0})),
    %% it still attaches afterwards
    Seg = open(P, #{}),
    ok = actor_dp:close(Seg, done).

segments_are_freed_no_fd_leaks(P) ->
    Fds0 = fd_count(),
    [begin
         Seg = open(P, #{req_rings => 1, req_bytes => 4096, rep_rings => 1, rep_bytes => 4096}),
         expect(P, <<"attached ", (atom_to_binary(node(), utf8))/binary>>),
         ok = actor_dp:close(Seg, done),
         expect(P, <<"detached">>)
     end || _ <- lists:seq(1, 20)],
    %% the resources are gone once nothing refers to them: the destructor
    %% joined the thread and closed the socket
    erlang:garbage_collect(),
    ap_support:wait_until(fun() -> erlang:garbage_collect(), fd_count() =< Fds0 end, ?T).

bad_arguments_are_badarg(P) ->
    Seg = open(P, #{}),
    ?assertError(badarg, actor_dp:submit(Seg, nope, echo, hi, undefined, undefined)),
    ?assertError(badarg, asked(actor_dp:submit(Seg, ask, echo, hi, not_a_ref, undefined))),
    ?assertError(badarg, actor_dp:submit(Seg, tell, "echo", hi, undefined, undefined)),
    ?assertError(badarg, actor_dp:submit(Seg, tell, echo, hi, undefined, {0})),
    ?assertError(badarg, actor_dp:submit(Seg, tell, echo, hi, undefined, {0, 0})),
    ?assertError(badarg, actor_dp:mark(Seg, 99)),
    ?assertError(badarg, actor_dp:mark(Seg, -1)),
    ?assertError(badarg, actor_dp:submit(Seg, tell, echo, hi, undefined, -1)),
    ?assertError(badarg, actor_dp:submit(make_ref(), tell, echo, hi, undefined, undefined)),
    ?assertError(badarg, actor_dp:cancel(Seg, -1)),
    ?assertError(badarg, actor_dp:consumed(Seg, tk(99, 0))),
    ?assertError(badarg, actor_dp:consumed(Seg, {0, 0})),
    ?assertError(badarg, actor_dp:consumed(Seg, 1 bsl 59)),
    ?assertError(badarg, actor_dp:close(make_ref(), x)),
    %% a ticket naming a ring this segment does not have is no fence
    {ok, _} = actor_dp:submit(Seg, tell, echo, hi, undefined, 1000),
    ok = actor_dp:close(Seg, done).

%% Many answers sent back to back, by the reply thread (replies) and by
%% close (errors), to callers already waiting: each arrives whole, once.
%% (The NIF reuses one env per sender; a send invalidates it.)
many_answers_in_a_row_arrive_whole(P) ->
    Self = self(),
    [begin
         Seg = open(P, #{}),
         cmd(P, "mode echo"),
         Echoed = callers(Seg, 100, fun(K) -> {K, binary:copy(<<K>>, K)} end),
         [?assertEqual({ok, {K, binary:copy(<<K>>, K)}}, A) || {K, A} <- Echoed],
         cmd(P, "mode silent"),
         Pids = [spawn_link(fun() -> waiting_caller(Seg, Self, K) end) || K <- lists:seq(1, 100)],
         [receive {queued, Pid} -> ok after ?T -> error(not_queued) end || Pid <- Pids],
         ok = actor_dp:close(Seg, {closed, lists:seq(1, 20)}),
         Closed = [receive {answer, Pid, K, A} -> {K, A} after ?T -> {Pid, hung} end || Pid <- Pids],
         [?assertEqual({error, {closed, lists:seq(1, 20)}}, A) || {_, A} <- Closed]
     end || _ <- lists:seq(1, 20)],
    ok.

%% await/2: a lone ask's answer is taken in the NIF, once: {reply, A} and
%% no message, or none and the message. Whichever way, exactly one answer
%% per ask and nothing late. How many are taken depends on the host (a
%% busy one makes the peer miss the 150 us), so the count is only
%% reported; lone_asks_until_one_is_awaited/3 proves the taking.
await_takes_a_lone_asks_answer_once(P) ->
    Seg = open(P, #{}),
    Ways = [begin
                Msg = {K, binary:copy(<<K>>, K rem 200)},
                {Way, A} = lone_ask(Seg, Msg, fun(Id, true) -> actor_dp:await(Seg, Id);
                                                 (_, false) -> none
                                              end),
                ?assertEqual({ok, Msg}, A),
                Way
            end || K <- lists:seq(1, 300)],
    Awaited = length([W || W <- Ways, W =:= awaited]),
    #{awaited := Awaited, replies := 300, late := 0, pending := 0} = actor_dp:info(Seg),
    ?assertMatch({awaited, {ok, last}}, lone_asks_until_one_is_awaited(Seg, last, 10000)),
    receive {R, _} = Stray when is_reference(R) -> error({stray, Stray}) after 0 -> ok end,
    ok = actor_dp:close(Seg, done).

%% One ask, its answer by Await(Id, Marked) or as the message: {awaited |
%% message, Answer}; Marked: whether the submit said the ask is worth an
%% await. A taken answer leaves nothing: the ask is gone, no message.
lone_ask(Seg, Msg, Await) ->
    Ref = make_ref(),
    {Id, Marked} = case actor_dp:submit(Seg, ask, echo, Msg, Ref, undefined) of
                       {ok, _, I, await} -> {I, true};
                       {ok, _, I} -> {I, false}
                   end,
    case Await(Id, Marked) of
        {reply, A} ->
            ?assertNot(actor_dp:cancel(Seg, Id)),
            receive {Ref, _} = Twice -> error({answered_twice, Twice}) after 0 -> ok end,
            {awaited, A};
        none ->
            receive {Ref, A} -> {message, A} after ?T -> error({no_reply, Msg}) end
    end.

%% Lone asks with await/3's longest wait (no gap after misses) until one
%% answer is taken in the NIF, for at most Ms: {awaited, Answer}.
lone_asks_until_one_is_awaited(Seg, Msg, Ms) ->
    Deadline = erlang:monotonic_time(millisecond) + Ms,
    Try = fun Try() ->
              case lone_ask(Seg, Msg, fun(Id, _) -> actor_dp:await(Seg, Id, 1000) end) of
                  {awaited, _} = Got -> Got;
                  {message, _} = Missed ->
                      case erlang:monotonic_time(millisecond) < Deadline of
                          true -> Try();
                          false -> Missed
                      end
              end
          end,
    Try().

%% With another ask pending the caller's scheduler does not wait: none at
%% once, and both answers come as messages.
await_is_none_unless_the_ask_is_alone(P) ->
    Seg = open(P, #{}),
    cmd(P, "pause"),
    Ref1 = make_ref(),
    Ref2 = make_ref(),
    %% the first is alone (a fresh segment); the second is not, and is not
    %% marked for an await
    {ok, _, Id1, await} = actor_dp:submit(Seg, ask, echo, one, Ref1, undefined),
    {ok, _, Id2} = actor_dp:submit(Seg, ask, echo, two, Ref2, undefined),
    ?assertEqual(none, actor_dp:await(Seg, Id1)),
    ?assertEqual(none, actor_dp:await(Seg, Id2)),
    ?assertEqual(none, actor_dp:await(Seg, Id2, 1000)),
    cmd(P, "resume"),
    receive {Ref1, A1} -> ?assertEqual({ok, one}, A1) after ?T -> error(no_reply) end,
    receive {Ref2, A2} -> ?assertEqual({ok, two}, A2) after ?T -> error(no_reply) end,
    %% none at once: no wait ran out (a wait that did is a miss)
    #{awaited := 0, await_missed := 0, replies := 2} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

%% An ask already cancelled, answered, or closed: none, and nothing else
%% changes (the close's answer is the message).
await_after_close_or_cancel_is_none(P) ->
    Seg = open(P, #{}),
    cmd(P, "pause"),
    {_, Id1} = submit_ask(Seg, echo, one),
    true = actor_dp:cancel(Seg, Id1),
    ?assertEqual(none, actor_dp:await(Seg, Id1)),
    ?assertEqual(none, actor_dp:await(Seg, 987654321)),
    {Ref2, Id2} = submit_ask(Seg, echo, two),
    ok = actor_dp:close(Seg, gone),
    ?assertEqual(none, actor_dp:await(Seg, Id2)),
    receive {Ref2, A2} -> ?assertEqual({error, gone}, A2) after ?T -> error(no_close_answer) end,
    ?assertEqual(none, actor_dp:await(Seg, Id2, 1000)),
    ?assertError(badarg, actor_dp:await(Seg, -1)),
    ?assertError(badarg, actor_dp:await(not_a_seg, 1)),
    ?assertError(badarg, actor_dp:await(Seg, Id2, 1001)),
    ?assertError(badarg, actor_dp:await(Seg, Id2, -1)).

%% A reply that is no term, taken by await: {error, bad_reply}, as the
%% reply thread would answer it.
await_answers_bad_replies_as_errors(P) ->
    Seg = open(P, #{}),
    cmd(P, "mode bad_term"),
    ?assertEqual({awaited, {error, bad_reply}}, lone_asks_until_one_is_awaited(Seg, hi, 10000)),
    #{state := open, late := 0, pending := 0} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

%% Many askers, some alone for a moment (they await and drain the others'
%% answers), some not: every ask is answered once and correctly, none late,
%% no stray message in any mailbox. Rounds go on until an awaiting asker
%% has passed others' answers on (`passed_on'), for at most 60 rounds (the
%% interleaving that makes one is the host's to give: a busy host may take
%% more than 20).
awaiting_and_waiting_askers_get_every_answer_once(P) ->
    Seg = open(P, #{}),
    Rounds = askers_until_answers_are_passed_on(Seg, 1),
    #{replies := Replies, late := 0, pending := 0, passed_on := On} = actor_dp:info(Seg),
    ?assertEqual(Rounds * 6 * 400, Replies),
    ?assert(On > 0),
    ok = actor_dp:close(Seg, done).

askers_until_answers_are_passed_on(Seg, Round) ->
    Self = self(),
    Pids = [spawn_link(fun() ->
                               Out = [begin
                                          Msg = {C, K},
                                          {Ref, Id} = submit_ask(Seg, echo, Msg),
                                          %% await/3: alone by the count only
                                          A = case actor_dp:await(Seg, Id, 200) of
                                                  {reply, R} -> R;
                                                  none -> receive {Ref, R} -> R after ?T -> hung end
                                              end,
                                          A =:= {ok, Msg} orelse error({wrong, Msg, A}),
                                          %% answers of this caller's pause come now
                                          [erlang:yield() || K rem 7 =:= 0],
                                          ok
                                      end || K <- lists:seq(1, 400)],
                               Stray = receive X -> [X] after 0 -> [] end,
                               Self ! {done, self(), length(Out), Stray}
                       end) || C <- lists:seq(1, 6)],
    [receive {done, Pid, N, Stray} -> ?assertEqual({400, []}, {N, Stray}) after 60000 -> error(hung) end
     || Pid <- Pids],
    case actor_dp:info(Seg) of
        #{passed_on := 0} when Round < 60 -> askers_until_answers_are_passed_on(Seg, Round + 1);
        _ -> Round
    end.

%% What await does not take: an answer over 64 KiB (decoded by the reply
%% thread, not on the asker's scheduler: it comes as the message), and an
%% ask of another process (its answer stays its asker's).
await_leaves_large_answers_and_others_asks_alone(P) ->
    Seg = open(P, #{}),
    Big = binary_to_list(binary:copy(<<"ab">>, 100000)),
    [begin
         Ref = make_ref(),
         %% (too large for submit/6 to encode in its call)
         {ok, _, Id, await} = actor_dp:submit_encoded(Seg, ask, echo, term_to_binary(Big), Ref, undefined),
         ?assertEqual(none, actor_dp:await(Seg, Id, 1000)),
         receive {Ref, A} -> ?assertEqual({ok, Big}, A) after ?T -> error(no_reply) end
     end || _ <- lists:seq(1, 5)],
    cmd(P, "pause"),
    Ref2 = make_ref(),
    {ok, _, Id2, await} = actor_dp:submit(Seg, ask, echo, mine, Ref2, undefined),
    Self = self(),
    %% another process awaits it over and over while the answer comes
    Other = spawn_link(fun() -> Self ! {other, others_awaits(Seg, Id2, [])} end),
    cmd(P, "resume"),
    receive {Ref2, A2} -> ?assertEqual({ok, mine}, A2) after ?T -> error(no_reply) end,
    Other ! stop,
    receive {other, Rs} -> ?assertEqual([none], lists:usort(Rs)) after ?T -> error({hung, Other}) end,
    #{late := 0, pending := 0, awaited := 0} = actor_dp:info(Seg),
    ok = actor_dp:close(Seg, done).

others_awaits(Seg, Id, Acc) ->
    receive stop -> Acc
    after 0 -> others_awaits(Seg, Id, [actor_dp:await(Seg, Id, 1000) | Acc])
    end.

callers(Seg, N, MsgOf) ->
    Self = self(),
    Pids = [spawn_link(fun() ->
                               Ref = make_ref(),
                               {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, MsgOf(K), Ref, undefined)),
                               receive {Ref, A} -> Self ! {answer, self(), K, A} after ?T -> ok end
                       end) || K <- lists:seq(1, N)],
    [receive {answer, Pid, K, A} -> {K, A} after ?T -> error(hung) end || Pid <- Pids].

waiting_caller(Seg, Parent, K) ->
    Ref = make_ref(),
    {ok, _, _} = asked(actor_dp:submit(Seg, ask, echo, K, Ref, undefined)),
    Parent ! {queued, self()},
    receive {Ref, A} -> Parent ! {answer, self(), K, A} after ?T -> ok end.

%% ===================================================================
%% Pool node cases
%% ===================================================================

pool_node_answers_asks_tells_and_stats(#{pool_node := N} = Ctx) ->
    with_pool(dp_echo, echo, #{workers => 2}, fun(P) ->
        Seg = pool_open(Ctx, #{}),
        Msgs = [<<"bin">>, {a, [1, 2.5, "s"]}, #{k => v}, binary:copy(<<9>>, 80000)],
        [?assertEqual({ok, M}, ask(Seg, dp_echo, M)) || M <- Msgs],
        ?assertEqual({ok, by_pid}, ask(Seg, P, by_pid)),
        ?assertEqual({error, noproc}, ask(Seg, dp_no_such_pool, x)),
        Last = lists:foldl(fun(K, T) ->
                                   {ok, T2} = actor_dp:submit(Seg, tell, dp_echo, {t, K}, undefined, T),
                                   T2
                           end, undefined, lists:seq(1, 100)),
        Mark = actor_dp:mark(Seg, Last),
        ap_support:wait_until(fun() -> actor_dp:consumed(Seg, Mark) end, ?T),
        %% every tell and ask by ring, counted by the pool on that path
        ap_support:wait_until(
          fun() ->
                  {ok, #{by_path := #{ring := R}}} = {ok, ask(Seg, dp_echo, '$stats')},
                  R =:= 105
          end, ?T),
        #{tells := 100, replies := Replies, late := 0, bad_records := 0, pending := 0} = actor_dp:info(Seg),
        ?assert(Replies >= 7),
        ok = actor_dp:close(Seg, done),
        %% distribution still serves the pool; the node did not restart
        ?assertEqual({ok, dist}, actor_pool:ask(P, dist)),
        ?assertMatch(#{os_pid := OsPid} when OsPid =:= map_get(os_pid, Ctx),
                     actor_cnode:info(actor_pool_node_owner)),
        ?assertEqual(N, node(P))
    end).

pool_node_cancel_and_close_leave_no_reply_behind(Ctx) ->
    with_pool(dp_slow, crash_plugin(), #{workers => 1}, fun(_P) ->
        Seg = pool_open(Ctx, #{}),
        %% one worker: the sleep holds it, the others queue behind it
        [{RA, _}, {RB, _}, {RC, IdC}, {RD, _}] =
            [submit_ask(Seg, dp_slow, M) || M <- [{sleep, 300}, b, c, d]],
        ?assert(actor_dp:cancel(Seg, IdC)),
        [receive {R, A} -> ?assertEqual(Want, A) after ?T -> error({no_reply, Want}) end
         || {R, Want} <- [{RA, {ok, ok}}, {RB, {ok, b}}, {RD, {ok, d}}]],
        ap_support:wait_until(fun() -> maps:get(late, actor_dp:info(Seg)) =:= 1 end, ?T),
        receive {RC, _} = Late -> error({cancelled_ask_answered, Late}) after 0 -> ok end,
        %% close with an ask in the worker: answered at once, by close
        {RE, _} = submit_ask(Seg, dp_slow, {sleep, 300}),
        ok = actor_dp:close(Seg, {nodedown, gone}),
        receive {RE, E} -> ?assertEqual({error, {nodedown, gone}}, E) after 0 -> error(not_at_once) end,
        %% its late reply is never delivered: the worker's answer goes nowhere
        ?assertEqual({ok, after_close}, actor_pool:ask(dp_slow, after_close, ?T)),
        receive {RE, _} = Again -> error({answered_twice, Again}) after 0 -> ok end
    end).

pool_node_scribbled_segment_is_errors_not_crashes(#{os_pid := OsPid} = Ctx) ->
    with_pool(dp_scribble, crash_plugin(), #{workers => 2}, fun(P) ->
        ReqBytes = 4096,
        Geo = #{req_rings => 2, req_bytes => ReqBytes, rep_rings => 1, rep_bytes => 4096},
        %% the reply ring's tail made impossible, an ask pending
        Seg = pool_open(Ctx, Geo),
        {R, _} = submit_ask(Seg, dp_scribble, {sleep, 200}),
        ok = actor_dp:scribble(Seg, 256 + 2 * (256 + ReqBytes) + 64, <<(1 bsl 40):64/little>>),
        receive {R, A} -> ?assertEqual({error, bad_segment}, A) after ?T -> error(no_answer) end,
        receive {actor_dp, Seg, down, bad_segment} -> ok after ?T -> error(owner_not_told) end,
        ok = actor_dp:close(Seg, done),
        %% random bytes anywhere, while asks and tells go both ways
        Seg2 = pool_open(Ctx, Geo),
        #{size := Size} = actor_dp:info(Seg2),
        rand:seed(exsss, {1, 2, 3}),
        Self = self(),
        _ = spawn_link(fun() -> scribble_loop(Seg2, Size, 3000), Self ! scribbled end),
        _ = [actor_dp:submit(Seg2, K, dp_scribble, M, make_ref(), undefined)
             || M <- lists:seq(1, 200), K <- [ask, tell]],
        receive scribbled -> ok after 30000 -> error(scribbler_stuck) end,
        ok = actor_dp:close(Seg2, done),
        flush_all(),
        %% the pool node and the VM are both still here and serving
        ?assertEqual({ok, x}, actor_pool:ask(P, x)),
        ?assertMatch(#{os_pid := OsPid, status := up}, actor_cnode:info(actor_pool_node_owner)),
        Seg3 = pool_open(Ctx, #{}),
        ?assertEqual({ok, fresh}, ask(Seg3, dp_scribble, fresh)),
        ok = actor_dp:close(Seg3, done)
    end).

pool_node_killed_answers_64_pending_asks_promptly(#{pool_node := N, os_pid := OsPid} = Ctx) ->
    {ok, _} = actor_pool:start_pool(dp_killed, crash_plugin(), #{workers => 2}),
    Seg = pool_open(Ctx, #{}),
    Self = self(),
    Callers = [spawn_link(fun() ->
                                  {R, _} = submit_ask(Seg, dp_killed, {sleep, 3000}),
                                  Self ! {queued, self()},
                                  receive {R, A} -> Self ! {answer, self(), A}
                                  after 10000 -> Self ! {answer, self(), timeout}
                                  end
                          end) || _ <- lists:seq(1, 64)],
    [receive {queued, C} -> ok after ?T -> error(not_queued) end || C <- Callers],
    T0 = erlang:monotonic_time(millisecond),
    _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
    Answers = [receive {answer, C, A} -> A after 2000 -> hung end || C <- Callers],
    Ms = erlang:monotonic_time(millisecond) - T0,
    ?assertEqual([], [A || A <- Answers, A =/= {error, {nodedown, N}}]),
    ?assert(Ms < 2000),
    receive {actor_dp, Seg, down, Why} -> ?assertEqual({nodedown, N}, Why)
    after ?T -> error(owner_not_told)
    end,
    ok = actor_dp:close(Seg, done),
    %% the node comes back (a fresh segment is another open); leave it clean
    ap_support:wait_until(fun() ->
                                    case actor_cnode:info(actor_pool_node_owner) of
                                        #{status := up, os_pid := New} -> New =/= OsPid;
                                        _ -> false
                                    end
                            end, 20000),
    ap_support:wait_until(fun() -> lists:keymember(dp_killed, 1, actor_pool:which_pools()) end, ?T),
    ok = actor_pool:stop_pool(dp_killed).

%% ===================================================================
%% Helpers
%% ===================================================================

pool_setup() ->
    WasAlive = ap_test_util:start_app(),
    PoolNode = actor_pool:pool_node(),
    #{os_pid := OsPid, status := up} = actor_cnode:info(actor_pool_node_owner),
    #{was_alive => WasAlive, pool_node => PoolNode, os_pid => OsPid}.

pool_cleanup(#{was_alive := WasAlive}) ->
    _ = [actor_pool:stop_pool(Pid) || {_, Pid} <- actor_pool:which_pools()],
    ap_test_util:stop_app(WasAlive).

%% A segment to the pool node, attached with what its dp_info says now.
pool_open(#{pool_node := N}, Opts) ->
    {ok, #{socket := Sock, token := Token}} = gen_server:call({actor_pool_node, N}, dp_info),
    {ok, Seg} = actor_dp:open(Sock, Token, Opts#{node => N}),
    Seg.

submit_ask(Seg, Dest, Msg) ->
    Ref = make_ref(),
    {ok, _, Id} = asked(actor_dp:submit(Seg, ask, Dest, Msg, Ref, undefined)),
    {Ref, Id}.

%% An ask by ring; '$stats' asks for the pool's stats instead.
ask(Seg, Dest, '$stats') ->
    Ref = make_ref(),
    {ok, _, _} = actor_dp:submit(Seg, stats, Dest, undefined, Ref, undefined),
    receive {Ref, A} -> A after ?T -> error(no_stats) end;
ask(Seg, Dest, Msg) ->
    {Ref, _} = submit_ask(Seg, Dest, Msg),
    receive {Ref, A} -> A after ?T -> error({no_reply, Msg}) end.

peer_start() ->
    Exe = ap_support:test_bin("actor_dp_peer"),
    Port = open_port({spawn_executable, Exe}, [{line, 1024}, binary, exit_status, use_stdio]),
    {os_pid, OsPid} = erlang:port_info(Port, os_pid),
    receive
        {Port, {data, {eol, <<"ready ", Rest/binary>>}}} ->
            [SockHex, TokenHex] = binary:split(Rest, <<" ">>),
            #{port => Port, os_pid => OsPid,
              socket => binary:decode_hex(SockHex), token => binary:decode_hex(TokenHex)}
    after ?T -> error(peer_not_ready)
    end.

peer_stop(#{port := Port, os_pid := OsPid}) ->
    catch port_close(Port),
    _ = os:cmd("kill -9 " ++ integer_to_list(OsPid) ++ " 2>/dev/null"),
    ap_support:wait_until(fun() -> not ap_support:os_pid_alive(OsPid) end, ?T),
    flush_all().

kill_peer(#{os_pid := OsPid}) ->
    _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
    ap_support:wait_until(fun() -> not ap_support:os_pid_alive(OsPid) end, ?T).

open(#{socket := Sock, token := Token}, Opts) ->
    {ok, Seg} = actor_dp:open(Sock, Token, Opts),
    Seg.

cmd(#{port := Port} = P, Line) ->
    true = port_command(Port, [Line, $\n]),
    expect(P, iolist_to_binary(["ok ", Line])).

%% The next line of the peer equal to Line (others are skipped).
expect(#{port := Port}, Line) ->
    receive
        {Port, {data, {eol, Line}}} -> ok;
        {Port, {data, {eol, _Other}}} -> expect(#{port => Port}, Line);
        {Port, {exit_status, S}} -> error({peer_exited, S})
    after ?T -> error({peer_line_missing, Line})
    end.

fd_count() ->
    {ok, Fds} = file:list_dir("/proc/self/fd"),
    length(Fds).

%% An ask's submit, the await mark dropped (lone asks get
%% {ok, Ticket, Id, await}; these cases take the answer as a message).
asked({ok, T, Id, await}) -> {ok, T, Id};
asked(Other) -> Other.

flush_all() ->
    receive _ -> flush_all() after 0 -> ok end.

%% A mark (actor_dp:mark(), opaque to callers): the ring in its low 10
%% bits, the low 49 bits of the position above.
tk(Ring, Pos) -> (Pos bsl 10) bor Ring.

untk(T) -> {T band 1023, T bsr 10}.
