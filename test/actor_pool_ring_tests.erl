%% The same-host data plane end to end: actor_pool's tell, ask and stats
%% over the shared-memory rings (actor_pool_dp's lanes, the actor_dp NIF,
%% the pool node's ring ingress) against the real pool C node that the
%% application starts, compared with the distribution path (pools started
%% with `fast_path => false', and the application setting).
%%
%% Every case checks that its calls really took the path it means (the
%% pool's `by_path' counters and actor_pool_dp:info/0). Ordering cases move
%% the calling process between schedulers with process_flag(scheduler, N)
%% (a request ring per scheduler) and switch transports (a message too large
%% for a ring goes by distribution). The last two cases kill the pool node
%% with SIGKILL under 64 waiting askers and check the fresh lane of its next
%% incarnation. Cases wait on messages or poll with a deadline, never sleep.
%%
%% ACTOR_POOL_IO (uring | epoll) selects the pool node's I/O backend.
-module(actor_pool_ring_tests).

-import(ap_test_util, [with_pool/4, crash_plugin/0, alive/1]).
-import(ap_support, [wait_until/2, os_pid_alive/1, epmd_names/0]).

-include_lib("eunit/include/eunit.hrl").

-export([same_host_pool_node_gets_a_ring_lane/1,
         lone_asks_take_their_answers_on_their_scheduler/1,
         messages_to_idle_workers_count_for_the_worker_routed/1,
         dense_tells_and_asks_are_read_in_naps_and_lone_asks_never_nap/1,
         lone_asks_keep_the_loop_awake/1,
         restarted_lane_server_replaces_every_lane/1,
         sequential_asks_never_overflow_a_one_slot_mailbox/1,
         answers_holding_large_maps_arrive_whole/1,
         pool_named_outside_latin1_answers_by_distribution/1,
         every_reference_form_answers_alike_over_ring_and_distribution/1,
         errors_are_identical_over_ring_and_distribution/1,
         large_terms_are_encoded_by_the_caller_and_arrive_whole/1,
         fast_path_option_is_validated/1,
         fast_path_false_setting_sends_by_distribution/1,
         order_holds_across_scheduler_changes/1,
         order_holds_when_rings_are_read_after_a_stall/1,
         order_holds_across_a_transport_switch/1,
         switch_to_distribution_waits_until_the_ring_is_read/1,
         timed_out_ring_asks_leave_no_late_reply/1,
         full_rings_slow_senders_down_and_lose_nothing/1,
         answers_go_out_from_deliverers_and_survive_their_deaths/1,
         pool_nodes_stopped_with_their_lanes_open_exit_cleanly/1,
         killed_pool_node_answers_64_waiting_askers_promptly/1,
         restarted_pool_node_gets_a_fresh_lane/1]).

-define(WAIT_MS, 10000).
-define(POLL_MS, 5).

%% ===================================================================
%% Fixture
%% ===================================================================

ring_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 same_host_pool_node_gets_a_ring_lane,
                 lone_asks_take_their_answers_on_their_scheduler,
                 messages_to_idle_workers_count_for_the_worker_routed,
                 dense_tells_and_asks_are_read_in_naps_and_lone_asks_never_nap,
                 lone_asks_keep_the_loop_awake,
                 restarted_lane_server_replaces_every_lane,
                 sequential_asks_never_overflow_a_one_slot_mailbox,
                 answers_holding_large_maps_arrive_whole,
                 pool_named_outside_latin1_answers_by_distribution,
                 every_reference_form_answers_alike_over_ring_and_distribution,
                 errors_are_identical_over_ring_and_distribution,
                 large_terms_are_encoded_by_the_caller_and_arrive_whole,
                 fast_path_option_is_validated,
                 fast_path_false_setting_sends_by_distribution,
                 order_holds_across_scheduler_changes,
                 order_holds_when_rings_are_read_after_a_stall,
                 order_holds_across_a_transport_switch,
                 switch_to_distribution_waits_until_the_ring_is_read,
                 timed_out_ring_asks_leave_no_late_reply,
                 full_rings_slow_senders_down_and_lose_nothing,
                 answers_go_out_from_deliverers_and_survive_their_deaths,
                 pool_nodes_stopped_with_their_lanes_open_exit_cleanly,
                 %% last: they kill the pool node
                 killed_pool_node_answers_64_waiting_askers_promptly,
                 restarted_pool_node_gets_a_fresh_lane]]
     end}.

case_(Name, Ctx) ->
    {atom_to_list(Name), {timeout, 120, fun() -> ?MODULE:Name(Ctx) end}}.

setup() -> ap_test_util:pool_setup().

cleanup(Ctx) -> ap_test_util:pool_cleanup(Ctx).

%% ===================================================================
%% Cases
%% ===================================================================

%% The first call makes the lane; asks and tells then count as `ring' in
%% the pool's stats, none as `dist'.
same_host_pool_node_gets_a_ring_lane(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2}, fun(P) ->
        ?assertEqual({ok, <<"x">>}, actor_pool:ask(P, <<"x">>)),
        ?assertMatch(#{transport := ring}, lane_info(N)),
        [ok = actor_pool:tell(P, <<"t">>) || _ <- lists:seq(1, 100)],
        S = wait_stats(P, fun(#{processed := C}) -> C >= 101 end),
        ?assertEqual(#{dist => 0, ring => 101}, maps:get(by_path, S))
    end).

%% A built-in's short message to a worker that sleeps with an empty
%% mailbox runs on the pool node's loop, on that worker's state (the
%% inline runs of docs/same-host-transport.md): lone asks and tells, one at
%% a time, are mostly such. Answers, counts and routing are the same as a
%% worker's: round robin over two workers, each worker is counted for
%% every other message, and the answers are the messages. A json document
%% over the inline size limit (16 KiB) goes to a worker and is validated
%% alike.
messages_to_idle_workers_count_for_the_worker_routed(_Ctx) ->
    N = 200,
    with_pool(?FUNCTION_NAME, echo, #{workers => 2, routing => round_robin}, fun(P) ->
        ?assertEqual([{ok, {K, <<K:32>>}} || K <- lists:seq(1, N)],
                     [actor_pool:ask(P, {K, <<K:32>>}) || K <- lists:seq(1, N)]),
        [ok = actor_pool:tell(P, K) || K <- lists:seq(1, N)],
        S = wait_stats(P, fun(#{processed := C}) -> C >= 2 * N end),
        ?assertMatch(#{processed := 400, errors := 0, crashes := 0, by_path := #{ring := 400, dist := 0}}, S),
        ?assertEqual([{0, N}, {1, N}],
                     lists:sort([{Id, C} || #{id := Id, processed := C} <- maps:get(workers, S)])),
        %% Most ran on the loop (a worker the loop woke may still have
        %% been awake for the next one: not all).
        #{ran_on_loop := OnLoop} = S,
        ?assert(OnLoop > N andalso OnLoop =< 2 * N, {ran_on_loop, OnLoop})
    end),
    %% Never with a handler deadline: the loop cannot time a handler it runs.
    with_pool(ring_inline_deadline, echo, #{workers => 1, handler_timeout_ms => 1000}, fun(P) ->
        ?assertEqual([{ok, K} || K <- lists:seq(1, 20)], [actor_pool:ask(P, K) || K <- lists:seq(1, 20)]),
        ?assertMatch(#{processed := 20, ran_on_loop := 0}, actor_pool:stats(P))
    end),
    with_pool(ring_json_inline, json_validate, #{workers => 1}, fun(P) ->
        Big = iolist_to_binary(["[", lists:join(",", lists:duplicate(9000, "1")), "]"]),
        ?assert(byte_size(Big) > 16384),
        ?assertEqual({ok, ok}, actor_pool:ask(P, <<"[1,2]">>)),
        ?assertEqual({ok, ok}, actor_pool:ask(P, Big)),
        ?assertMatch({error, _}, actor_pool:ask(P, <<"[1,">>)),
        %% The large one went to the worker.
        ?assertMatch(#{processed := 3, errors := 1, ran_on_loop := R} when R =< 2, actor_pool:stats(P))
    end).

%% Tells from four senders at once come faster than the loop reads them one
%% by one: it reads them in batches and naps between (node_stats'
%% `ring_naps'), and every one is handled. The test's stats polls among
%% them are read as asks (a read holding one takes the asks' nap), but
%% the tells' naps are more. One process's asks, one at a time, never
%% find a batch: no nap, so no wait added to a lone ask. 64 callers' asks
%% do, and every nap of theirs is the asks' nap (`ring_ask_naps').
dense_tells_and_asks_are_read_in_naps_and_lone_asks_never_nap(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2}, fun(P) ->
        ?assertEqual({ok, 0}, actor_pool:ask(P, 0)),
        #{ring_naps := Naps0, ring_ask_naps := AskNaps0} = actor_pool:node_stats(N),
        Per = 20000,
        Self = self(),
        Senders = [spawn_link(fun() ->
                                      [ok = actor_pool:tell(P, {S, K}) || K <- lists:seq(1, Per)],
                                      Self ! {sent, self()}
                              end) || S <- lists:seq(1, 4)],
        [receive {sent, Pid} -> ok after 60000 -> error(senders_hung) end || Pid <- Senders],
        S = wait_stats(P, fun(#{processed := C}) -> C >= 4 * Per + 1 end),
        ?assertMatch(#{processed := 80001, dropped_tells := 0, by_path := #{dist := 0}}, S),
        %% The flood's last read may still be followed by a nap (and one
        %% with asks, for the stats polls among the tells): the loop takes
        %% it when it next runs out of work, which a busy (or sanitized)
        %% loop may put after the next few asks and node_stats calls.
        #{ring_naps := Naps1, ring_ask_naps := AskNaps1} = settled_naps(N, P),
        %% Most were tells' naps: the polls began once the senders were done.
        ?assert(Naps1 - Naps0 > AskNaps1 - AskNaps0, {naps, Naps0, Naps1, AskNaps0, AskNaps1}),
        ?assertEqual([{ok, K} || K <- lists:seq(1, 200)], [actor_pool:ask(P, K) || K <- lists:seq(1, 200)]),
        ?assertMatch(#{ring_naps := Naps1, ring_ask_naps := AskNaps1}, actor_pool:node_stats(N)),
        Callers = [spawn_link(fun() ->
                                      Self ! {asked, self(), [actor_pool:ask(P, {C, K}) || K <- lists:seq(1, 300)]}
                              end) || C <- lists:seq(1, 64)],
        [receive
             {asked, Pid, Answers} -> ?assertEqual([{ok, {C, K}} || K <- lists:seq(1, 300)], Answers)
         after 60000 -> error(callers_hung)
         end || {C, Pid} <- lists:zip(lists:seq(1, 64), Callers)],
        #{ring_naps := Naps2, ring_ask_naps := AskNaps2} = actor_pool:node_stats(N),
        ?assert(AskNaps2 > AskNaps1, {ring_ask_naps, AskNaps1, AskNaps2}),
        ?assertEqual(Naps2 - Naps1, AskNaps2 - AskNaps1)
    end).

%% Node N's stats once two rounds in a row of one ask to P each (a read
%% and the loop's idle after it) left its nap counters unchanged: no nap
%% of an earlier dense read is pending any more. At most 200 rounds.
settled_naps(N, P) ->
    settled_naps(N, P, actor_pool:node_stats(N), 0, 200).

settled_naps(_N, _P, S, 2, _Left) ->
    S;
settled_naps(_N, _P, S, _Calm, 0) ->
    error({naps_never_settled, S});
settled_naps(N, P, #{ring_naps := A, ring_ask_naps := B} = S0, Calm, Left) ->
    {ok, 0} = actor_pool:ask(P, 0),
    case actor_pool:node_stats(N) of
        #{ring_naps := A, ring_ask_naps := B} -> settled_naps(N, P, S0, Calm + 1, Left - 1);
        S -> settled_naps(N, P, S, 0, Left - 1)
    end.

%% Each ask of one process that waits for each answer is the only ask its
%% BEAM waits for: the loop reads it with the BEAM's hint and stays awake
%% for the next (node_stats' `ring_lone_windows', one per such read).
%% Asks by distribution and tells are not lone: tells after the lone asks
%% find the hint down again. Asks further apart than the window (1 ms)
%% find it closed: after two windows in a row that caught nothing, the
%% next 4, 8, ... lone asks open none, and the first that is caught again
%% resets that. Back-to-back asks are counted until enough windows opened,
%% within a budget of asks (not of time): a host (or a sanitizer build)
%% that stalls past the window now and then makes some of them misses, and
%% the skips after, so a loaded host needs more asks for as many windows.
%% The spaced asks may start in a skip: at most 6 windows for 20.
lone_asks_keep_the_loop_awake(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2}, fun(P) ->
        with_pool(ring_lone_slow, echo, #{workers => 1, fast_path => false}, fun(Slow) ->
            W1 = lone_windows_after_asks(N, P, 100, 40000),
            ?assertEqual([{ok, K} || K <- lists:seq(1, 100)], [actor_pool:ask(Slow, K) || K <- lists:seq(1, 100)]),
            #{processed := Done} = actor_pool:stats(P),
            [ok = actor_pool:tell(P, K) || K <- lists:seq(1, 1000)],
            wait_stats(P, fun(#{processed := C}) -> C >= Done + 1000 end),
            ?assertMatch(#{ring_lone_windows := W1}, actor_pool:node_stats(N)),
            Spaced = [begin timer:sleep(3), actor_pool:ask(P, K) end || K <- lists:seq(1, 20)],
            ?assertEqual([{ok, K} || K <- lists:seq(1, 20)], Spaced),
            #{ring_lone_windows := W2} = actor_pool:node_stats(N),
            ?assert(W2 - W1 =< 6, {ring_lone_windows, W1, W2}),
            lone_windows_after_asks(N, P, 30, 40000)
        end)
    end).

%% Back-to-back asks to P, 50 at a time, until node N's ring_lone_windows
%% rose by Want (its value then), at most Budget asks.
lone_windows_after_asks(N, P, Want, Budget) ->
    #{ring_lone_windows := W0} = actor_pool:node_stats(N),
    lone_windows_after_asks(N, P, W0 + Want, Budget, 0).

lone_windows_after_asks(N, P, Goal, Budget, Asked) ->
    ?assertEqual([{ok, K} || K <- lists:seq(1, 50)], [actor_pool:ask(P, K) || K <- lists:seq(1, 50)]),
    #{ring_lone_windows := W} = actor_pool:node_stats(N),
    if
        W >= Goal -> W;
        Asked + 50 >= Budget -> error({too_few_lone_windows, W, Goal, Asked + 50});
        true -> lone_windows_after_asks(N, P, Goal, Budget, Asked + 50)
    end.

%% A restarted lane server (actor_pool_dp) closes the lanes its predecessor
%% left and makes new ones, also while a pool asked for distribution (its
%% lane entry then carries the map of such pools): calls go by the new
%% ring, the pool that asked for distribution still by distribution.
restarted_lane_server_replaces_every_lane(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 1}, fun(P) ->
        with_pool(ring_restart_slow, echo, #{workers => 1, fast_path => false}, fun(Slow) ->
            ?assertEqual({ok, 1}, actor_pool:ask(P, 1)),
            ?assertEqual({ok, 2}, actor_pool:ask(Slow, 2)),
            #{lane := Seg0} = lane_info(N),
            Old = whereis(actor_pool_dp),
            MRef = monitor(process, Old),
            exit(Old, kill),
            receive {'DOWN', MRef, process, Old, killed} -> ok after ?WAIT_MS -> error(not_killed) end,
            wait_until(fun() -> is_pid(whereis(actor_pool_dp)) end, ?WAIT_MS),
            %% Answered once its init is done (a call before may find the
            %% old lane closed and go by distribution, in order).
            _ = actor_pool_dp:info(),
            ?assertEqual({ok, 3}, actor_pool:ask(P, 3)),
            ?assertEqual({ok, 4}, actor_pool:ask(Slow, 4)),
            #{lane := Seg1} = lane_info(N),
            ?assertNotEqual(Seg0, Seg1),
            ?assertMatch(#{by_path := #{ring := 2, dist := 0}}, actor_pool:stats(P)),
            ?assertMatch(#{by_path := #{ring := 0, dist := 2}}, actor_pool:stats(Slow))
        end)
    end).

%% A lone caller's asks are answered in the ask's own NIF call (the
%% segment's `awaited' counter), with the same answers, and leave nothing
%% in the mailbox; many callers at once wait as messages and get the same.
%% (On a busy host the pool node may miss the short wait; lone asks go on
%% until one is taken, for at most 10 s.)
lone_asks_take_their_answers_on_their_scheduler(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2}, fun(P) ->
        ?assertEqual({ok, <<"warm">>}, actor_pool:ask(P, <<"warm">>)),
        #{segment := #{awaited := A0}} = lane_info(N),
        Terms = [{K, binary:copy(<<K>>, K rem 256)} || K <- lists:seq(1, 500)],
        ?assertEqual([{ok, T} || T <- Terms], [actor_pool:ask(P, T) || T <- Terms]),
        Deadline = erlang:monotonic_time(millisecond) + 10000,
        Taken = fun Taken(K) ->
                    {ok, K} = actor_pool:ask(P, K),
                    #{segment := #{awaited := A}} = lane_info(N),
                    A > A0 orelse (erlang:monotonic_time(millisecond) < Deadline andalso Taken(K + 1))
                end,
        ?assert(Taken(0)),
        Self = self(),
        Pids = [spawn_link(fun() ->
                                   R = [actor_pool:ask(P, {C, K}) =:= {ok, {C, K}} || K <- lists:seq(1, 200)],
                                   Self ! {self(), lists:all(fun(X) -> X end, R)}
                           end) || C <- lists:seq(1, 16)],
        [receive {Pid, Ok} -> ?assert(Ok) after 30000 -> error(hung) end || Pid <- Pids],
        ?assertEqual([], flush_mailbox()),
        #{segment := #{late := 0, pending := 0}} = lane_info(N)
    end).

%% A caller that has its answer finds the worker's mailbox slot free again:
%% the message leaves the mailbox's depth before its answer is sent, so
%% asks in a row never get `overloaded' from a mailbox_limit of 1, by ring
%% or by distribution (they did once answers came fast enough to overtake
%% the worker's bookkeeping).
sequential_asks_never_overflow_a_one_slot_mailbox(_Ctx) ->
    [with_pool(list_to_atom("one_slot_" ++ atom_to_list(Fast)), echo,
               #{workers => 1, mailbox_limit => 1, fast_path => Fast}, fun(P) ->
         Answers = [actor_pool:ask(P, K) || K <- lists:seq(1, 3000)],
         ?assertEqual([], [{K, A} || {K, A} <- lists:zip(lists:seq(1, 3000), Answers), A =/= {ok, K}]),
         #{overloaded := 0} = actor_pool:stats(P)
     end) || Fast <- [true, false]],
    ok.

%% Answers holding maps of more than 32 keys (hash maps), alone or inside
%% other terms, from many callers at once (the NIF's reply thread delivers
%% them) and from a lone one: equal answers, and the VM lives (OTP before
%% 27.3 crashed decoding such a map on a thread that is no scheduler,
%% erlang/otp#8208: the reply thread now passes their bytes on).
answers_holding_large_maps_arrive_whole(_Ctx) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2}, fun(P) ->
        Map = fun(N) -> maps:from_list([{K, {K, <<K:32>>}} || K <- lists:seq(1, N)]) end,
        Terms = [Map(33), Map(200), {wrapped, [Map(129)]}, #{inner => Map(5000)}, Map(32)],
        Self = self(),
        Pids = [spawn_link(fun() ->
                                   R = [actor_pool:ask(P, T) =:= {ok, T} || _ <- lists:seq(1, 10), T <- Terms],
                                   Self ! {self(), lists:all(fun(X) -> X end, R)}
                           end) || _ <- lists:seq(1, 8)],
        [receive {Pid, Ok} -> ?assert(Ok) after 60000 -> error(hung) end || Pid <- Pids],
        ?assertEqual([{ok, T} || T <- Terms], [actor_pool:ask(P, T) || T <- Terms])
    end).

%% The NIF reads pool names as Latin-1 only: a pool named outside it is
%% reached by distribution, by name and {Name, Node}, with the same answers
%% (no badarg), in order after what the same process sent by ring; by pid
%% it goes by ring.
pool_named_outside_latin1_answers_by_distribution(#{pool_node := N}) ->
    Name = binary_to_atom(<<"пул_"/utf8, (integer_to_binary(erlang:unique_integer([positive])))/binary>>, utf8),
    with_pool(Name, echo, #{workers => 1}, fun(P) ->
        ?assertEqual({ok, <<"a">>}, actor_pool:ask(P, <<"a">>)),
        [ok = actor_pool:tell(Name, <<"t">>) || _ <- lists:seq(1, 10)],
        ?assertEqual({ok, <<"b">>}, actor_pool:ask(Name, <<"b">>)),
        ?assertEqual({ok, <<"c">>}, actor_pool:ask({Name, N}, <<"c">>)),
        S = wait_stats(P, fun(#{processed := C}) -> C >= 13 end),
        ?assertEqual(#{dist => 12, ring => 1}, maps:get(by_path, S))
    end).

%% Pools started with fast_path true (the default) and false answer the
%% same terms the same way, by pid, name, {Name, Node} and service key; the
%% first counts only ring messages, the second only distribution ones.
every_reference_form_answers_alike_over_ring_and_distribution(#{pool_node := N}) ->
    KF = actor_receptionist:service_key(<<"ring.fast">>),
    KS = actor_receptionist:service_key(<<"ring.slow">>),
    with_pool(ring_fast, echo, #{workers => 2, service_key => KF}, fun(F) ->
    with_pool(ring_slow, echo, #{workers => 2, service_key => KS, fast_path => false}, fun(S) ->
        Terms = [<<"bin">>, <<>>, binary:copy(<<7>>, 70000), 1 bsl 200, -3, 1.5, atom,
                 'héllo', "string", [a | b], {}, #{a => [1, {2}]}, self(), make_ref(),
                 fun lists:reverse/1, <<1:3>>, {'$gen_call', x, y}, {'$gen_cast', z}],
        Forms = fun(P, Name, Key) -> [P, Name, {Name, N}, Key] end,
        Fast = [actor_pool:ask(R, T) || R <- Forms(F, ring_fast, KF), T <- Terms],
        Slow = [actor_pool:ask(R, T) || R <- Forms(S, ring_slow, KS), T <- Terms],
        ?assertEqual([{ok, T} || _ <- Forms(F, ring_fast, KF), T <- Terms], Fast),
        ?assertEqual(Fast, Slow),
        [ok = actor_pool:tell(R, T) || R <- Forms(F, ring_fast, KF), T <- Terms],
        [ok = actor_pool:tell(R, T) || R <- Forms(S, ring_slow, KS), T <- Terms],
        StatsF = [actor_pool:stats(R) || R <- [F, ring_fast, {ring_fast, N}]],
        StatsS = [actor_pool:stats(R) || R <- [S, ring_slow, {ring_slow, N}]],
        ?assertEqual(lists:duplicate(3, ring_fast), [maps:get(name, X) || X <- StatsF]),
        ?assertEqual(lists:duplicate(3, ring_slow), [maps:get(name, X) || X <- StatsS]),
        ?assertEqual([lists:sort(maps:keys(X)) || X <- StatsF],
                     [lists:sort(maps:keys(X)) || X <- StatsS]),
        Total = 2 * 4 * length(Terms),
        SF = wait_stats(F, fun(#{processed := C}) -> C >= Total end),
        SS = wait_stats(S, fun(#{processed := C}) -> C >= Total end),
        ?assertEqual(#{dist => 0, ring => Total}, maps:get(by_path, SF)),
        ?assertEqual(#{dist => Total, ring => 0}, maps:get(by_path, SS))
    end) end).

%% Refusals, crashes, overload, unknown pools and stopped pools: the same
%% answer whichever path carried the ask.
errors_are_identical_over_ring_and_distribution(#{pool_node := N}) ->
    Run = fun(Fast) ->
        Name = list_to_atom("ring_err_" ++ atom_to_list(Fast)),
        with_pool(Name, crash_plugin(), #{workers => 1, mailbox_limit => 1, fast_path => Fast},
                  fun(P) ->
            R1 = actor_pool:ask(P, {fail, no_thanks}),
            R2 = actor_pool:ask(P, <<"crash">>),
            _ = wait_stats(P, fun(#{workers := [#{alive := A}]}) -> A end),
            %% One in the worker fills its mailbox (limit 1): the next
            %% ask overflows.
            Self = self(),
            Sleepers = [spawn_link(fun() -> Self ! {slept, self(), actor_pool:ask(P, {sleep, 400})} end)],
            _ = wait_stats(P, fun(#{workers := [#{mailbox := M}]}) -> M >= 1 end),
            R3 = actor_pool:ask(P, <<"over">>),
            Slept = [receive {slept, Pid, R} -> R after ?WAIT_MS -> error(sleeper) end
                     || Pid <- Sleepers],
            R4 = actor_pool:ask({no_such_ring_pool, N}, x),
            R5 = actor_pool:stats({no_such_ring_pool, N}),
            {[R1, R2, R3, R4, R5 | Slept], maps:get(by_path, actor_pool:stats(P))}
        end)
    end,
    {Fast, FastPaths} = Run(true),
    {Slow, SlowPaths} = Run(false),
    ?assertEqual([{error, no_thanks}, {error, worker_crashed}, {error, overloaded},
                  {error, noproc}, {error, noproc}, {ok, ok}], Fast),
    ?assertEqual(Fast, Slow),
    ?assertMatch(#{dist := 0, ring := R} when R >= 4, FastPaths),
    ?assertMatch(#{dist := D, ring := 0} when D >= 4, SlowPaths),
    %% A stopped pool's pid and name: noproc both ways.
    {ok, Gone} = actor_pool:start_pool(ring_gone, echo, #{workers => 1}),
    ok = actor_pool:stop_pool(Gone),
    ?assertEqual({error, noproc}, actor_pool:ask(Gone, x)),
    ?assertEqual({error, noproc}, actor_pool:ask(ring_gone, x)),
    ?assertEqual({error, noproc}, actor_pool:stats(Gone)),
    %% The same once records reached it by name and by pid (the pool node
    %% keeps the last destination it resolved), and the name then reaches
    %% the next pool of that name.
    {ok, Gone2} = actor_pool:start_pool(ring_gone, echo, #{workers => 1}),
    ?assertEqual({ok, b}, actor_pool:ask(ring_gone, b)),
    ?assertEqual({ok, a}, actor_pool:ask(Gone2, a)),
    ok = actor_pool:stop_pool(Gone2),
    ?assertEqual({error, noproc}, actor_pool:ask(Gone2, x)),
    ?assertEqual({error, noproc}, actor_pool:ask(ring_gone, x)),
    {ok, Next} = actor_pool:start_pool(ring_gone, echo, #{workers => 1}),
    ?assertEqual({ok, c}, actor_pool:ask(ring_gone, c)),
    ?assertMatch(#{processed := 1, by_path := #{ring := 1, dist := 0}}, actor_pool:stats(Next)),
    ok = actor_pool:stop_pool(Next).

%% Terms too large to encode within one NIF call but small enough for a
%% ring record (a 100K-element list, a tuple with a 200 KB binary, a tuple
%% of 2000 tuples) are encoded by the caller and go by ring all the same
%% (the segment's `encoded' counter), asked and told, between small
%% messages, and come back from an echo pool equal.
large_terms_are_encoded_by_the_caller_and_arrive_whole(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 1, mailbox_limit => 1048576}, fun(P) ->
        ?assertEqual({ok, <<"warm">>}, actor_pool:ask(P, <<"warm">>)),
        #{lane := Seg} = lane_info(N),
        #{encoded := E0} = actor_dp:info(Seg),
        Large = [lists:seq(1, 100000), {doc, binary:copy(<<"j">>, 200000)},
                 list_to_tuple([{K, <<K:32>>} || K <- lists:seq(1, 2000)])],
        ?assertEqual([{ok, T} || T <- Large], [actor_pool:ask(P, T) || T <- Large]),
        [begin ok = actor_pool:tell(P, T), ok = actor_pool:tell(P, small) end || T <- Large],
        %% one worker: once `last' is answered, everything before it was
        %% handled
        ?assertEqual({ok, last}, actor_pool:ask(P, last)),
        ?assertMatch(#{processed := 11, by_path := #{dist := 0, ring := 11}}, actor_pool:stats(P)),
        ?assertMatch(#{encoded := E} when E =:= E0 + 6, actor_dp:info(Seg))
    end).

fast_path_option_is_validated(_Ctx) ->
    [?assertEqual({error, {badarg, {fast_path, V}}},
                  actor_pool:start_pool(ring_bad_opt, echo, #{fast_path => V}))
     || V <- [maybe, 1, "true", undefined]],
    ?assertEqual([], [x || {ring_bad_opt, _} <- actor_pool:which_pools()]).

%% The application setting turns the rings off for every pool (the lane is
%% closed, the reason shown by actor_pool_dp:info/0) and on again.
fast_path_false_setting_sends_by_distribution(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2}, fun(P) ->
        ?assertEqual({ok, 1}, actor_pool:ask(P, 1)),
        ok = application:set_env(actor_pool, fast_path, false),
        try
            ok = actor_pool_dp:refresh(),
            ?assertMatch(#{transport := distribution, reason := {fast_path, false}}, lane_info(N)),
            ?assertEqual({ok, 2}, actor_pool:ask(P, 2)),
            ok = actor_pool:tell(P, 3),
            ?assertMatch(#{by_path := #{dist := 2, ring := 1}},
                         wait_stats(P, fun(#{processed := C}) -> C >= 3 end))
        after
            ok = application:set_env(actor_pool, fast_path, true),
            ok = actor_pool_dp:refresh()
        end,
        ?assertEqual({ok, 4}, actor_pool:ask(P, 4)),
        ?assertMatch(#{transport := ring}, lane_info(N)),
        ?assertMatch(#{by_path := #{dist := 2, ring := 2}}, actor_pool:stats(P))
    end).

%% One process sends tells, asks and stats requests while it is moved from
%% scheduler to scheduler (so from request ring to request ring). One
%% worker handles its mailbox in order and each tell takes a moment
%% ({sleep, 0}), so a tell that arrived after the ask would still be
%% unhandled when the stats request behind the ask is answered (`processed'
%% is counted before a reply is sent; the mailbox gauge only after, so it is
%% not checked).
order_holds_across_scheduler_changes(_Ctx) ->
    Scheds = erlang:system_info(schedulers_online),
    ?assert(Scheds >= 2),
    Rounds = 40,
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1, mailbox_limit => 1048576}, fun(P) ->
        Self = self(),
        {Pid, Mref} = spawn_monitor(fun() ->
            _ = lists:foldl(fun(Round, Sent0) ->
                Tells = 20 + rand:uniform(100),
                [begin
                     I rem 25 =:= 0 andalso move_scheduler(Scheds),
                     ok = actor_pool:tell(P, {sleep, 0})
                 end || I <- lists:seq(1, Tells)],
                move_scheduler(Scheds),
                {ok, ok} = actor_pool:ask(P, {sleep, 0}),
                Sent = Sent0 + Tells + 1,
                move_scheduler(Scheds),
                case actor_pool:stats(P) of
                    #{processed := Sent} -> ok;
                    S -> exit({reordered, Round, Sent, maps:get(processed, S), maps:get(workers, S)})
                end,
                Sent
            end, 0, lists:seq(1, Rounds)),
            _ = erlang:process_flag(scheduler, 0),
            Self ! {moves, self(), get(moves)}
        end),
        receive
            {moves, Pid, Moves} ->
                erlang:demonitor(Mref, [flush]),
                %% every round moved at least twice
                ?assert(Moves >= 2 * Rounds);
            {'DOWN', Mref, process, Pid, Why} ->
                error(Why)
        after 100000 ->
            error(order_case_timeout)
        end,
        ?assertMatch(#{by_path := #{dist := 0}}, actor_pool:stats(P))
    end).

%% The pool node is stopped (SIGSTOP) while one process puts tells in the
%% ring of one scheduler, moves to another and asks from there (the sender
%% is seen waiting for the answer). Let go, the pool node finds both rings
%% holding records and reads them in its own order (from the first ring:
%% it was stopped asleep, not halfway through a pass); the ask's record is
%% fenced on the tells' ring, so it is handled after every tell (one
%% worker; each tell takes 1 ms, so the stats request behind the answer
%% would see tells still unhandled had the ask gone first). Both
%% directions, three times each, so that in half the rounds the ask's ring
%% is the one read first; in both isolation modes. (The order test above
%% rarely finds two rings holding records at once: the loop keeps up with
%% one sender.)
order_holds_when_rings_are_read_after_a_stall(_Ctx) ->
    ?assert(erlang:system_info(schedulers_online) >= 2),
    [order_after_a_stall(Name, Isolation)
     || {Name, Isolation} <- [{ring_stall_thread, thread}, {ring_stall_process, process}]].

order_after_a_stall(Name, Isolation) ->
    with_pool(Name, crash_plugin(), #{workers => 1, isolation => Isolation, mailbox_limit => 1048576}, fun(P) ->
        ?assertEqual({ok, ok}, actor_pool:ask(P, {sleep, 0})),
        #{os_pid := OsPid} = actor_cnode:info(actor_pool_node_owner),
        Self = self(),
        Tells = 20,
        [begin
             #{processed := C0} = actor_pool:stats(P),
             wait_loop_asleep(OsPid),
             Asker = spawned_while_stopped(
                       OsPid,
                       fun() ->
                               spawn_link(fun() ->
                                                  bind_scheduler(From),
                                                  [ok = actor_pool:tell(P, {sleep, 1}) || _ <- lists:seq(1, Tells)],
                                                  bind_scheduler(To),
                                                  Answer = actor_pool:ask(P, {sleep, 0}, 30000),
                                                  #{processed := C} = actor_pool:stats(P),
                                                  _ = erlang:process_flag(scheduler, 0),
                                                  Self ! {asked, self(), Answer, C}
                                          end)
                       end, {actor_pool_transport, ring_receive, 4}),
             receive
                 {asked, Asker, Answer, C} ->
                     ?assertEqual({Isolation, {from, From}, {to, To}, {ok, ok}, C0 + Tells + 1},
                                  {Isolation, {from, From}, {to, To}, Answer, C})
             after 30000 -> error(ask_stuck)
             end
         end || _ <- lists:seq(1, 3), {From, To} <- [{1, 2}, {2, 1}]],
        ?assertMatch(#{by_path := #{dist := 0}}, actor_pool:stats(P))
    end).

%% A message too large for a ring goes by distribution; the process's
%% earlier ring messages are read first, and its next ring message waits
%% for the distribution ones. With one worker: once an ask is answered,
%% every earlier message of the process was handled (a stats request right
%% after counts them all).
order_holds_across_a_transport_switch(_Ctx) ->
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1, mailbox_limit => 1048576}, fun(P) ->
        Big = {sleep, 0, binary:copy(<<1>>, 8 * 1024 * 1024)},
        Small = {sleep, 0},
        [begin
             Base = (Round - 1) * 504,
             [ok = actor_pool:tell(P, Small) || _ <- lists:seq(1, 500)],
             %% ring tells, then an ask by distribution
             ?assertEqual({ok, Big}, actor_pool:ask(P, Big, 30000)),
             ?assertMatch(#{processed := C} when C =:= Base + 501,
                          actor_pool:stats(P)),
             %% distribution tells, then an ask by ring
             [ok = actor_pool:tell(P, Big) || _ <- lists:seq(1, 2)],
             ?assertEqual({ok, ok}, actor_pool:ask(P, Small, 30000)),
             ?assertMatch(#{processed := C} when C =:= Base + 504,
                          actor_pool:stats(P))
         end || Round <- lists:seq(1, 3)],
        ?assertMatch(#{by_path := #{dist := 9, ring := 1503}}, actor_pool:stats(P)),
        %% A burst that the pool node is still reading when a message just
        %% over the ring's record size (half the 1 MiB ring) goes out.
        Mid = {sleep, 0, binary:copy(<<2>>, 600 * 1024)},
        [begin
             #{processed := C0} = actor_pool:stats(P),
             [ok = actor_pool:tell(P, Small) || _ <- lists:seq(1, 4000)],
             ?assertEqual({ok, Mid}, actor_pool:ask(P, Mid, 30000)),
             ?assertMatch(#{processed := C} when C =:= C0 + 4001, actor_pool:stats(P))
         end || _ <- lists:seq(1, 5)],
        ?assertMatch(#{counters := #{too_large := TL}} when TL >= 9, actor_pool_dp:info())
    end).

%% The pool node is stopped (SIGSTOP) while a process puts tells in the
%% ring and then an ask too large for a ring: the ask does not leave by
%% distribution while the pool node has not read the tells (the sender is
%% seen waiting for it), and once the pool node runs again every message is
%% handled, the tells first.
switch_to_distribution_waits_until_the_ring_is_read(_Ctx) ->
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1, mailbox_limit => 1048576}, fun(P) ->
        ?assertEqual({ok, ok}, actor_pool:ask(P, {sleep, 0})),
        #{os_pid := OsPid} = actor_cnode:info(actor_pool_node_owner),
        Big = {sleep, 0, binary:copy(<<3>>, 600 * 1024)},
        Self = self(),
        Sender = spawned_while_stopped(
                   OsPid,
                   fun() ->
                           spawn_link(fun() ->
                                              [ok = actor_pool:tell(P, {sleep, 0}) || _ <- lists:seq(1, 100)],
                                              Self ! {asked, self(), actor_pool:ask(P, Big, 30000)}
                                      end)
                   end, {actor_pool_transport, ring_drained, 4}),
        receive {asked, Sender, R} -> ?assertEqual({ok, Big}, R)
        after 30000 -> error(ask_stuck)
        end,
        ?assertMatch(#{processed := 102, by_path := #{dist := 1, ring := 101}}, actor_pool:stats(P))
    end).

%% Asks that time out while the worker sleeps: each is answered
%% {error, timeout} by the NIF at its deadline (a timeout of 0 is
%% cancelled by the caller), and neither its reply nor anything else is
%% left in the caller's mailbox. An infinite timeout waits for the answer.
timed_out_ring_asks_leave_no_late_reply(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 2}, fun(P) ->
        #{lane := Seg} = lane_info(N),
        #{timeouts := Timeouts0} = actor_dp:info(Seg),
        [?assertEqual({error, timeout}, actor_pool:ask(P, {sleep, 60}, T))
         || T <- [0, 1, 5, 20, 40, 55]],
        %% at least: the lane is shared, and an earlier case's ask
        %% abandoned by its caller may reach its timeout meanwhile
        #{timeouts := Timeouts1} = actor_dp:info(Seg),
        ?assert(Timeouts1 - Timeouts0 >= 5, {timeouts, Timeouts0, Timeouts1}),
        ?assertEqual({ok, ok}, actor_pool:ask(P, {sleep, 20}, infinity)),
        _ = wait_stats(P, fun(#{processed := C}) -> C >= 6 end),
        %% racing replies: timeouts around the sleep itself
        Rs = [actor_pool:ask(P, {sleep, 10}, T) || T <- lists:seq(5, 15), _ <- [1, 2]],
        ?assertEqual([], [R || R <- Rs, R =/= {ok, ok}, R =/= {error, timeout}]),
        ?assertEqual({ok, <<"next">>}, actor_pool:ask(P, <<"next">>)),
        ?assertEqual([], flush_mailbox()),
        ?assertMatch(#{by_path := #{dist := 0}}, actor_pool:stats(P))
    end).

%% 8 senders of 400 KB tells and 8 callers of 400 KB asks fill the 1 MiB
%% request rings (two records each): senders wait for room (the NIF counts
%% `full' submits), no tell is dropped, no ask is refused. So that the rings
%% do fill, whatever the host's speed (the ASan builds drain faster than
%% their senders fill), the pool node is stopped (SIGSTOP) until a submit
%% found a ring full, and let go at once: senders wait up to 1 s for room.
full_rings_slow_senders_down_and_lose_nothing(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2, mailbox_limit => 1048576}, fun(P) ->
        #{lane := Seg} = lane_info(N),
        #{full := Full0} = actor_dp:info(Seg),
        #{counters := #{tell_dropped := Dropped0, ask_full := AskFull0}} = actor_pool_dp:info(),
        #{os_pid := OsPid} = actor_cnode:info(actor_pool_node_owner),
        Big = fun(I) -> binary:copy(<<I>>, 400 * 1024) end,
        Self = self(),
        _ = os:cmd("kill -STOP " ++ integer_to_list(OsPid)),
        Pids = try
                   Ps = [spawn_link(fun() ->
                                        [ok = actor_pool:tell(P, Big(I)) || _ <- lists:seq(1, 30)],
                                        Asks = [actor_pool:ask(P, Big(I), 30000) || _ <- lists:seq(1, 10)],
                                        Self ! {done, self(), Asks}
                                    end) || I <- lists:seq(1, 8)],
                   wait_until(fun() -> maps:get(full, actor_dp:info(Seg)) > Full0 end, 800),
                   Ps
               after
                   _ = os:cmd("kill -CONT " ++ integer_to_list(OsPid))
               end,
        Asks = [receive {done, Pid, A} -> A after 60000 -> error(sender_stuck) end || Pid <- Pids],
        ?assertEqual([[{ok, Big(I)} || _ <- lists:seq(1, 10)] || I <- lists:seq(1, 8)], Asks),
        S = wait_stats(P, fun(#{processed := C}) -> C >= 320 end),
        ?assertMatch(#{processed := 320, dropped_tells := 0, by_path := #{dist := 0, ring := 320}}, S),
        ?assertMatch(#{counters := #{tell_dropped := Dropped0, ask_full := AskFull0}},
                     actor_pool_dp:info())
    end).

%% Under 64 callers, answers go out from the deliverer processes' schedulers
%% (the segment's sched_delivered counts them), whole whether a drain
%% passes them on through its heap or, past its budget, through an env;
%% one over 64 KiB is still sent by the reply thread, whole. Two deliverers killed under that load
%% (one at a time, each after the first's restart, each with a hand-over
%% in its queue) cost no answer and no timeout: the reply thread takes
%% their rings back (at once for a new hand-over, within 50 ms for one
%% already sent) until the supervisor's restart registers a new deliverer.
answers_go_out_from_deliverers_and_survive_their_deaths(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2}, fun(P) ->
        ?assertEqual({ok, <<"x">>}, actor_pool:ask(P, <<"x">>)),
        #{lane := Seg} = lane_info(N),
        #{rep_rings := Rings} = actor_dp:info(Seg),
        ?assertError(badarg, actor_dp:drain(Seg, Rings)),
        ?assertError(badarg, actor_dp:deliver_for(2, 2)),
        ?assertError(badarg, actor_dp:deliver_for(0, 0)),
        ?assertError(badarg, actor_dp:deliver_for(0, 65)),
        Big = binary:copy(<<"b">>, 100000),
        Pad = binary:copy(<<"p">>, 100),
        %% Answers of 5 KB (a list: 40 KB decoded) among the small ones: a
        %% drain passes its first 64 KB of answers on through its process's
        %% heap, the rest through the ring's env.
        Mid = lists:duplicate(2500, 7),
        Msg = fun(I, K) when K rem 50 =:= 0 -> {I, K, Big};
                 (I, K) when K rem 3 =:= 0 -> {I, K, Mid};
                 (I, K) -> {I, K, Pad}
              end,
        Self = self(),
        %% Every 50th ask of each caller carries 100 KB, the callers nearly
        %% in step: when the pool node falls behind (a sanitizer build, a
        %% busy host) those can fill the request rings, and an ask refused
        %% for it was not run (`overloaded'), so it is asked again: the case
        %% is about answers, which must all come, whole and on time.
        Ask = fun Ask(M) ->
                      case actor_pool:ask(P, M, 10000) of
                          {error, overloaded} -> erlang:yield(), Ask(M);
                          A -> A
                      end
              end,
        Load = fun(Rounds) ->
            Pids = [{I, spawn_link(fun() ->
                               R = [Ask(Msg(I, K)) || K <- lists:seq(1, Rounds)],
                               Self ! {done, self(), R}
                           end)} || I <- lists:seq(1, 64)],
            [receive
                 {done, Pid, R} ->
                     ?assertEqual([{ok, Msg(I, K)} || K <- lists:seq(1, Rounds)], R)
             after 60000 -> error({caller_stuck, I})
             end || {I, Pid} <- Pids],
            ok
        end,
        #{sched_delivered := D0} = actor_dp:info(Seg),
        ok = Load(100),
        #{sched_delivered := D1, late := Late} = actor_dp:info(Seg),
        ?assert(D1 - D0 > 64 * 100 div 4, {sched_delivered, D1 - D0}),
        %% Killed while the load runs, once it goes through them.
        Killer = spawn_link(fun() ->
                     Dlv = fun() -> lists:sort([{Id, Pid} || {{actor_dp_deliverer, Id}, Pid, _, _}
                                                             <- supervisor:which_children(actor_pool_sup),
                                                         is_pid(Pid)])
                           end,
                     Grown = fun(From) ->
                                 ap_support:poll(fun() -> maps:get(sched_delivered, actor_dp:info(Seg)) end,
                                                 fun(D) -> D > From + 500 end, 20000, 1)
                             end,
                     Kill = fun(Nth) ->
                                {ok, D} = Grown(maps:get(sched_delivered, actor_dp:info(Seg))),
                                {_, Pid} = lists:nth(Nth, Dlv()),
                                %% With a hand-over in its queue: lost with it.
                                true = erlang:suspend_process(Pid),
                                {ok, _} = ap_support:poll(fun() -> process_info(Pid, message_queue_len) end,
                                                          fun({message_queue_len, L}) -> L > 0 end, 5000, 1),
                                exit(Pid, kill),
                                {ok, _} = ap_support:poll(fun() -> lists:keymember(Pid, 2, Dlv()) end,
                                                          fun(Still) -> not Still end, 5000, 1),
                                D
                            end,
                     Kill(1),
                     Kill(min(2, length(Dlv()))),
                     Self ! {killed, self()}
                 end),
        ok = Load(400),
        receive {killed, Killer} -> ok after 10000 -> error(killer_stuck) end,
        #{sched_delivered := D2, late := Late, pending := 0} = actor_dp:info(Seg),
        ?assert(D2 > D1, {sched_delivered, D1, D2})
    end).

%% 64 callers wait on ring asks that the workers hold (they sleep); the
%% pool node is killed with SIGKILL. Every caller gets {error, {nodedown,
%% Node}} or {error, noproc} promptly: none hangs, none waits out its
%% timeout.
killed_pool_node_answers_64_waiting_askers_promptly(#{pool_node := N}) ->
    %% The workers hold the asks until the node dies: no deadline kills them first.
    {ok, P} = actor_pool:start_pool(ring_kill, crash_plugin(), #{workers => 2, handler_timeout_ms => infinity}),
    ?assertEqual({ok, <<"up">>}, actor_pool:ask(P, <<"up">>)),
    #{os_pid := OsPid} = actor_cnode:info(actor_pool_node_owner),
    #{lane := Old} = lane_info(N),
    %% for the next case: this lane must be closed for good
    persistent_term:put({?MODULE, old_lane}, Old),
    Self = self(),
    Askers = [spawn_link(fun() ->
                  T0 = erlang:monotonic_time(millisecond),
                  R = actor_pool:ask(P, {sleep, 20000}, 30000),
                  Self ! {asked, self(), R, erlang:monotonic_time(millisecond) - T0}
              end) || _ <- lists:seq(1, 64)],
    %% all 64 are in the pool (2 sleeping, 62 queued)
    _ = wait_stats(P, fun(#{workers := Ws}) ->
                          lists:sum([M || #{mailbox := M} <- Ws]) >= 64
                      end),
    T0 = erlang:monotonic_time(millisecond),
    _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
    Results = [receive {asked, A, R, _Ms} -> R after 10000 -> {hung, A} end || A <- Askers],
    Elapsed = erlang:monotonic_time(millisecond) - T0,
    HungPids = [A || {hung, A} <- Results],
    Timeouts = length([x || {error, timeout} <- Results]),
    Other = [R || R <- Results, element(1, R) =/= hung, R =/= {error, timeout},
                  R =/= {error, {nodedown, N}}, R =/= {error, noproc}],
    {0, 0, []} =:= {length(HungPids), Timeouts, Other} orelse
        error({{hung, length(HungPids)}, {timeouts, Timeouts}, {other, Other},
               {segment, actor_dp:info(Old)},
               {hung_askers, [process_info(A, [current_stacktrace, messages]) || A <- HungPids]}}),
    ?assert(Elapsed < 5000),
    %% (the askers may learn of it before the kernel has reaped every
    %% thread of the killed process)
    wait_until(fun() -> not os_pid_alive(OsPid) end, 5000).

%% The owner starts the pool node again: the old lane is closed (submits to
%% it answer `closed'), the next call makes a fresh one, over which calls
%% work.
restarted_pool_node_gets_a_fresh_lane(#{pool_node := N}) ->
    Old = persistent_term:get({?MODULE, old_lane}),
    _ = persistent_term:erase({?MODULE, old_lane}),
    wait_until(fun() ->
                   case actor_cnode:info(actor_pool_node_owner) of
                       #{os_pid := Os} when is_integer(Os) -> true;
                       _ -> false
                   end
               end, 30000),
    wait_until(fun() -> lists:member(N, nodes(connected)) end, 30000),
    with_pool(ring_fresh, echo, #{workers => 1}, fun(P) ->
        wait_until(fun() ->
                       _ = actor_pool:ask(P, <<"again">>),
                       maps:get(transport, lane_info_any(N), none) =:= ring
                   end, 15000),
        #{lane := New} = lane_info(N),
        ?assertNotEqual(Old, New),
        ?assertEqual(closed, actor_dp:submit(Old, tell, ring_fresh, x, undefined, undefined)),
        ?assertMatch(#{state := closed}, actor_dp:info(Old)),
        ?assertEqual({ok, <<"fresh">>}, actor_pool:ask(P, <<"fresh">>)),
        ?assertMatch(#{by_path := #{ring := R}} when R >= 1, actor_pool:stats(P))
    end).

%% Pool nodes of their own, each asked over its ring lane and stopped with
%% the lane still open: this node's lane closes its socket while the pool
%% node is leaving, and the node's ring attach thread, seeing that, queued
%% a call to the loop of a node main had already freed (a use after free
%% in the ASan build, 2-3 stops in 100; the sanitizer check of `make
%% eunit-asan' reports it). Each stop ends the OS process and its epmd
%% name.
pool_nodes_stopped_with_their_lanes_open_exit_cleanly(_Ctx) ->
    Exe = os:getenv("ACTOR_POOL_NODE_EXE", "actor_pool_node"),
    [begin
         Alive = alive("lanestop" ++ integer_to_list(I)),
         {ok, Owner} = actor_cnode:start(#{exe => Exe, name => Alive}),
         #{node := PN, os_pid := OsPid} = actor_cnode:info(Owner),
         try
             {ok, P} = actor_pool:start_pool(ring_lanestop, echo, #{node => PN, workers => 2}),
             [?assertEqual({ok, K}, actor_pool:ask(P, K)) || K <- lists:seq(1, 10)],
             ?assertMatch(#{by_path := #{ring := 10}}, actor_pool:stats(P)),
             ?assertMatch(#{transport := ring}, lane_info(PN))
         after
             ok = actor_cnode:stop(Owner)
         end,
         ?assertNot(os_pid_alive(OsPid)),
         wait_until(fun() -> not lists:member(Alive, epmd_names()) end, ?WAIT_MS)
     end || I <- lists:seq(1, 100)],
    ok.

%% ===================================================================
%% Helpers
%% ===================================================================

lane_info(Node) ->
    I = lane_info_any(Node),
    ?assertMatch(#{node := Node}, I),
    I.

lane_info_any(Node) ->
    case [L || #{node := Nd} = L <- maps:get(lanes, actor_pool_dp:info()), Nd =:= Node] of
        [L] -> L;
        [] -> #{}
    end.

scheduler() ->
    erlang:system_info(scheduler_id).

%% Spawn() (it starts a process and returns it) while the pool node (OS
%% pid OsPid) is stopped, until that process is seen in function MFA; then
%% the pool node runs again, whatever happened. The process.
spawned_while_stopped(OsPid, Spawn, MFA) ->
    Os = integer_to_list(OsPid),
    _ = os:cmd("kill -STOP " ++ Os),
    try
        Pid = Spawn(),
        wait_until(fun() -> process_info(Pid, current_function) =:= {current_function, MFA} end, 900),
        Pid
    after
        _ = os:cmd("kill -CONT " ++ Os)
    end.

%% Until the pool node's loop (its main thread) has not run for 2 ms: it
%% sleeps waiting for a bell, past its naps (tens of microseconds) and its
%% spin after traffic. At most 2 s.
wait_loop_asleep(OsPid) ->
    Os = integer_to_list(OsPid),
    File = "/proc/" ++ Os ++ "/task/" ++ Os ++ "/schedstat",
    wait_loop_asleep(File, run_ns(File), 1000).

wait_loop_asleep(_File, _Ns, 0) ->
    error(pool_node_loop_never_asleep);
wait_loop_asleep(File, Ns, Left) ->
    receive after 2 -> ok end,
    case run_ns(File) of
        Ns -> ok;
        Ns1 -> wait_loop_asleep(File, Ns1, Left - 1)
    end.

%% A thread's time on a CPU so far (ns), from its schedstat.
run_ns(File) ->
    {ok, B} = file:read_file(File),
    [Ns | _] = binary:split(B, <<" ">>),
    binary_to_integer(Ns).

%% Bind the calling process to another scheduler and wait until it runs
%% there (process_flag(scheduler, N) moves it at its next schedule-in).
move_scheduler(Scheds) ->
    bind_scheduler(scheduler() rem Scheds + 1),
    put(moves, case get(moves) of undefined -> 1; M -> M + 1 end).

bind_scheduler(To) ->
    _ = erlang:process_flag(scheduler, To),
    move_wait(To, 1000).

move_wait(To, 0) ->
    error({not_moved_to_scheduler, To});
move_wait(To, N) ->
    erlang:yield(),
    case scheduler() of
        To -> ok;
        _ -> move_wait(To, N - 1)
    end.

wait_stats(P, Pred) ->
    Probe = fun() -> S = actor_pool:stats(P), ?assert(is_map(S)), S end,
    case ap_support:poll(Probe, Pred, ?WAIT_MS, ?POLL_MS) of
        {ok, S} -> S;
        {timeout, S} -> error({stats_condition_not_met, S})
    end.

flush_mailbox() ->
    receive M -> [M | flush_mailbox()] after 0 -> [] end.
