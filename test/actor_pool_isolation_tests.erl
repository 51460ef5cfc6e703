%% Crash-isolated workers (pool option `isolation'), handler deadlines
%% (`handler_timeout_ms') and worker memory limits (`max_memory_mb'),
%% against the real pool C node that the application starts, with the test
%% plugin plugin_crash.so (ap_support:test_bin/1) misbehaving on request (`segv', `abort',
%% `{exit, Code}', `{spin, Ms}', `{alloc, Mb}'; `os_pid' answers the OS pid
%% of the process that ran it; `{sleep, Ms}' fills a mailbox).
%%
%% Process mode: a worker that dies costs that worker and the message it ran
%% (`{error, {worker_crashed, Cause}}'), the messages queued behind it are
%% all answered, other workers and pools on the node notice nothing, the
%% pool node keeps its OS pid, and the slot comes back with a new worker
%% process under the backoff. Thread mode: the same misbehaviour takes the
%% pool node down (the documented trade-off) and the keeper brings the
%% pools back. Worker processes never outlive their pool, their pool node or
%% the application. Every case polls with a deadline, never sleeps, and
%% stops what it started; the node-killing ones stop their pools by name
%% (the keeper started them again under new pids).
%%
%% ACTOR_POOL_IO (uring | epoll) selects the pool node's I/O backend.
-module(actor_pool_isolation_tests).

-import(ap_test_util, [with_pool/4, crash_plugin/0]).
-import(ap_support, [poll/3, wait_until/2, os_pid_alive/1]).

-include_lib("eunit/include/eunit.hrl").

-export([options_are_validated_before_the_node_is_asked/1,
         stats_show_isolation_limits_and_worker_processes/1,
         segv_costs_one_worker_process/1,
         abort_costs_one_worker_process/1,
         exit_costs_one_worker_process/1,
         handler_crash_status_is_counted_apart/1,
         tell_first_to_a_new_worker_process_is_handled/1,
         ask_ahead_of_slow_tells_is_answered_before_them/1,
         overrun_handler_process_is_killed_and_replaced/1,
         runaway_allocation_kills_one_worker_process/1,
         killed_worker_process_is_replaced_and_the_pool_keeps_its_size/1,
         repeated_segfaults_slow_down_respawns/1,
         segv_in_thread_mode_takes_the_pool_node_down/1,
         abort_in_thread_mode_takes_the_pool_node_down/1,
         exit_in_thread_mode_takes_the_pool_node_down/1,
         overrun_thread_is_hung_skipped_and_rejoins/1,
         bounded_allocation_in_thread_mode_just_works/1,
         every_ask_answered_once_and_tells_add_up/1,
         loop_answers_worker_processes_under_ring_traffic/1,
         loop_waits_for_worker_process_answers_before_it_naps/1,
         worker_processes_with_quick_asks_follow_the_loop/1,
         stop_pool_leaves_no_worker_process/1,
         stop_pool_answers_queued_asks_stopped_in_both_modes/1,
         stop_pool_while_starting_answers_stopped_in_both_modes/1,
         replacement_in_its_init_is_restarting_and_skipped_in_both_modes/1,
         tell_flood_into_a_small_mailbox_is_all_counted_in_both_modes/1,
         killed_worker_process_hands_on_its_bare_tells/1,
         killed_pool_node_leaves_no_worker_process/1,
         application_stop_leaves_no_worker_process/1]).

-define(WAIT_MS, 10000).
%% Generous: a killer may stand behind sleeps, and a sanitizer build of the
%% pool node restarts workers slowly.
-define(ASK_MS, 20000).

%% ===================================================================
%% Fixture
%% ===================================================================

actor_pool_isolation_test_() ->
    {setup, fun setup/0, fun cleanup/1,
     fun(Ctx) ->
             [case_(Name, Ctx) || Name <- [
                 options_are_validated_before_the_node_is_asked,
                 stats_show_isolation_limits_and_worker_processes,
                 segv_costs_one_worker_process,
                 abort_costs_one_worker_process,
                 exit_costs_one_worker_process,
                 handler_crash_status_is_counted_apart,
                 tell_first_to_a_new_worker_process_is_handled,
                 ask_ahead_of_slow_tells_is_answered_before_them,
                 overrun_handler_process_is_killed_and_replaced,
                 runaway_allocation_kills_one_worker_process,
                 killed_worker_process_is_replaced_and_the_pool_keeps_its_size,
                 repeated_segfaults_slow_down_respawns,
                 overrun_thread_is_hung_skipped_and_rejoins,
                 bounded_allocation_in_thread_mode_just_works,
                 every_ask_answered_once_and_tells_add_up,
                 loop_answers_worker_processes_under_ring_traffic,
                 loop_waits_for_worker_process_answers_before_it_naps,
                 worker_processes_with_quick_asks_follow_the_loop,
                 stop_pool_leaves_no_worker_process,
                 stop_pool_answers_queued_asks_stopped_in_both_modes,
                 stop_pool_while_starting_answers_stopped_in_both_modes,
                 replacement_in_its_init_is_restarting_and_skipped_in_both_modes,
                 tell_flood_into_a_small_mailbox_is_all_counted_in_both_modes,
                 killed_worker_process_hands_on_its_bare_tells,
                 %% These kill the pool node.
                 segv_in_thread_mode_takes_the_pool_node_down,
                 abort_in_thread_mode_takes_the_pool_node_down,
                 exit_in_thread_mode_takes_the_pool_node_down,
                 killed_pool_node_leaves_no_worker_process,
                 %% Last: it stops and starts the application.
                 application_stop_leaves_no_worker_process]]
     end}.

case_(Name, Ctx) ->
    Run = case lists:member(Name, ring_cases()) of
              true -> fun() -> ap_test_util:on_rings(fun() -> ?MODULE:Name(Ctx) end) end;
              false -> fun() -> ?MODULE:Name(Ctx) end
          end,
    {atom_to_list(Name), {timeout, 120, Run}}.

%% Cases about what the pool node's loop does with ring traffic: they take
%% the rings in a run on distribution only too (ap_test_util:on_rings/1).
ring_cases() ->
    [loop_answers_worker_processes_under_ring_traffic,
     loop_waits_for_worker_process_answers_before_it_naps,
     worker_processes_with_quick_asks_follow_the_loop,
     killed_worker_process_hands_on_its_bare_tells].

setup() -> ap_test_util:pool_setup().

cleanup(Ctx) -> ap_test_util:pool_cleanup(Ctx).

%% ===================================================================
%% Options and stats
%% ===================================================================

options_are_validated_before_the_node_is_asked(_Ctx) ->
    Before = actor_pool:which_pools(),
    Plugin = crash_plugin(),
    Bad = [{echo, #{isolation => fork}, {isolation, fork}},
           {echo, #{isolation => "process"}, {isolation, "process"}},
           {echo, #{handler_timeout_ms => 0}, {handler_timeout_ms, 0}},
           {echo, #{handler_timeout_ms => -5}, {handler_timeout_ms, -5}},
           {echo, #{handler_timeout_ms => 86400001}, {handler_timeout_ms, 86400001}},
           {echo, #{handler_timeout_ms => 1.5}, {handler_timeout_ms, 1.5}},
           {echo, #{handler_timeout_ms => never}, {handler_timeout_ms, never}},
           {Plugin, #{max_memory_mb => 0}, {max_memory_mb, 0}},
           {Plugin, #{max_memory_mb => 1048577}, {max_memory_mb, 1048577}},
           {Plugin, #{max_memory_mb => big}, {max_memory_mb, big}},
           %% A memory limit needs a worker process to set it on: refused
           %% for a thread pool, explicit or by default (the built-ins).
           {Plugin, #{isolation => thread, max_memory_mb => 64}, {max_memory_mb, 64}},
           {echo, #{max_memory_mb => 64}, {max_memory_mb, 64}},
           {json_validate, #{max_memory_mb => 1}, {max_memory_mb, 1}}],
    [?assertEqual({Handler, Opts, {error, {badarg, Expected}}},
                  {Handler, Opts, actor_pool:start_pool(?FUNCTION_NAME, Handler, Opts)})
     || {Handler, Opts, Expected} <- Bad],
    ?assertEqual(Before, actor_pool:which_pools()),
    %% The bounds and `infinity' pass: the call goes on to the pool node
    %% (here one that does not exist, so that nothing starts).
    [_, Host] = string:split(atom_to_list(node()), "@"),
    Nowhere = list_to_atom(ap_test_util:alive("nowhere") ++ "@" ++ Host),
    Good = [{echo, #{isolation => thread, handler_timeout_ms => 1, max_memory_mb => infinity}},
            {echo, #{isolation => process, max_memory_mb => 1}},
            {echo, #{handler_timeout_ms => 86400000}},
            {echo, #{handler_timeout_ms => infinity}},
            {Plugin, #{max_memory_mb => 1048576}},
            {Plugin, #{isolation => process, max_memory_mb => 1, handler_timeout_ms => infinity}},
            {Plugin, #{isolation => thread, max_memory_mb => infinity}}],
    [?assertEqual({Handler, Opts, {error, {nodedown, Nowhere}}},
                  {Handler, Opts, actor_pool:start_pool(?FUNCTION_NAME, Handler, Opts#{node => Nowhere})})
     || {Handler, Opts} <- Good],
    ?assertEqual(Before, actor_pool:which_pools()).

%% The defaults by handler, the limits as given, and per worker its OS pid
%% (a child of the pool node, the process that runs the handler) and state.
stats_show_isolation_limits_and_worker_processes(_Ctx) ->
    NodePid = node_os_pid(),
    Zero = #{signal => 0, exit => 0, timeout => 0, handler => 0},
    with_pool(iso_stats_plugin, crash_plugin(), #{workers => 3}, fun(P) ->
        S = stats_when(P, fun all_running/1),
        %% A worker process gets a deadline by default (a thread does not).
        ?assertMatch(#{isolation := process, handler_timeout_ms := 5000,
                       max_memory_mb := infinity, crashes := 0}, S),
        ?assertEqual(Zero, maps:get(crash_causes, S)),
        Pids = os_pids(S),
        ?assertEqual(3, length(lists:usort(Pids))),
        ?assertNot(lists:member(NodePid, Pids)),
        [?assert(lists:member(Pid, descendants(NodePid))) || Pid <- Pids],
        %% Each worker's answer comes from one of those processes.
        Answered = lists:usort([Pid || {ok, Pid} <- [actor_pool:ask(P, <<"os_pid">>)
                                                     || _ <- lists:seq(1, 6)]]),
        ?assertEqual(lists:sort(Pids), Answered)
    end),
    with_pool(iso_stats_limits, crash_plugin(),
              #{workers => 1, handler_timeout_ms => 2500, max_memory_mb => 512}, fun(P) ->
        ?assertMatch(#{isolation := process, handler_timeout_ms := 2500, max_memory_mb := 512},
                     stats_when(P, fun all_running/1))
    end),
    with_pool(iso_stats_echo, echo, #{workers => 2}, fun(P) ->
        S = actor_pool:stats(P),
        ?assertMatch(#{isolation := thread, handler_timeout_ms := infinity,
                       max_memory_mb := infinity}, S),
        ?assertEqual(Zero, maps:get(crash_causes, S)),
        [?assertMatch(#{os_pid := undefined, state := running}, W) || W <- workers(S)]
    end),
    with_pool(iso_stats_thread_plugin, crash_plugin(),
              #{workers => 2, isolation => thread, handler_timeout_ms => 5000}, fun(P) ->
        S = actor_pool:stats(P),
        ?assertMatch(#{isolation := thread, handler_timeout_ms := 5000}, S),
        [?assertMatch(#{os_pid := undefined, state := running}, W) || W <- workers(S)],
        %% The handler runs in the pool node itself.
        ?assertEqual({ok, NodePid}, actor_pool:ask(P, <<"os_pid">>))
    end),
    %% A built-in may run in worker processes too.
    with_pool(iso_stats_echo_process, echo, #{workers => 2, isolation => process}, fun(P) ->
        S = stats_when(P, fun all_running/1),
        ?assertMatch(#{isolation := process}, S),
        ?assertEqual(2, length(lists:usort(os_pids(S)))),
        ?assertEqual({ok, <<"e">>}, actor_pool:ask(P, <<"e">>))
    end).

%% ===================================================================
%% Process isolation: one worker dies, nothing else notices
%% ===================================================================

segv_costs_one_worker_process(_Ctx) ->
    one_worker_dies(?FUNCTION_NAME, #{}, <<"segv">>,
                    {error, {worker_crashed, sigsegv}}, signal).

abort_costs_one_worker_process(_Ctx) ->
    one_worker_dies(?FUNCTION_NAME, #{}, <<"abort">>,
                    {error, {worker_crashed, sigabrt}}, signal).

exit_costs_one_worker_process(_Ctx) ->
    one_worker_dies(?FUNCTION_NAME, #{}, {exit, 7},
                    {error, {worker_crashed, {exit, 7}}}, exit).

%% AP_HANDLER_CRASH answers as it does in thread mode, counted as `handler'.
handler_crash_status_is_counted_apart(_Ctx) ->
    one_worker_dies(?FUNCTION_NAME, #{}, <<"crash">>, {error, worker_crashed}, handler).

%% The first result of a new worker process is a tell's (empty): nothing to
%% copy into a reply buffer that does not exist yet (the sanitizer build
%% of the pool node died on the NULL memcpy).
tell_first_to_a_new_worker_process_is_handled(_Ctx) ->
    NodePid = node_os_pid(),
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1}, fun(P) ->
        _ = stats_when(P, fun all_running/1),
        ok = actor_pool:tell(P, <<"first">>),
        _ = stats_when(P, fun(#{processed := N}) -> N >= 1 end),
        ?assertEqual({ok, <<"then">>}, actor_pool:ask(P, <<"then">>)),
        ?assertMatch(#{processed := 2, crashes := 0}, actor_pool:stats(P)),
        ?assertEqual(NodePid, node_os_pid())
    end).

%% An ask queued in the worker process ahead of slow tells (40 of 5 ms,
%% behind a first one of 100 ms that keeps the process busy while they
%% come) is answered as soon as the process has run it, as in thread mode:
%% when the answer arrives, tells are still unhandled. (The process
%% batched its answers until its queue ran dry: the ask waited for every
%% tell behind it.) Then every tell is handled.
ask_ahead_of_slow_tells_is_answered_before_them(_Ctx) ->
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1, isolation => process}, fun(P) ->
        ?assertEqual({ok, ok}, actor_pool:ask(P, {sleep, 0})),
        #{processed := C0} = actor_pool:stats(P),
        ok = actor_pool:tell(P, {sleep, 100}),
        Self = self(),
        Asker = spawn_link(fun() -> Self ! {asked, self(), actor_pool:ask(P, {sleep, 0}, ?ASK_MS)} end),
        %% Its ask is queued behind the first tell (no order holds between
        %% two processes' messages: the tells go once it is there).
        _ = stats_when(P, fun(S) -> [2] =:= [M || #{mailbox := M} <- workers(S)] end),
        [ok = actor_pool:tell(P, {sleep, 5}) || _ <- lists:seq(1, 40)],
        receive {asked, Asker, Answer} -> ?assertEqual({ok, ok}, Answer)
        after ?ASK_MS -> error(ask_stuck)
        end,
        #{processed := C} = actor_pool:stats(P),
        ?assert(C < C0 + 42, {processed, C0, C}),
        _ = stats_when(P, fun(#{processed := N}) -> N =:= C0 + 42 end),
        ?assertMatch(#{errors := 0, crashes := 0}, actor_pool:stats(P))
    end).

%% A handler that never returns: its asker gets handler_timeout and the
%% worker process is killed and replaced. The sleeps ahead of it stay well
%% within the deadline.
overrun_handler_process_is_killed_and_replaced(_Ctx) ->
    one_worker_dies(?FUNCTION_NAME, #{handler_timeout_ms => 1000}, {spin, infinity},
                    {error, handler_timeout}, timeout).

%% An allocation without bound fails at the limit (malloc returns NULL and
%% the plugin aborts, as an unchecked one would crash): one worker, not the
%% host's memory or the pool node. Under the limit it just works.
runaway_allocation_kills_one_worker_process(_Ctx) ->
    Opts = #{max_memory_mb => 256},
    Dead = one_worker_dies(?FUNCTION_NAME, Opts, {alloc, 1024},
                           {error, {worker_crashed, sigabrt}}, signal),
    %% A sanitizer build limits the worker by its allocator's RSS limit
    %% instead (shadow memory rules out rlimits), which says so in a report.
    provoked_asan_report(Dead, <<"AddressSanitizer: soft rss limit exhausted">>, <<>>),
    with_pool(?FUNCTION_NAME, crash_plugin(), Opts#{workers => 1}, fun(P) ->
        ?assertEqual({ok, {ok, 32}}, actor_pool:ask(P, {alloc, 32}, ?ASK_MS)),
        ?assertMatch(#{crashes := 0}, actor_pool:stats(P))
    end).

%% Pool of two workers: both busy with a sleep, the killer queued behind
%% worker A's, then 20 short sleeps alternating A and B (all from this
%% process, so round robin places them exactly). Worker A dies on the
%% killer: its asker gets Answer, the 10 sleeps behind it move and every
%% one is answered; the neighbours (an echo pool, a process plugin pool, a
%% thread plugin pool) notice nothing, the pool node keeps its OS pid, and
%% A's slot comes back with a new process.
one_worker_dies(Name, Opts, Killer, Answer, Cause) ->
    NodePid = node_os_pid(),
    with_neighbours(Name, fun(Ns) ->
        Opts1 = maps:merge(#{workers => 2, routing => round_robin,
                             backoff => #{min_ms => 20, max_ms => 200}}, Opts),
        with_pool(Name, crash_plugin(), Opts1, fun(P) ->
            S0 = stats_when(P, fun all_running/1),
            ?assertMatch(#{isolation := process}, S0),
            Pids0 = os_pids(S0),
            Sleeps = [gen_server:send_request(P, {sleep, 300}) || _ <- [a, b]],
            Kill = gen_server:send_request(P, Killer),
            Queued = [gen_server:send_request(P, {sleep, 10}) || _ <- lists:seq(1, 20)],
            ?assertEqual({reply, Answer}, gen_server:wait_response(Kill, ?ASK_MS)),
            ?assertEqual([{reply, {ok, ok}} || _ <- Sleeps ++ Queued],
                         [gen_server:wait_response(R, ?ASK_MS) || R <- Sleeps ++ Queued]),
            ?assertEqual(NodePid, node_os_pid()),
            check_neighbours(Ns),
            S1 = stats_when(P, fun(S) -> all_running(S) andalso maps:get(restarts, S) >= 1 end),
            ?assertMatch(#{size := 2, crashes := 1, restarts := 1}, S1),
            ?assertEqual(causes(#{Cause => 1}), maps:get(crash_causes, S1)),
            ?assertEqual([0, 1], lists:sort([C || #{crashes := C} <- workers(S1)])),
            ?assertEqual(22, maps:get(processed, S1)),
            %% One process was replaced, the other kept; the dead one is gone.
            Pids1 = os_pids(S1),
            [Dead] = Pids0 -- Pids1,
            [New] = Pids1 -- Pids0,
            ?assertNot(os_pid_alive(Dead)),
            ?assert(lists:member(New, descendants(NodePid))),
            [?assertEqual({ok, {after_crash, I}}, actor_pool:ask(P, {after_crash, I}))
             || I <- lists:seq(1, 6)],
            Dead
        end)
    end).

%% Seed case 5 literally: kill -9 of one worker's OS pid from outside. The
%% slot is `restarting' (no OS pid) for its backoff, then the pool is back
%% to its size with a new process; the kill is a crash by signal.
killed_worker_process_is_replaced_and_the_pool_keeps_its_size(_Ctx) ->
    NodePid = node_os_pid(),
    with_neighbours(?FUNCTION_NAME, fun(Ns) ->
        with_pool(?FUNCTION_NAME, crash_plugin(),
                  #{workers => 4, backoff => #{min_ms => 300, max_ms => 300}}, fun(P) ->
            S0 = stats_when(P, fun all_running/1),
            [#{id := Id, os_pid := Victim} | _] = workers(S0),
            kill_9(Victim),
            Down = stats_when(P, fun(S) ->
                                     lists:any(fun(#{id := I, state := restarting}) -> I =:= Id;
                                                  (_) -> false
                                               end, workers(S))
                                 end),
            ?assertMatch(#{alive := false, os_pid := undefined, crashes := 1},
                         worker(Id, Down)),
            %% The other workers serve meanwhile.
            [?assertEqual({ok, {meanwhile, I}}, actor_pool:ask(P, {meanwhile, I}))
             || I <- lists:seq(1, 6)],
            S1 = stats_when(P, fun all_running/1),
            ?assertMatch(#{size := 4, crashes := 1, restarts := 1}, S1),
            ?assertEqual(causes(#{signal => 1}), maps:get(crash_causes, S1)),
            ?assertEqual(4, length(workers(S1))),
            Pids1 = os_pids(S1),
            ?assertEqual(os_pids(S0) -- [Victim], Pids1 -- [maps:get(os_pid, worker(Id, S1))]),
            ?assertNot(lists:member(Victim, Pids1)),
            ?assertEqual(NodePid, node_os_pid()),
            check_neighbours(Ns),
            [?assertEqual({ok, <<"x">>}, actor_pool:ask(P, <<"x">>)) || _ <- lists:seq(1, 8)]
        end)
    end).

%% The seed's backoff case with real crashes: ten segfaults of the only
%% worker in a row. The delay chosen for each replacement grows up to
%% max_ms, and the time it stays down grows with it (as
%% actor_pool_tests:repeated_crashes_slow_down_respawns checks for the
%% handler's crash status).
repeated_segfaults_slow_down_respawns(_Ctx) ->
    Backoff = #{min_ms => 10, max_ms => 640, jitter => 0.0},
    with_pool(?FUNCTION_NAME, crash_plugin(),
              #{workers => 1, backoff => Backoff, stable_ms => 60000}, fun(P) ->
        _ = stats_when(P, fun all_running/1),
        Rounds = [segv_once(P, K) || K <- lists:seq(1, 10)],
        Delays = [D || {D, _} <- Rounds],
        Downtimes = [T || {_, T} <- Rounds],
        ?assertEqual(lists:sort(Delays), Delays),
        ?assert(hd(Delays) =< 20),
        ?assertEqual(640, lists:last(Delays)),
        ?assert(lists:last(Delays) >= 16 * hd(Delays)),
        [?assert(T >= D) || {D, T} <- Rounds],
        ?assert(lists:last(Downtimes) > hd(Downtimes)),
        S = actor_pool:stats(P),
        ?assertMatch(#{crashes := 10, restarts := 10}, S),
        ?assertEqual(causes(#{signal => 10}), maps:get(crash_causes, S))
    end).

segv_once(P, K) ->
    T0 = erlang:monotonic_time(millisecond),
    ?assertEqual({error, {worker_crashed, sigsegv}}, actor_pool:ask(P, <<"segv">>, ?ASK_MS)),
    #{workers := [#{next_restart_ms := Delay}]} =
        stats_when(P, fun(#{workers := [#{crashes := C}]}) -> C >= K end),
    _ = stats_when(P, fun(#{restarts := R} = S) -> R >= K andalso all_running(S) end),
    {Delay, erlang:monotonic_time(millisecond) - T0}.

%% ===================================================================
%% Thread isolation
%% ===================================================================

segv_in_thread_mode_takes_the_pool_node_down(Ctx) ->
    pool_node_dies(?FUNCTION_NAME, <<"segv">>, Ctx).

abort_in_thread_mode_takes_the_pool_node_down(Ctx) ->
    pool_node_dies(?FUNCTION_NAME, <<"abort">>, Ctx).

exit_in_thread_mode_takes_the_pool_node_down(Ctx) ->
    pool_node_dies(?FUNCTION_NAME, {exit, 3}, Ctx).

%% The documented trade-off: the killer takes the whole pool node with it.
%% Its ask and an ask in flight on another pool of the node get {nodedown,
%% PoolNode}; the owner starts a new incarnation (a new OS pid) and the
%% keeper brings both pools back.
pool_node_dies(Name, Killer, #{pool_node := N}) ->
    Other = list_to_atom(atom_to_list(Name) ++ "_other"),
    NodePid = node_os_pid(),
    {ok, _} = actor_pool:start_pool(Name, crash_plugin(), #{workers => 2, isolation => thread}),
    {ok, O} = actor_pool:start_pool(Other, crash_plugin(), #{workers => 1, isolation => thread}),
    try
        Self = self(),
        InFlight = spawn_link(fun() -> Self ! {in_flight, actor_pool:ask(O, {sleep, 5000}, ?ASK_MS)} end),
        _ = stats_when(O, fun(S) -> lists:sum([M || #{mailbox := M} <- workers(S)]) >= 1 end),
        ?assertEqual({error, {nodedown, N}}, actor_pool:ask(Name, Killer, ?ASK_MS)),
        receive
            {in_flight, R} -> ?assertEqual({error, {nodedown, N}}, R)
        after ?ASK_MS -> error({in_flight_not_answered, InFlight})
        end,
        wait_new_pool_node(NodePid),
        ?assertNot(os_pid_alive(NodePid)),
        case Killer of
            <<"segv">> ->
                provoked_asan_report(NodePid, <<"ERROR: AddressSanitizer: SEGV on unknown address 0x0+ ">>,
                                     <<"SUMMARY: AddressSanitizer: SEGV [^\n]*plugin_crash.c:[0-9]+ in crash_handle">>);
            _ ->
                ok
        end,
        wait_until(fun() ->
                           Pools = actor_pool:which_pools(),
                           lists:keymember(Name, 1, Pools) andalso lists:keymember(Other, 1, Pools)
                   end, ?WAIT_MS),
        ?assertEqual({ok, <<"back">>}, actor_pool:ask(Name, <<"back">>)),
        ?assertEqual({ok, <<"back">>}, actor_pool:ask(Other, <<"back">>)),
        ?assertMatch(#{isolation := thread, size := 2}, actor_pool:stats(Name))
    after
        _ = actor_pool:stop_pool(Name),
        _ = actor_pool:stop_pool(Other)
    end.

%% Under the sanitizer run (the Makefile's eunit-asan: an ASan build of the
%% pool node, ASAN_OPTIONS naming a log_path) a crash provoked on purpose
%% writes a report as a bug would, and any report fails that run. The one
%% of process OsPid must be there and be exactly the provoked one (Expected
%% and Also match, at most one ERROR in it); it is then removed, so that
%% any other report still fails the run. Nothing to do against a normal
%% build.
provoked_asan_report(OsPid, Expected, Also) ->
    case asan_log_path() of
        none ->
            ok;
        Path ->
            File = Path ++ "." ++ integer_to_list(OsPid),
            wait_until(fun() -> filelib:is_regular(File) end, ?WAIT_MS),
            {ok, Text} = file:read_file(File),
            [?assertMatch({File, {match, _}}, {File, re:run(Text, Re)}) || Re <- [Expected, Also]],
            Errors = case re:run(Text, "==[0-9]+==ERROR:", [global]) of
                         {match, Ms} -> length(Ms);
                         nomatch -> 0
                     end,
            ?assert(Errors =< 1),
            ok = file:delete(File)
    end.

asan_log_path() ->
    Exe = os:getenv("ACTOR_POOL_NODE_EXE", ""),
    case lists:suffix("_asan", Exe) of
        false ->
            none;
        true ->
            Opts = string:split(os:getenv("ASAN_OPTIONS", ""), ":", all),
            case [P || "log_path=" ++ P <- Opts] of
                [Path | _] -> Path;
                [] -> none
            end
    end.

%% A thread cannot be killed safely: the overrunning worker is marked hung
%% (its asker gets handler_timeout at the deadline), routing skips it while
%% its handler runs, and it rejoins when the handler returns; its late
%% answer goes nowhere.
overrun_thread_is_hung_skipped_and_rejoins(_Ctx) ->
    NodePid = node_os_pid(),
    with_pool(?FUNCTION_NAME, crash_plugin(),
              #{workers => 2, isolation => thread, handler_timeout_ms => 200}, fun(P) ->
        %% A call with a plain reference for a tag, not an alias: a second
        %% answer (the late one) would land in this mailbox.
        Tag = make_ref(),
        P ! {'$gen_call', {self(), Tag}, {spin, 1500}},
        ?assertEqual({error, handler_timeout}, receive {Tag, R} -> R after ?ASK_MS -> no_answer end),
        Hung = stats_when(P, fun(S) -> length([W || #{state := hung} = W <- workers(S)]) =:= 1 end),
        [#{id := HungId}] = [W || #{state := hung} = W <- workers(Hung)],
        [#{id := OtherId}] = [W || #{state := running} = W <- workers(Hung)],
        %% Meanwhile every ask goes to the other worker.
        Meanwhile = [actor_pool:ask(P, <<"whoami">>) || _ <- lists:seq(1, 10)],
        ?assertEqual([{ok, OtherId} || _ <- Meanwhile], Meanwhile),
        ?assertMatch(#{state := hung}, worker(HungId, actor_pool:stats(P))),
        %% Back once the spin ends, and serving.
        _ = stats_when(P, fun(S) -> lists:all(fun(#{state := St}) -> St =:= running end,
                                              workers(S))
                          end),
        Ids = [Id || {ok, Id} <- [actor_pool:ask(P, <<"whoami">>) || _ <- lists:seq(1, 10)]],
        ?assertEqual(10, length(Ids)),
        ?assertEqual(lists:sort([HungId, OtherId]), lists:usort(Ids)),
        %% The late answer was dropped (the spin is over: the worker
        %% rejoined, and answered the asks since, after it).
        ?assertEqual([], flush_mailbox()),
        %% Counted as a timeout, though the worker was never replaced.
        S = actor_pool:stats(P),
        ?assertMatch(#{crashes := 1, restarts := 0}, S),
        ?assertEqual(causes(#{timeout => 1}), maps:get(crash_causes, S)),
        ?assertEqual(NodePid, node_os_pid())
    end).

%% Without a worker process there is no limit to set (refused, see the
%% options case); a bounded allocation runs in the pool node and returns.
bounded_allocation_in_thread_mode_just_works(_Ctx) ->
    NodePid = node_os_pid(),
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1, isolation => thread}, fun(P) ->
        ?assertEqual({ok, {ok, 64}}, actor_pool:ask(P, {alloc, 64}, ?ASK_MS)),
        ?assertMatch(#{crashes := 0, processed := 1}, actor_pool:stats(P)),
        ?assertEqual(NodePid, node_os_pid())
    end),
    ?assertEqual({error, {badarg, {max_memory_mb, 64}}},
                 actor_pool:start_pool(?FUNCTION_NAME, crash_plugin(),
                                       #{isolation => thread, max_memory_mb => 64})).

%% ===================================================================
%% A property: random mixes of good and killing messages
%% ===================================================================

%% Against a process-mode pool of two workers, a random sequence of asks
%% and tells, good (echoed) or killing (segv, abort, exit). Every ask gets
%% exactly one answer, the right one; the pool's counters account for every
%% message: the good ones processed, the killers crashes by their cause (a
%% tell is lost only when a worker died on it).
every_ask_answered_once_and_tells_add_up(_Ctx) ->
    Msg = proper_types:frequency(
            [{6, proper_types:exactly(good)},
             {1, proper_types:exactly(<<"segv">>)},
             {1, proper_types:exactly(<<"abort">>)},
             {1, {exit, proper_types:range(0, 9)}}]),
    Gen = proper_types:list({proper_types:oneof([ask, tell]), Msg}),
    %% Late replies to earlier cases (of this process) are not this one's.
    _ = flush_mailbox(),
    %% The property reports a failure rather than raising: this PropEr
    %% turns an exception into erlang:get_stacktrace/0's undef.
    Prop = proper:forall(Gen, fun(Ops) ->
                                      try run_mix(Ops)
                                      catch C:R:St ->
                                              io:format(user, "ops ~p~n~p:~p~n~p~n", [Ops, C, R, St]),
                                              false
                                      end
                              end),
    ?assert(proper:quickcheck(Prop, [{numtests, 30}, {max_size, 24}, noshrink,
                                     {on_output, fun(F, A) -> io:format(user, F, A) end}])).

%% Under ring traffic the pool node's loop takes its worker processes'
%% results itself while their proxies sleep (node_stats'
%% `iso_loop_results'), and answers them as a proxy would: each answer and
%% each refusal reaches its own caller, once, and the counts add up. What
%% it leaves to a proxy (answers to distribution callers, mixed in) is
%% answered too. Rounds go on until the loop has taken some (a deadline,
%% not a count of rounds: on a slow host a round may find it asleep).
loop_answers_worker_processes_under_ring_traffic(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 2, isolation => process}, fun(P) ->
        #{iso_loop_results := L0} = actor_pool:node_stats(N),
        {L1, Counts} = rounds_until_grows(N, iso_loop_results, L0, fun(R) ->
            Self = self(),
            Ring = [spawn_link(fun() ->
                                       Self ! {self(), [ring_ask(P, {R, C, K}) || K <- lists:seq(1, 100)]}
                               end) || C <- lists:seq(1, 16)],
            Dist = [spawn_link(fun() ->
                                       Self ! {self(), [gen_server:call(P, {d, R, C, K}, ?ASK_MS) =:= {ok, {d, R, C, K}}
                                                        || K <- lists:seq(1, 25)]}
                               end) || C <- lists:seq(1, 4)],
            Oks = lists:append([receive {Pid, L} -> L after 2 * ?ASK_MS -> [hung] end || Pid <- Ring ++ Dist]),
            ?assertEqual([], [X || X <- Oks, X =/= true]),
            {16 * 100 + 4 * 25, 16 * 20}
        end),
        {Asks, Refusals} = lists:unzip(Counts),
        Asked = lists:sum(Asks),
        Refused = lists:sum(Refusals),
        ?assert(L1 > L0, {iso_loop_results, L0, L1}),
        ?assertMatch(#{processed := Asked, errors := Refused, crashes := 0}, actor_pool:stats(P)),
        ?assertEqual([], flush_mailbox())
    end).

%% After a dense read with asks for worker processes, the loop waits for
%% their answers (yielding its CPU) before it naps, and answers them
%% itself while their proxies sleep (node_stats' `iso_loop_waits',
%% `iso_loop_results'). Rounds of 16 and 8 callers go on until a wait
%% caught its answers (a deadline: on a slow host a round's reads may
%% never be dense, or its answers take longer than a wait); every answer
%% is right and comes once. Then bursts of slow asks (2 ms each, 16 at
%% once: a dense read whose answers no wait catches) go on until a wait
%% runs out (`iso_loop_waits_missed'), and are all answered.
loop_waits_for_worker_process_answers_before_it_naps(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 2, isolation => process}, fun(P) ->
        #{iso_loop_waits := W0, iso_loop_results := L0, iso_loop_waits_missed := M0,
          ring_ask_naps := A0} = actor_pool:node_stats(N),
        {W1, Counts} = rounds_until_grows(N, iso_loop_waits, W0, fun(R) ->
            K = 16 div (1 + R rem 2),
            Oks = in_parallel(K, fun(C) -> [ring_ask(P, {R, C, I}) || I <- lists:seq(1, 200)] end),
            ?assertEqual([], [X || X <- lists:append(Oks), X =/= true]),
            K * 200
        end),
        Asked = lists:sum(Counts),
        #{iso_loop_results := L1} = actor_pool:node_stats(N),
        ?assert(W1 > W0, {iso_loop_waits, W0, W1}),
        ?assert(L1 > L0, {iso_loop_results, L0, L1}),
        ?assertMatch(#{processed := Asked, crashes := 0}, actor_pool:stats(P)),
        {M1, _} = rounds_until_grows(N, iso_loop_waits_missed, M0, fun(_) ->
            Slow = in_parallel(16, fun(_) -> [actor_pool:ask(P, {sleep, 2}, ?ASK_MS) =:= {ok, ok}] end),
            ?assertEqual([], [X || X <- lists:append(Slow), X =/= true])
        end),
        ?assert(M1 > M0, {iso_loop_waits_missed, M0, M1}),
        %% Each wait comes before an ask nap (counted first).
        #{iso_loop_waits := W2, ring_ask_naps := A2} = actor_pool:node_stats(N),
        ?assert(W2 - W0 + M1 - M0 =< A2 - A0, {W0, M0, A0, W2, M1, A2}),
        ?assertEqual([], flush_mailbox())
    end).

%% A worker process whose handlers are quick moves, after an ask, to the
%% CPU its pool node's loop runs on (node_stats' `iso_follows'), and hands
%% itself back the CPUs it started with (the pool node's), however it was
%% pinned from outside meanwhile. Each round pins both processes to a CPU
%% the loop is not on as the round starts, and runs 16 callers of asks;
%% rounds go on until both came back to the pool node's CPUs (a deadline:
%% the loop may move to their CPU first). On a host of one CPU there is
%% nowhere to move: the count stays and the masks are never touched.
worker_processes_with_quick_asks_follow_the_loop(#{pool_node := N}) ->
    with_pool(?FUNCTION_NAME, echo, #{workers => 2, isolation => process}, fun(P) ->
        Pids = os_pids(stats_when(P, fun all_running/1)),
        NodePid = node_os_pid(),
        NodeCpus = cpus_allowed(NodePid),
        #{iso_follows := F0} = actor_pool:node_stats(N),
        Round = fun(R) ->
            Oks = in_parallel(16, fun(C) -> [actor_pool:ask(P, {R, C, I}, ?ASK_MS) =:= {ok, {R, C, I}}
                                             || I <- lists:seq(1, 200)] end),
            ?assertEqual([], [X || X <- lists:append(Oks), X =/= true])
        end,
        case NodeCpus of
            [_] ->
                [Round(R) || R <- lists:seq(1, 3)],
                ?assertMatch(#{iso_follows := F0}, actor_pool:node_stats(N)),
                ?assertEqual([NodeCpus, NodeCpus], [cpus_allowed(Pid) || Pid <- Pids]);
            _ ->
                Deadline = erlang:monotonic_time(millisecond) + 30000,
                Back = follow_rounds(Pids, NodePid, NodeCpus, Round, 1, Deadline),
                ?assert(Back, {not_back, [cpus_allowed(Pid) || Pid <- Pids], NodeCpus}),
                #{iso_follows := F1} = actor_pool:node_stats(N),
                ?assert(F1 >= F0 + length(Pids), {iso_follows, F0, F1})
        end,
        ?assertMatch(#{crashes := 0}, actor_pool:stats(P)),
        ?assertEqual(Pids, os_pids(actor_pool:stats(P)))
    end).

follow_rounds(Pids, NodePid, NodeCpus, Round, R, Deadline) ->
    Away = hd(NodeCpus -- [on_cpu(NodePid)]),
    [pin(Pid, Away) || Pid <- Pids],
    Round(R),
    Back = fun() -> lists:all(fun(Pid) -> cpus_allowed(Pid) =:= NodeCpus end, Pids) end,
    case poll(Back, fun(B) -> B end, 1000) of
        {ok, true} -> true;
        {timeout, false} ->
            erlang:monotonic_time(millisecond) < Deadline
                andalso follow_rounds(Pids, NodePid, NodeCpus, Round, R + 1, Deadline)
    end.

%% The CPUs an OS process may run on (its main thread's), sorted.
cpus_allowed(OsPid) ->
    {ok, B} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/status"),
    {match, [L]} = re:run(B, "Cpus_allowed_list:\\s*(\\S+)", [{capture, all_but_first, list}]),
    lists:usort(lists:append([case string:split(Part, "-") of
                                  [A, Z] -> lists:seq(list_to_integer(A), list_to_integer(Z));
                                  [A] -> [list_to_integer(A)]
                              end || Part <- string:split(L, ",", all)])).

%% The CPU an OS process's main thread (the pool node's loop) last ran on.
on_cpu(OsPid) ->
    {ok, B} = file:read_file("/proc/" ++ integer_to_list(OsPid) ++ "/stat"),
    [_, Rest] = binary:split(B, <<") ">>),
    list_to_integer(lists:nth(37, string:lexemes(binary_to_list(Rest), " "))).

pin(OsPid, Cpu) ->
    Out = os:cmd("taskset -p -c " ++ integer_to_list(Cpu) ++ " " ++ integer_to_list(OsPid)),
    ?assertMatch({match, _}, re:run(Out, "new affinity list: " ++ integer_to_list(Cpu)), Out).

%% Fun(R) for rounds R = 1, 2, ... until node N's node_stats counter Key
%% is over From, or 30 s have passed (a deadline, not a count of rounds: on
%% a slow host a round may not move it): {Key's value then, Fun's results
%% in order}.
rounds_until_grows(N, Key, From, Fun) ->
    rounds_until_grows(N, Key, From, Fun, erlang:monotonic_time(millisecond) + 30000, []).

rounds_until_grows(N, Key, From, Fun, Deadline, Acc) ->
    Acc1 = [Fun(length(Acc) + 1) | Acc],
    #{Key := V} = actor_pool:node_stats(N),
    case V > From orelse erlang:monotonic_time(millisecond) > Deadline of
        true -> {V, lists:reverse(Acc1)};
        false -> rounds_until_grows(N, Key, From, Fun, Deadline, Acc1)
    end.

%% Fun(C) for C in 1..K, each in its own process at once: their results,
%% in order of C.
in_parallel(K, Fun) ->
    Self = self(),
    Pids = [spawn_link(fun() -> Self ! {self(), Fun(C)} end) || C <- lists:seq(1, K)],
    [receive {Pid, L} -> L after 4 * ?ASK_MS -> [hung] end || Pid <- Pids].

%% Every fifth a refusal ({error, Why}), the others echoed.
ring_ask(P, {_, _, K}) when K rem 5 =:= 0 ->
    actor_pool:ask(P, {fail, refused}, ?ASK_MS) =:= {error, refused};
ring_ask(P, M) ->
    actor_pool:ask(P, M, ?ASK_MS) =:= {ok, M}.

run_mix(Ops) ->
    Name = list_to_atom("iso_prop_" ++ integer_to_list(erlang:unique_integer([positive]))),
    with_pool(Name, crash_plugin(),
              #{workers => 2, backoff => #{min_ms => 1, max_ms => 10}}, fun(P) ->
        Self = self(),
        Numbered = lists:zip(lists:seq(1, length(Ops)), Ops),
        %% Each ask from its own process, so several are in flight at once;
        %% once told, each reports what else reached it (a second answer).
        Askers = [{I, M, spawn_link(fun() ->
                                            Self ! {mix, I, actor_pool:ask(P, mix_msg(I, M), ?ASK_MS)},
                                            receive done -> Self ! {mix_left, I, flush_mailbox()} end
                                    end)}
                  || {I, {ask, M}} <- Numbered],
        [ok = actor_pool:tell(P, mix_msg(I, M)) || {I, {tell, M}} <- Numbered],
        Got = [{I, receive {mix, I, R} -> R after 2 * ?ASK_MS -> no_answer end}
               || {I, _, _} <- Askers],
        Want = [{I, mix_answer(I, M)} || {I, M, _} <- Askers],
        Goods = length([x || {_, good} <- Ops]),
        Killers = length(Ops) - Goods,
        Signals = length([x || {_, B} <- Ops, is_binary(B)]),
        Exits = Killers - Signals,
        Counted = stats_until(P, fun(#{processed := Pr, crashes := C}) ->
                                         Pr + C >= Goods + Killers
                                 end),
        %% A barrier: every worker handled what it had before these.
        [{ok, barrier} = actor_pool:ask(P, barrier, ?ASK_MS) || _ <- lists:seq(1, 2)],
        [A ! done || {_, _, A} <- Askers],
        Stray = lists:append([receive {mix_left, I, Left} -> Left after ?ASK_MS -> [no_report] end
                              || {I, _, _} <- Askers]) ++ flush_mailbox(),
        Ok = Got =:= Want andalso Stray =:= []
            andalso is_map(Counted)
            andalso maps:get(processed, Counted) =:= Goods
            andalso maps:get(crashes, Counted) =:= Killers
            andalso maps:get(crash_causes, Counted) =:= causes(#{signal => Signals, exit => Exits}),
        Ok orelse io:format(user, "ops ~p~ngot ~p~nwant ~p~nstray ~p~nstats ~p~n",
                            [Ops, Got, Want, Stray, Counted]),
        Ok
    end).

mix_msg(I, good) -> {good, I};
mix_msg(_I, Killer) -> Killer.

mix_answer(I, good) -> {ok, {good, I}};
mix_answer(_I, <<"segv">>) -> {error, {worker_crashed, sigsegv}};
mix_answer(_I, <<"abort">>) -> {error, {worker_crashed, sigabrt}};
mix_answer(_I, {exit, Code}) -> {error, {worker_crashed, {exit, Code}}}.

%% ===================================================================
%% No orphans
%% ===================================================================

stop_pool_leaves_no_worker_process(_Ctx) ->
    NodePid = node_os_pid(),
    Before = descendants(NodePid),
    {ok, P} = actor_pool:start_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 3}),
    Pids = try
               Ps = os_pids(stats_when(P, fun all_running/1)),
               ?assertEqual(lists:sort(Ps), worker_processes(NodePid) -- Before),
               Ps
           after
               ok = actor_pool:stop_pool(P)
           end,
    ?assertEqual(3, length(Pids)),
    [?assertNot(lists:member(Pid, Before)) || Pid <- Pids],
    wait_until(fun() -> not lists:any(fun ap_support:os_pid_alive/1, Pids) end, ?WAIT_MS),
    wait_until(fun() -> descendants(NodePid) -- Before =:= [] end, ?WAIT_MS),
    ?assertEqual([], worker_processes(NodePid) -- Before).

%% stop_pool/1's contract in both modes: the message a worker is running
%% finishes, the asks queued behind it are answered {error, stopped} at
%% once (a worker process, handed its queue ahead through its ring, used
%% to run all of it first).
stop_pool_answers_queued_asks_stopped_in_both_modes(_Ctx) ->
    [begin
         {ok, P} = actor_pool:start_pool(?FUNCTION_NAME, crash_plugin(),
                                         #{workers => 1, isolation => Iso}),
         _ = stats_when(P, fun all_running/1),
         Reqs = [gen_server:send_request(P, {sleep, 500}) || _ <- lists:seq(1, 4)],
         _ = stats_when(P, fun(S) -> [4] =:= [M || #{mailbox := M} <- workers(S)] end),
         ok = actor_pool:stop_pool(P),
         [First | Queued] = [gen_server:wait_response(R, ?ASK_MS) || R <- Reqs],
         ?assert(lists:member(First, [{reply, {ok, ok}}, {reply, {error, stopped}}])),
         ?assertEqual({Iso, [{reply, {error, stopped}} || _ <- Queued]}, {Iso, Queued})
     end || Iso <- [thread, process]].

%% stop_pool/1 by name while the workers still run their init (1 s each):
%% the start returns {error, stopped}, not a handler's failure (a worker
%% process stopped in its init used to read as one: handler_init_failed
%% -10), no worker process is left, and the name is free again.
stop_pool_while_starting_answers_stopped_in_both_modes(_Ctx) ->
    NodePid = node_os_pid(),
    {plugin, Path} = crash_plugin(),
    [begin
         Self = self(),
         Starter = spawn_link(fun() ->
                                      Self ! {started, actor_pool:start_pool(
                                                         ?FUNCTION_NAME, {plugin, Path, {init_sleep, 1000}},
                                                         #{workers => 2, isolation => Iso})}
                              end),
         %% Known by name from the start request on, its workers starting.
         wait_until(fun() -> is_map(catch actor_pool:stats(?FUNCTION_NAME)) end, ?WAIT_MS),
         ok = actor_pool:stop_pool(?FUNCTION_NAME),
         receive
             {started, R} -> ?assertEqual({Iso, {error, stopped}}, {Iso, R})
         after ?ASK_MS -> error({no_start_answer, Iso, Starter})
         end,
         wait_until(fun() -> worker_processes(NodePid) =:= [] end, ?WAIT_MS),
         {ok, P} = actor_pool:start_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 1, isolation => Iso}),
         ?assertEqual({ok, <<"again">>}, actor_pool:ask(P, <<"again">>)),
         ok = actor_pool:stop_pool(P)
     end || Iso <- [process, thread]],
    ok.

%% A replacement is `restarting' until its init is done (1.5 s here), and
%% routing skips it meanwhile: the other worker takes every ask, none waits
%% behind the init. Before, a replacement in its init read `running', and
%% round robin queued every second ask behind it.
replacement_in_its_init_is_restarting_and_skipped_in_both_modes(_Ctx) ->
    {plugin, Path} = crash_plugin(),
    [begin
         Name = list_to_atom("init_skipped_" ++ atom_to_list(Iso)),
         Opts = #{workers => 2, isolation => Iso, backoff => #{min_ms => 10, max_ms => 10}},
         with_pool(Name, {plugin, Path, {init_sleep, 1500}}, Opts, fun(P) ->
             _ = stats_when(P, fun all_running/1),
             ?assertEqual({error, worker_crashed}, actor_pool:ask(P, <<"crash">>, ?ASK_MS)),
             %% Replaced (restarts 1; in process mode, its process
             %% spawned) and still in its init.
             Started = fun(#{restarts := 1, os_pid := Pid}) -> Iso =:= thread orelse is_integer(Pid);
                          (_) -> false
                       end,
             InInit = stats_when(P, fun(S) -> lists:any(Started, workers(S)) end),
             [#{id := Id} = New] = lists:filter(Started, workers(InInit)),
             [#{id := OtherId}] = [W || #{id := I} = W <- workers(InInit), I =/= Id],
             ?assertMatch({Iso, #{state := restarting, alive := false}}, {Iso, New}),
             Meanwhile = [actor_pool:ask(P, <<"whoami">>, ?ASK_MS) || _ <- lists:seq(1, 10)],
             ?assertEqual({Iso, [{ok, OtherId} || _ <- Meanwhile]}, {Iso, Meanwhile}),
             %% Then it serves again.
             _ = stats_when(P, fun all_running/1),
             Ids = [I || {ok, I} <- [actor_pool:ask(P, <<"whoami">>, ?ASK_MS) || _ <- lists:seq(1, 10)]],
             ?assertEqual({Iso, [0, 1]}, {Iso, lists:usort(Ids)})
         end)
     end || Iso <- [process, thread]],
    ok.

%% A tell from a same-host ring that finds everything before it already
%% at its worker process goes straight into the process's request ring,
%% with no job (node_stats' `iso_bare_tells'): the record is then the pool
%% node's only copy. Worker 0's process sleeps on an ask while tells pile
%% up behind it that way; kill -9 of it makes them jobs again
%% (`iso_bare_rehydrated'), and every one is handled: alone, by the
%% replacement; with two workers, by the other one. Only the ask it died
%% on is lost, answered as such.
killed_worker_process_hands_on_its_bare_tells(#{pool_node := N}) ->
    [begin
         Name = list_to_atom("bare_tells_" ++ integer_to_list(Workers)),
         %% The sleeping worker keeps its bare tells until it is killed:
         %% no stall moves them, no deadline kills it first.
         with_pool(Name, crash_plugin(), #{workers => Workers, routing => round_robin,
                                           backoff => #{min_ms => 20, max_ms => 20},
                                           stall_ms => infinity, handler_timeout_ms => infinity}, fun(P) ->
             S0 = stats_when(P, fun all_running/1),
             #{os_pid := Victim} = worker(0, S0),
             #{iso_bare_tells := B0, iso_bare_rehydrated := H0} = actor_pool:node_stats(N),
             Self = self(),
             %% Round robin's first: worker 0.
             spawn_link(fun() -> Self ! {slept, actor_pool:ask(P, {sleep, 60000}, ?ASK_MS)} end),
             _ = stats_when(P, fun(S) -> maps:get(mailbox, worker(0, S)) >= 1 end),
             Told = tell_until_bare(P, N, B0 + 20 * Workers, 0),
             kill_9(Victim),
             ?assertEqual({Workers, {error, {worker_crashed, sigkill}}},
                          {Workers, receive {slept, A} -> A after ?ASK_MS -> no_answer end}),
             S1 = stats_when(P, fun(S) -> all_running(S) andalso maps:get(processed, S) >= Told end),
             ?assertMatch(#{dropped_tells := 0, crashes := 1, errors := 0}, S1),
             ?assertEqual({Workers, Told}, {Workers, maps:get(processed, S1)}),
             #{iso_bare_tells := B1, iso_bare_rehydrated := H1} = actor_pool:node_stats(N),
             ?assert(H1 > H0, {Workers, rehydrated, H0, H1}),
             %% Worker 0's child ran none of its bare tells: alone, every
             %% bare tell was its.
             Workers =:= 1 andalso ?assertEqual(B1 - B0, H1 - H0),
             ?assert(H1 - H0 =< B1 - B0),
             _ = stats_when(P, fun(St) -> [0] =:= lists:usort([M || #{mailbox := M} <- workers(St)]) end),
             ?assertEqual({ok, <<"after">>}, actor_pool:ask(P, <<"after">>))
         end)
     end || Workers <- [1, 2]],
    ok.

%% Tells in rounds of 10 until node_stats' iso_bare_tells reaches Target (a
%% deadline, not a count: the proxy may be awake at first); how many.
tell_until_bare(P, N, Target, Told) ->
    [ok = actor_pool:tell(P, <<"t">>) || _ <- lists:seq(1, 10)],
    #{iso_bare_tells := B} = actor_pool:node_stats(N),
    case B >= Target orelse Told > 100000 of
        true -> Told + 10;
        false -> tell_until_bare(P, N, Target, Told + 10)
    end.

%% A flood of tells into one worker with a mailbox of 8, in both modes:
%% each is processed or counted dropped (none lost), the mailbox ends
%% empty, and the worker answers. In process mode the tells its child has
%% finished leave the mailbox when the pool node's loop sends the next one
%% or, full, when it routes the next one; else when the child idles.
tell_flood_into_a_small_mailbox_is_all_counted_in_both_modes(_Ctx) ->
    N = 20000,
    [begin
         Name = list_to_atom("flood_small_mailbox_" ++ atom_to_list(Iso)),
         with_pool(Name, crash_plugin(), #{workers => 1, mailbox_limit => 8, isolation => Iso}, fun(P) ->
             _ = stats_when(P, fun all_running/1),
             [ok = actor_pool:tell(P, <<"t">>) || _ <- lists:seq(1, N)],
             S = stats_when(P, fun(#{processed := Pr, dropped_tells := D}) -> Pr + D >= N end),
             ?assertMatch(#{crashes := 0, errors := 0}, S),
             ?assertEqual({Iso, N}, {Iso, maps:get(processed, S) + maps:get(dropped_tells, S)}),
             ?assert(maps:get(processed, S) > 0),
             _ = stats_when(P, fun(St) -> [0] =:= [M || #{mailbox := M} <- workers(St)] end),
             ?assertEqual({ok, <<"after">>}, actor_pool:ask(P, <<"after">>))
         end)
     end || Iso <- [process, thread]],
    ok.

%% kill -9 of the pool node: its worker processes die with it
%% (PR_SET_PDEATHSIG), and the pool comes back with new ones.
killed_pool_node_leaves_no_worker_process(_Ctx) ->
    Name = ?FUNCTION_NAME,
    NodePid = node_os_pid(),
    {ok, P} = actor_pool:start_pool(Name, crash_plugin(), #{workers => 2}),
    try
        Pids = os_pids(stats_when(P, fun all_running/1)),
        ?assertEqual(lists:sort(Pids), worker_processes(NodePid)),
        kill_9(NodePid),
        %% Reparented, they would be found by their command line.
        wait_until(fun() -> not lists:any(fun ap_support:os_pid_alive/1, [NodePid | Pids])
                                andalso worker_processes(NodePid) =:= []
                   end, ?WAIT_MS),
        wait_new_pool_node(NodePid),
        wait_until(fun() -> lists:keymember(Name, 1, actor_pool:which_pools()) end, ?WAIT_MS),
        S = stats_when(Name, fun all_running/1),
        ?assertEqual(2, length(os_pids(S))),
        [?assertNot(lists:member(Pid, Pids)) || Pid <- os_pids(S)],
        ?assertEqual({ok, <<"back">>}, actor_pool:ask(Name, <<"back">>))
    after
        _ = actor_pool:stop_pool(Name)
    end.

%% The application stops its pool node, and the worker processes go too.
application_stop_leaves_no_worker_process(_Ctx) ->
    NodePid = node_os_pid(),
    {ok, P} = actor_pool:start_pool(?FUNCTION_NAME, crash_plugin(), #{workers => 2}),
    Pids = os_pids(stats_when(P, fun all_running/1)),
    ?assertEqual(lists:sort(Pids), worker_processes(NodePid)),
    ok = application:stop(actor_pool),
    try
        wait_until(fun() -> not lists:any(fun ap_support:os_pid_alive/1, [NodePid | Pids])
                                andalso worker_processes(NodePid) =:= []
                   end, ?WAIT_MS)
    after
        %% For the fixture's cleanup.
        {ok, _} = application:ensure_all_started(actor_pool)
    end.

%% ===================================================================
%% Helpers
%% ===================================================================

node_os_pid() ->
    #{os_pid := OsPid, status := up} = actor_cnode:info(actor_pool_node_owner),
    OsPid.

kill_9(OsPid) ->
    _ = os:cmd("kill -9 " ++ integer_to_list(OsPid)),
    ok.

%% Three pools beside the one under test: an echo pool (threads), a plugin
%% pool in worker processes and one in threads. Fun gets them with what
%% they looked like before.
with_neighbours(Name, Fun) ->
    Specs = [{"_nb_echo", echo, #{workers => 1}},
             {"_nb_proc", crash_plugin(), #{workers => 2}},
             {"_nb_thread", crash_plugin(), #{workers => 1, isolation => thread}}],
    Started = [begin
                   N = list_to_atom(atom_to_list(Name) ++ Suffix),
                   {ok, P} = actor_pool:start_pool(N, H, O),
                   P
               end || {Suffix, H, O} <- Specs],
    try
        Ns = [{P, os_pids(stats_when(P, fun all_running/1))} || P <- Started],
        Fun(Ns)
    after
        [actor_pool:stop_pool(P) || P <- Started]
    end.

%% Each neighbour answers, has lost nothing, and kept its worker processes.
check_neighbours(Ns) ->
    [begin
         ?assertEqual({ok, {neighbour, I}}, actor_pool:ask(P, {neighbour, I})),
         S = actor_pool:stats(P),
         ?assertMatch(#{crashes := 0, restarts := 0}, S),
         ?assertEqual(Pids, os_pids(S))
     end || {{P, Pids}, I} <- lists:zip(Ns, lists:seq(1, length(Ns)))],
    ok.

causes(Counts) ->
    maps:merge(#{signal => 0, exit => 0, timeout => 0, handler => 0}, Counts).

workers(#{workers := Ws}) ->
    lists:sort(fun(#{id := A}, #{id := B}) -> A =< B end, Ws).

worker(Id, S) ->
    [W] = [W || #{id := I} = W <- workers(S), I =:= Id],
    W.

%% The worker processes' OS pids by worker id ([] in thread mode).
os_pids(S) ->
    [Pid || #{os_pid := Pid} <- workers(S), is_integer(Pid)].

%% Every worker up and serving; in process mode each with its process.
all_running(#{isolation := process} = S) ->
    lists:all(fun(#{alive := A, state := St, os_pid := Pid}) ->
                      A andalso St =:= running andalso is_integer(Pid)
              end, workers(S));
all_running(S) ->
    lists:all(fun(#{alive := A, state := St}) -> A andalso St =:= running end, workers(S)).

%% The pool's stats once Pred holds for them (polled, with a deadline).
stats_when(P, Pred) ->
    case poll_stats(P, Pred) of
        {ok, S} -> S;
        {timeout, _} -> error({condition_not_met_within_ms, ?WAIT_MS})
    end.

%% Like stats_when/2, but the last stats (or the error) when Pred never
%% holds: for the property, which reports rather than raises.
stats_until(P, Pred) ->
    case poll_stats(P, Pred) of
        {ok, S} -> S;
        {timeout, _} -> actor_pool:stats(P)
    end.

poll_stats(P, Pred) ->
    ap_support:poll(fun() -> actor_pool:stats(P) end,
                    fun(#{} = S) -> Pred(S); (_) -> false end, ?WAIT_MS).

%% The OS processes below OsPid: its children (of any of its threads), and
%% theirs.
descendants(OsPid) ->
    Kids = children(OsPid),
    Kids ++ lists:append([descendants(K) || K <- Kids]).

children(OsPid) ->
    Dir = "/proc/" ++ integer_to_list(OsPid) ++ "/task",
    Tids = case file:list_dir(Dir) of
               {ok, Ts} -> Ts;
               {error, _} -> []
           end,
    lists:usort(lists:append(
                  [case file:read_file(Dir ++ "/" ++ T ++ "/children") of
                       {ok, B} -> [binary_to_integer(X) || X <- binary:split(B, <<" ">>, [global, trim_all])];
                       {error, _} -> []
                   end || T <- Tids])).

%% The live worker processes of pool node OsPid wherever they are in the
%% process tree (an orphan is reparented): found by the command line the
%% pool node gives them, which names it (`--isolated-worker <its pid>').
%% The cases first check that this finds exactly the workers stats/1 lists.
worker_processes(OsPid) ->
    Want = [<<"--isolated-worker">>, integer_to_binary(OsPid)],
    {ok, Entries} = file:list_dir("/proc"),
    lists:sort([Pid || E <- Entries,
                       Pid <- [catch list_to_integer(E)], is_integer(Pid),
                       case file:read_file("/proc/" ++ E ++ "/cmdline") of
                           {ok, Cmd} ->
                               [_Argv0 | Args] = binary:split(Cmd, <<0>>, [global]),
                               lists:prefix(Want, Args);
                           {error, _} -> false
                       end,
                       os_pid_alive(Pid)]).

flush_mailbox() ->
    receive M -> [M | flush_mailbox()] after 0 -> [] end.

%% The pool node's owner reports a new incarnation (another OS pid) up.
wait_new_pool_node(OldOsPid) ->
    wait_until(fun() ->
                       case actor_cnode:info(actor_pool_node_owner) of
                           #{status := up, os_pid := New} -> New =/= OldOsPid;
                           _ -> false
                       end
               end, 20000).
